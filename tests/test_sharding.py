"""The sharding component alone: construction-time errors, the shard policy's units (tied weights
stay with the root), memory accounting from storages, the outer state's placement."""

import pytest
import torch
from torch import nn

import lightning_commstrats as lc
from lightning_commstrats.comm.base import LocalCommunicator
from lightning_commstrats.outer import OuterOptimizer, resolve_outer_optimizer
from lightning_commstrats.sharding import Sharding, ShardPolicy, apply_fsdp, memory_by_kind


@pytest.mark.parametrize(
    "make",
    [lc.SampledVocabStrategy, lc.ParameterServerStrategy, lc.LocalSGDStrategy],
    ids=["sampled_vocab", "parameter_server", "local_sgd"],
)
def test_schemes_that_cannot_shard_refuse_it_by_name(make):
    with pytest.raises(ValueError, match=r"cannot honour shard='fsdp'.*allreduce, onebit_sgd"):
        make(shard="fsdp")


def test_expert_parallel_shards_over_its_inner_dimension_and_refuses_another_group_size():
    from lightning.fabric.plugins.environments import LightningEnvironment

    def layout(**kwargs):
        strategy = lc.ExpertParallelStrategy(shard="fsdp", ep_size=2, **kwargs)
        strategy.parallel_devices = [torch.device("cpu")] * 8
        strategy.cluster_environment = LightningEnvironment()
        strategy.set_world_ranks()
        return strategy

    assert layout(inner="dp").group_size == 4  # dp x ep = 4 x 2: the 4 replicas of the same experts
    assert layout(inner="ep").group_size == 2  # an expert-parallel group
    assert layout(inner="ep", group_size=2).sharding.group_size == 2
    with pytest.raises(ValueError, match=r"inner='dp': 4 ranks\); group_size=2 disagrees"):
        layout(inner="dp", group_size=2)


def test_bad_shard_settings_fail_at_construction():
    with pytest.raises(ValueError, match=r"shard='zero' is not supported; choose one of \(None, 'fsdp'\)"):
        lc.DiLoCoStrategy(sync_period=4, shard="zero")
    with pytest.raises(ValueError, match="backend='mpi' cannot carry it"):
        lc.AllReduceStrategy(shard="fsdp", backend="mpi")
    # fault tolerance composes with sharding (each job one sharded replica)
    lc.DiLoCoStrategy(
        sync_period=4,
        sync_period_unit="steps",
        shard="fsdp",
        fault_tolerance={"min_replicas": 1, "lighthouse": "http://127.0.0.1:1", "replica_id": "r0"},
    )
    with pytest.raises(ValueError, match="weighting='samples' is not supported with shard='fsdp'"):
        lc.ModelAveragingStrategy(shard="fsdp", weighting="samples")
    with pytest.raises(ValueError, match=r"outer_state='gpu' is not supported; choose one of \('host', 'device'\)"):
        lc.DiLoCoStrategy(sync_period=4, outer_state="gpu")
    with pytest.raises(ValueError, match="shard_policy got unknown setting"):
        lc.DiLoCoStrategy(sync_period=4, shard="fsdp", shard_policy={"unit": ["Block"]})
    with pytest.raises(ValueError, match="shard_policy is given without shard"):
        lc.AllReduceStrategy(shard_policy={"min_unit_numel": 1})
    with pytest.raises(ValueError, match="min_unit_numel must be an int >= 1"):
        ShardPolicy(min_unit_numel=0)
    with pytest.raises(ValueError, match="module classes, class names or name patterns"):
        ShardPolicy(units=[3])
    # accepted: the default group (a node), a policy as a dict
    s = lc.DiLoCoStrategy(sync_period=4, shard="fsdp", shard_policy={"units": ["Linear"]})
    assert s.sharding is not None and s.sharding.group_size == "node"


def test_group_size_must_divide_the_world():
    class Four(LocalCommunicator):
        def __init__(self):
            super().__init__()
            self.world_size = 4

    with pytest.raises(ValueError, match="group_size=3 must divide the number of ranks, 4"):
        Sharding(3).connect(Four(), 4, torch.device("cpu"))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 256)
        self.blocks = nn.ModuleList([nn.Linear(256, 256) for _ in range(2)])
        self.small = nn.ModuleList([nn.Linear(4, 4)])
        self.head = nn.Linear(256, 300, bias=False)
        self.head.weight = self.emb.weight


