"""Building empty and materialising shard by shard (lightning_commstrats.sharding.materialize), in one process."""

import lightning as L
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
from tests.one_rank import one_rank_trainer


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
    calls, unwritten = materialize(model, torch.device("cpu"))
    assert not has_meta(model) and model.out.weight is model.emb.weight and unwritten == []
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
    calls, unwritten = materialize(model, torch.device("cpu"))
    assert calls == ["OwnInit.init_weights"] and model.calls == 1 and unwritten == []
    assert torch.equal(model.raw.scale.detach(), torch.full((3,), 2.0))


def test_sharded_materialisation_allocates_only_the_local_shard_and_draws_per_index(one_rank_mesh):
    from lightning_commstrats.sharding import is_dtensor

    draws = []
    for index in (0, 1, 0):
        torch.manual_seed(5)
        with parameters_on_meta():
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        apply_fsdp(model, one_rank_mesh, ShardPolicy(min_unit_numel=1))
        assert materialize(model, torch.device("cpu"), index=index)[1] == []
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
    assert materialize(lstm, torch.device("cpu"))[1] == []
    out, _ = lstm(torch.randn(2, 3, 4))
    assert torch.isfinite(out).all() and out.abs().sum() > 0


class Rotary(nn.Module):
    """A layer with a rotary-style cache (a buffer), and an initialiser of its own that covers its
    Linear only (as ``model.apply(init)`` over ``Linear`` modules does), or that also recomputes the cache
    by assigning a new tensor (as LitGPT's ``GPT.reset_parameters`` does)."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("cos", torch.cos(torch.arange(6.0)))
        self.recompute = recompute

    def init_weights(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)
        if self.recompute:
            self.cos = torch.cos(torch.arange(6.0, device=self.proj.weight.device))


def test_what_an_init_weights_leaves_unwritten_is_found_and_a_replaced_buffer_counts_as_written():
    with torch.device("meta"):
        missed, recomputed = Rotary(recompute=False), Rotary(recompute=True)
    assert materialize(missed, torch.device("cpu")) == (["Rotary.init_weights"], ["cos"])
    assert materialize(recomputed, torch.device("cpu"))[1] == []
    assert torch.equal(recomputed.cos, torch.cos(torch.arange(6.0)))
    # a NaN an initialiser writes on purpose (a sentinel) is not the mark: it passes; in bfloat16 as well
    with torch.device("meta"):
        sentinel = Rotary(recompute=False).to(torch.bfloat16)
    sentinel.init_weights = lambda: (sentinel.proj.reset_parameters(), sentinel.cos.fill_(float("nan")))
    assert materialize(sentinel, torch.device("cpu"))[1] == []
    # built with init_module(empty_init=True)'s context the buffer is real: nothing to miss
    with parameters_on_meta():
        real_buffer = Rotary(recompute=False)
    assert materialize(real_buffer, torch.device("cpu"))[1] == []


class BuiltOnMeta(L.LightningModule):
    """Builds ``make()`` on the meta device in ``configure_model``, as a model too large to build whole."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def configure_model(self) -> None:
        with torch.device("meta"):
            self.net = self.make()

    def training_step(self, batch, batch_idx):
        return self.net.proj(batch).sum() if hasattr(self.net, "proj") else self.net.inner(batch).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 3 if isinstance(self.net, Raw) else 4), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("shard", [None, "fsdp"])
def test_a_fit_refuses_a_model_built_on_meta_that_its_initialisers_leave_unwritten_or_cannot_initialise(
    shard, one_rank_mesh
):
    from lightning_commstrats import DiLoCoStrategy

    kwargs = {"shard": shard, "group_size": 1} if shard else {}
    unwritten = r"still hold no value: net\.cos\. An init_weights\(\) covers everything inside its module"
    with pytest.raises(ValueError, match=unwritten):
        one_rank_trainer(DiLoCoStrategy(sync_period=2, **kwargs), 2).fit(BuiltOnMeta(lambda: Rotary(recompute=False)))
    with pytest.raises(ValueError, match=r"net \(Raw: scale\)"):
        one_rank_trainer(DiLoCoStrategy(sync_period=2, **kwargs), 2).fit(BuiltOnMeta(Raw))
    model = BuiltOnMeta(lambda: Rotary(recompute=True))
    one_rank_trainer(DiLoCoStrategy(sync_period=2, **kwargs), 2).fit(model)
    assert torch.equal(model.net.cos, torch.cos(torch.arange(6.0)))
