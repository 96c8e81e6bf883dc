import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, not failed, on a machine without a GPU (``pytest -m cuda``
    then reports them skipped and exits 0)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launcher exports LOCAL_RANK, MASTER_PORT... into os.environ during fit; a later
    Trainer in the same process would take them for an external launch. Each test starts clean."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