def test_policy_by_size_keeps_tied_weights_with_the_root():
    names = [n for n, _ in ShardPolicy().select(Tied())]
    assert names == ["blocks.1", "blocks.0"]  # innermost/last first; emb is tied to head; small is small
    assert [n for n, _ in ShardPolicy(units=["blocks.*"]).select(Tied())] == ["blocks.1", "blocks.0"]
    assert [n for n, _ in ShardPolicy(units=[nn.Linear]).select(Tied())] == ["small.0", "blocks.1", "blocks.0"]


def test_a_model_with_nothing_to_shard_is_refused():
    with pytest.raises(ValueError, match="needs a model with parameters"):
        apply_fsdp(nn.ReLU(), None, ShardPolicy())


def test_memory_counts_each_storage_once_by_kind():
    model = Tied()
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    view = model.blocks[0].weight.detach()[:3]  # a view of a parameter: its storage is counted already
    extra = torch.zeros(10)
    report = memory_by_kind(model, [opt], [view, extra, extra])
    params = sum(p.numel() * 4 for p in model.parameters())  # the tied matrix once
    assert report["parameters"] == {"cpu": params}
    assert report["gradients"] == {"cpu": params}
    # exp_avg and exp_avg_sq per parameter, and a 0-d float32 step each (4 bytes)
    assert report["optimizer"] == {"cpu": 2 * params + 4 * len(list(model.parameters()))}
    assert report["scheme"] == {"cpu": 40}


def test_outer_state_on_the_host_of_a_cpu_run_is_the_same_memory():
    factory = resolve_outer_optimizer("torch.optim.SGD", 0.7, 0.9, None)
    for placement in ("host", "device"):
        outer = OuterOptimizer(factory, torch.device("cpu"), placement)
        outer.start([torch.arange(4.0)])
        assert outer.weights[0].device.type == "cpu" and not outer.weights[0].is_pinned()
        outer.step(0, torch.ones(4))
        assert outer.start_point(0).device.type == "cpu"


def test_residuals_kept_at_their_home_and_brought_to_the_tensors_device():
    from lightning_commstrats.buckets import park, visit
    from lightning_commstrats.compression.exchange import TensorExchange

    t = torch.arange(6.0)
    assert park(t, None) is t and park(t, torch.device("cpu")) is t  # a CPU run: the same memory
    assert visit(None, torch.device("cpu")) is None and visit(t, torch.device("cpu")) is t
    exchange = TensorExchange(LocalCommunicator(), 4, residual_home=torch.device("cpu"))
    assert exchange.quantized is not None and exchange.quantized.home == torch.device("cpu")
    assert TensorExchange(LocalCommunicator(), 4).quantized.home is None


@pytest.mark.cuda
def test_residuals_wait_in_pinned_host_memory_on_cuda():
    from lightning_commstrats.buckets import park, visit

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = torch.randn(1000, device="cuda")
    kept = park(t, torch.device("cpu"))
    assert kept.device.type == "cpu" and kept.is_pinned()
    back = visit(kept, t.device)
    assert back.is_cuda and torch.equal(back, t)


def test_a_sharded_checkpoint_refuses_a_remote_url_and_storage_options_before_writing(tmp_path):
    from lightning_commstrats.sharding import checkpoint as sharded_checkpoint

    untouched = object()  # no strategy attribute is read before the refusal
    with pytest.raises(ValueError, match="not to a remote URL: got 's3://bucket/ckpt'"):
        sharded_checkpoint.save_strategy(untouched, {}, "s3://bucket/ckpt")
    with pytest.raises(ValueError, match=r"do not take storage_options \(got \{'region': 'x'\}\)"):
        sharded_checkpoint.save_strategy(untouched, {}, str(tmp_path / "ckpt"), {"region": "x"})
    assert not list(tmp_path.iterdir())


