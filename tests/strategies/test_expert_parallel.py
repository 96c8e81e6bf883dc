"""`expert_parallel` construction and set-up errors, and the layouts, in one process."""

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import ExpertParallelStrategy
from lightning_commstrats.strategies.expert_parallel import layout_groups


def test_layouts():
    # hierarchical: replicas of the same experts are neighbours, expert groups span them
    assert layout_groups(4, 2, 2, "dp") == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    # symmetric: each expert-parallel group on neighbouring ranks
    assert layout_groups(4, 2, 2, "ep") == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="dp_size x ep_size = 2 x 3 = 6 must equal the world size 4"):
        layout_groups(4, 2, 3, "dp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ep_size": 0}, "ep_size must be a positive int"),
        ({"dp_size": -1}, "dp_size must be a positive int"),
        ({"inner": "tp"}, "inner='tp' is not supported"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertParallelStrategy(**kwargs)


def test_layout_must_match_the_world_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"ep_size=3 must divide the world size 1"):
        L.Trainer(accelerator="cpu", devices=1, strategy=ExpertParallelStrategy(ep_size=3), logger=False)
    with pytest.raises(ValueError, match=r"dp_size x ep_size = 2 x 1 must equal the world size 1"):
        L.Trainer(accelerator="cpu", devices=1, strategy=ExpertParallelStrategy(ep_size=1, dp_size=2), logger=False)


def test_a_model_without_moe_layers_is_refused():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="expert_parallel",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError, match="expert_parallel needs a model with MoE layers"):
        trainer.fit(BoringModel())


def test_experts_not_divisible_by_ep_size():
    from types import SimpleNamespace

    import torch

    from lightning_commstrats.moe import MoELayer

    layer = MoELayer(4, 8, 3)
    with pytest.raises(ValueError, match="num_experts=3 is not divisible by the expert-parallel size 2"):
        layer.shard(SimpleNamespace(world_size=2, rank=0))
    assert layer.experts.count == 3 and isinstance(layer.experts.w1, torch.nn.Parameter)
