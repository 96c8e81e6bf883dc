import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launcher exports LOCAL_RANK, MASTER_PORT... into os.environ during fit; a later
    Trainer in the same process would take them for an external launch. Each test starts clean."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