def test_a_sharded_checkpoint_that_some_rank_cannot_see_raises_naming_it(tmp_path):
    from lightning_commstrats.sharding import checkpoint as sharded_checkpoint

    class TwoRanks:  # rank 1's node has no such directory: its all-gathered flag is 0
        def all_gather(self, t, tag):
            return torch.stack([t, torch.zeros_like(t)])

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / sharded_checkpoint.META).write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"not visible on ranks \[1\]: shard='fsdp' checkpoints need a directory"):
        sharded_checkpoint.check_visible(str(tmp_path / "ckpt"), TwoRanks())


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_gradients(one_rank_mesh):
    from lightning_commstrats.sharding.policy import ShardPolicy, apply_fsdp

    def run(checkpointing: bool) -> tuple[int, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        block = lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))  # noqa: E731
        model = nn.Sequential(block(), block(), block())
        apply_fsdp(model, one_rank_mesh, ShardPolicy(min_unit_numel=1, activation_checkpointing=checkpointing))
        kept: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
            loss = model(torch.randn(8, 16)).pow(2).sum()
        loss.backward()
        return sum(kept), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}

    kept_all, grads = run(False)
    kept_inputs, grads_ac = run(True)
    # each unit keeps its input (8 x 16) instead of its weights' inputs and the tanh's output
    assert kept_inputs < kept_all / 4, (kept_inputs, kept_all)
    assert all(torch.equal(grads[n], grads_ac[n]) for n in grads)


def test_the_shard_policy_refuses_a_bad_activation_checkpointing_setting():
    from lightning_commstrats.sharding.policy import ShardPolicy

    with pytest.raises(ValueError, match="activation_checkpointing must be True or False"):
        ShardPolicy(activation_checkpointing="yes")
    with pytest.raises(ValueError, match="activation_checkpointing"):
        ShardPolicy.of({"activation_checkpoint": True})


class ShardsItself(__import__("lightning").LightningModule):
    """A LightningModule whose configure_model applies fully_shard itself (its block, then itself)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if hasattr(self, "block"):
            return
        self.block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        mesh = self.device_mesh["shard"]
        fully_shard(self.block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.block(batch).float().pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("given", ["shard_policy", "layered", "nothing"])
def test_a_model_that_shards_itself_is_told_which_settings_it_left_out(given, one_rank_mesh, recwarn):
    from tests.one_rank import one_rank_trainer

    kwargs = {"shard": "fsdp", "group_size": 1}
    if given == "shard_policy":
        kwargs["shard_policy"] = {"activation_checkpointing": True}
    trainer = one_rank_trainer(lc.AllReduceStrategy(**kwargs), 1)
    if given == "layered":
        trainer = __import__("lightning").Trainer(
            accelerator="cpu",
            devices=1,
            strategy=lc.AllReduceStrategy(**kwargs),
            plugins=[lc.LayeredMixedPrecision(preset="O2", dtype="bf16")],  # the Linear in bf16
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    trainer.fit(ShardsItself())
    said = [str(w.message) for w in recwarn if "configure_model sharded the model itself" in str(w.message)]
    if given == "nothing":
        assert said == []
    elif given == "shard_policy":
        assert len(said) == 1 and "shard_policy {'activation_checkpointing': True}" in said[0]
    else:
        assert len(said) == 1 and "units in bf16 (gathered in float32 instead)" in said[0]


class ShardedByTheStrategy(__import__("lightning").LightningModule):
    """A model with no ``configure_model``: the strategy shards it."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))

    def training_step(self, batch, batch_idx):
        return self.block(batch).float().pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return self.block(batch).float().sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 8), batch_size=2)

    val_dataloader = train_dataloader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_model_the_strategy_sharded_is_not_taken_for_one_that_shards_itself_at_a_later_stage(one_rank_mesh, recwarn):
    # fit, then validate with the same Trainer (as the recipe does): the second stage finds DTensors the
    # strategy made at the first, in bf16 units that did apply: no warning, the same units
    trainer = __import__("lightning").Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lc.AllReduceStrategy(shard="fsdp", group_size=1),
        plugins=[lc.LayeredMixedPrecision(preset="O2", dtype="bf16")],
        max_steps=1,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ShardedByTheStrategy()
    trainer.fit(model)
    units = list(trainer.strategy.sharding.units)
    trainer.validate(model)
    said = [str(w.message) for w in recwarn if "configure_model sharded the model itself" in str(w.message)]
    assert said == [] and trainer.strategy.sharding.units == units and units != ["(configure_model)"]
