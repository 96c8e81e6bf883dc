"""Building empty and materialising shard by shard (lightning_commstrats.sharding.materialize), in one process."""

import pytest
import torch
from torch import nn

from lightning_commstrats.sharding.materialize import (
    check_initialisable,
    has_meta,
    materialize,
    parameters_on_meta,
)
from lightning_commstrats.sharding.policy import ShardPolicy, apply_fsdp


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 16)
        self.out.weight = self.emb.weight
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))


class Raw(nn.Module):
    """A module with a bare parameter and no initialiser."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.inner = nn.Linear(3, 3)


class OwnInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.raw = Raw()
        self.calls = 0

    def init_weights(self) -> None:
        self.calls += 1
        nn.init.constant_(self.raw.scale, 2.0)
        nn.init.constant_(self.raw.inner.weight, 0.5)
        nn.init.zeros_(self.raw.inner.bias)


def test_parameters_go_to_meta_buffers_stay_real_and_ties_stay_ties():
    with parameters_on_meta():
        model = Tied()
    assert all(p.is_meta for p in model.parameters())
    assert model.out.weight is model.emb.weight
    assert not model.mask.is_meta and torch.equal(model.mask, torch.tril(torch.ones(4, 4)))
    # outside the context, modules are built as usual
    assert not nn.Linear(2, 2).weight.is_meta


def test_materialize_without_sharding_initialises_as_each_module_resets():
    torch.manual_seed(0)
    with parameters_on_meta():
        model = Tied()
    calls = materialize(model, torch.device("cpu"))
    assert not has_meta(model) and model.out.weight is model.emb.weight
    assert torch.equal(model.norm.weight, torch.ones(8))
    # the tied weight keeps the embedding's draw (N(0, 1)), as a tie made in __init__ leaves it:
    # the output layer's reset (kaiming, |w| <= 1/sqrt(8) = 0.35) runs first
    assert model.emb.weight.abs().max() > 0.5
    assert calls.index("out.reset_parameters") < calls.index("emb.reset_parameters")
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))  # a real buffer is left alone


def test_a_module_without_an_initialiser_is_refused_by_name():
    with torch.device("meta"):
        model = Raw()
    with pytest.raises(ValueError, match=r"\(the root\) \(Raw: scale\).*reset_parameters\(\).*init_weights\(\)"):
        check_initialisable(model)
    with pytest.raises(ValueError, match="Raw: scale"):
        materialize(model, torch.device("cpu"))
    assert has_meta(model)  # nothing was allocated


def test_the_models_own_init_weights_covers_its_subtree_and_runs_once():
    with torch.device("meta"):
        model = OwnInit()
    check_initialisable(model)  # Raw has no initialiser, but init_weights covers it
    calls = materialize(model, torch.device("cpu"))
    assert calls == ["OwnInit.init_weights"] and model.calls == 1
    assert torch.equal(model.raw.scale.detach(), torch.full((3,), 2.0))


def test_sharded_materialisation_allocates_only_the_local_shard_and_draws_per_index(one_rank_mesh):
    from lightning_commstrats.sharding import is_dtensor

    draws = []
    for index in (0, 1, 0):
        torch.manual_seed(5)
        with parameters_on_meta():
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        apply_fsdp(model, one_rank_mesh, ShardPolicy(min_unit_numel=1))
        materialize(model, torch.device("cpu"), index=index)
        assert all(is_dtensor(p) and not p.to_local().is_meta for p in model.parameters())
        draws.append(model[0].weight.to_local().clone())
    assert not torch.equal(draws[0], draws[1])  # rank 1 of a group draws its own shard
    assert torch.equal(draws[0], draws[2])  # every group draws the same
    assert torch.initial_seed() == 5  # the generator is given back


def test_an_unsharded_empty_build_warns_and_a_first_step_nan_says_the_model_was_never_initialised(caplog):
    import lightning as L

    from lightning_commstrats import DiLoCoStrategy

    strategy = DiLoCoStrategy(sync_period=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    with caplog.at_level("WARNING", logger="lightning_commstrats"), trainer.init_module(empty_init=True):
        model = nn.Linear(4, 4)
    assert not model.weight.is_meta  # as Lightning's ddp: memory, but no initialisation
    assert "leaves the weights uninitialised, as Lightning's ddp does" in caplog.text
    never = r"the model was never initialised\. It was built with init_module\(empty_init=True\)"
    with pytest.raises(FloatingPointError, match=never):
        strategy.handle_nonfinite(["weight"], "gradients")
    strategy.optimizer_steps = 3  # later, a NaN is the training's own
    with pytest.raises(FloatingPointError, match="Lower the learning rate"):
        strategy.handle_nonfinite(["weight"], "gradients")


def test_a_sharded_empty_build_puts_the_parameters_on_meta():
    import lightning as L

    from lightning_commstrats import DiLoCoStrategy

    strategy = DiLoCoStrategy(sync_period=2, shard="fsdp", group_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    with trainer.init_module(empty_init=True):
        model = Tied()
    assert all(p.is_meta for p in model.parameters()) and not model.mask.is_meta
    assert not strategy.built_uninitialised


def test_an_lstm_built_on_meta_runs_after_materialisation():
    torch.manual_seed(0)
    with parameters_on_meta():
        lstm = nn.LSTM(4, 8, batch_first=True)
    materialize(lstm, torch.device("cpu"))
    out, _ = lstm(torch.randn(2, 3, 4))
    assert torch.isfinite(out).all() and out.abs().sum() > 0
