"""The noise-scale estimator against the truth computed from per-sample gradients, and its settings."""

from __future__ import annotations

import csv
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.strategies import DDPStrategy
from torch.func import functional_call, grad, vmap

from lightning_commstrats import (
    AllReduceStrategy,
    BMUFStrategy,
    DiLoCoStrategy,
    ExpertParallelStrategy,
    ModelAveragingStrategy,
    OneBitAdamStrategy,
    OneBitSGDStrategy,
    ParameterServerStrategy,
    SampledVocabStrategy,
    SparseLoCoStrategy,
    StreamingDiLoCoStrategy,
    ZeroOneAdamStrategy,
)
from lightning_commstrats.batching.noise_scale import (
    GradientNoiseScale,
    NoiseScaleEstimator,
    count_sketch,
    next_batch_size,
    unbiased_estimates,
)

N_DATA, PER_RANK, RANKS = 5, 2, 2


def small_problem() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()
    x = torch.randn(N_DATA, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (N_DATA,))
    return model, x, y


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def batch_gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the batch's mean loss by ordinary autograd, flattened."""
    model.zero_grad()
    loss_of(model, x, y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def test_the_estimates_expectation_is_the_true_gradient_and_trace_by_exact_enumeration():
    model, x, y = small_problem()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one_loss(p, xi, yi):
        return loss_of(lambda inp: functional_call(model, p, (inp,)), xi[None], yi[None])

    per_sample = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([per_sample[k].reshape(N_DATA, -1) for k in params], dim=1)  # [n, P]
    true_g = flat.mean(0)
    true_trace = (flat - true_g).square().sum(1).mean()  # tr(Sigma): the covariance of one sample's gradient
    assert true_trace > 0.1 * true_g.square().sum()  # not a degenerate case: noise and signal both matter

    # every way of drawing 2 ranks x 2 samples independently (with replacement), each as likely;
    # a rank's gradient depends on its own 2 samples only: each of those batches goes through autograd once
    own_batch = {
        b: batch_gradient(model, x[list(b)], y[list(b)]) for b in itertools.product(range(N_DATA), repeat=PER_RANK)
    }
    gradient_sq, trace = [], []
    for draw in itertools.product(range(N_DATA), repeat=RANKS * PER_RANK):
        own = [own_batch[draw[r * PER_RANK : (r + 1) * PER_RANK]] for r in range(RANKS)]
        small_sq = sum(float(g.square().sum()) for g in own) / RANKS
        big_sq = float((sum(own) / RANKS).square().sum())
        g2, tr = unbiased_estimates(small_sq, big_sq, PER_RANK, PER_RANK * RANKS)
        gradient_sq.append(g2)
        trace.append(tr)
    assert len(gradient_sq) == N_DATA ** (RANKS * PER_RANK)
    mean_g2, mean_trace = sum(gradient_sq) / len(gradient_sq), sum(trace) / len(trace)
    print(
        f"|G|^2 {float(true_g.square().sum()):.6f} expected {mean_g2:.6f};"
        f" tr {float(true_trace):.6f} expected {mean_trace:.6f}"
    )
    torch.testing.assert_close(mean_g2, float(true_g.square().sum()), rtol=1e-10, atol=0)
    torch.testing.assert_close(mean_trace, float(true_trace), rtol=1e-10, atol=0)
    # one draw alone is far off: the agreement is the expectation's, not luck
    assert max(abs(g - mean_g2) for g in gradient_sq) > 0.5 * mean_g2


def test_the_noise_scale_is_the_ratio_of_the_two_moving_averages():
    est = NoiseScaleEstimator(beta=0.5)
    assert math.isnan(est.noise_scale)
    steps = [(4.0, 3.0), (5.0, 3.5), (2.0, 1.9)]
    g2_avg = tr_avg = 0.0
    for small, big in steps:
        g2, tr = unbiased_estimates(small, big, 8, 32)
        g2_avg, tr_avg = 0.5 * g2_avg + 0.5 * g2, 0.5 * tr_avg + 0.5 * tr
        assert est.update(small, big, 8, 32) == pytest.approx(tr_avg / g2_avg, rel=1e-12)
    assert est.gradient_sq == pytest.approx(g2_avg / (1 - 0.5**3), rel=1e-12)
    assert est.trace == pytest.approx(tr_avg / (1 - 0.5**3), rel=1e-12)
    # checkpointed state carries on alike
    again = NoiseScaleEstimator(beta=0.5)
    again.load_state_dict(est.state_dict())
    assert again.update(3.0, 2.0, 8, 32) == est.update(3.0, 2.0, 8, 32)


def test_noise_that_dominates_gives_no_noise_scale_rather_than_a_negative_one():
    est = NoiseScaleEstimator(beta=0.0)
    assert math.isnan(est.update(1.0, 0.2, 1, 2))  # |G|^2 estimate 2*0.2 - 1 < 0


def test_the_count_sketch_is_linear_and_its_squared_norm_unbiased():
    torch.manual_seed(0)
    # heavy-tailed values in tensors of several shapes, as gradients are (a few embedding rows, many zeros)
    parts = [
        torch.randn(50, 20, dtype=torch.float64) ** 3,
        torch.zeros(300, dtype=torch.float64),
        torch.randn(7, dtype=torch.float64),
    ]
    parts[0][:45] = 0
    exact = sum(float(t.double().square().sum()) for t in parts)
    other = [torch.randn_like(t) for t in parts]

    def sketch(tensors, seed):
        return count_sketch(tensors, 64, torch.Generator().manual_seed(seed))

    both = sketch([a + b for a, b in zip(parts, other, strict=True)], 5)
    torch.testing.assert_close(both, sketch(parts, 5) + sketch(other, 5), rtol=1e-12, atol=1e-12)
    draws = torch.tensor([float(sketch(parts, seed).square().sum()) for seed in range(4000)])
    stderr = float(draws.std()) / math.sqrt(len(draws))
    print(
        f"exact {exact:.3f}, sketched {float(draws.mean()):.3f} +- {stderr:.3f},"
        f" one draw's relative sd {float(draws.std()) / exact:.3f}"
    )
    assert abs(float(draws.mean()) - exact) < 4 * stderr
    assert float(draws.std()) / exact <= math.sqrt(2 / 64) * 1.1


def reference_count_sketch(tensors: list[torch.Tensor], size: int, generator: torch.Generator) -> torch.Tensor:
    """The count sketch as first written: one int64 draw per value per call, ``2 * bucket + sign``."""
    out = torch.zeros(size, dtype=torch.float64)
    for t in tensors:
        flat = t.detach().reshape(-1)
        drawn = torch.randint(0, 2 * size, (flat.numel(),), generator=generator)
        signed = torch.where(drawn % 2 == 0, flat.double(), -flat.double())
        out.index_add_(0, drawn // 2, signed)
    return out


def test_the_count_sketch_hashes_as_it_always_did():
    # integer values: every sum is exact in float64, so equal sketches mean the same bucket and sign
    # for every value; the tensors span several of the sketch's chunks, and one is empty
    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randint(-50, 50, (3, 400_001), generator=g).float(),
        torch.zeros(0),
        torch.randint(-50, 50, (7,), generator=g).double(),
        torch.randint(-50, 50, (1_100_000,), generator=g).half(),
    ]
    for size, seed in ((256, 0), (1024, 12345)):
        new = count_sketch(tensors, size, torch.Generator().manual_seed(seed))
        old = reference_count_sketch(tensors, size, torch.Generator().manual_seed(seed))
        assert torch.equal(new, old), (size, seed)
    # real values: the same sums, added in another order (the rounding of float64 only)
    real = [torch.randn(1000, 1200, generator=g), torch.randn(5, generator=g)]
    new = count_sketch(real, 256, torch.Generator().manual_seed(3))
    old = reference_count_sketch(real, 256, torch.Generator().manual_seed(3))
    torch.testing.assert_close(new, old, rtol=1e-12, atol=1e-12)


def test_the_count_sketch_allocates_a_bounded_workspace_not_an_index_per_value():
    # before: an int64 index per value (64 MiB for these 8M values), a float64 copy and a signed one
    from torch.profiler import ProfilerActivity, profile

    big = torch.randn(1 << 23)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        count_sketch([big, torch.randn(100)], 256, torch.Generator().manual_seed(0))
    allocated = max(e.cpu_memory_usage for e in prof.events())
    print(f"largest allocation of one sketch op: {allocated / 2**20:.1f} MiB for {big.numel() / 2**20:.0f}M values")
    assert allocated <= 16 * 2**20


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"beta": 1.0}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"measure": "norms"}, "measure"),
        ({"sketch_size": 0}, "sketch_size"),
        ({"seed": 1.5}, "seed"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": 8, "min_batch_size": 16}, "max_batch_size=8 is below min_batch_size=16"),
        ({"min_batch_size": 8}, "min_batch_size is given without max_batch_size"),
        ({"max_batch_size": 64, "growth_factor": 1.0}, "growth_factor"),
        ({"max_batch_size": 64, "check_every_n_steps": 0}, "check_every_n_steps"),
        ({"max_batch_size": 64, "scale": 0}, "scale"),
        ({"max_batch_size": 64, "lr_scaling": "cubic"}, "lr_scaling"),
    ],
)
def test_bad_settings_are_refused_at_construction_by_name(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        GradientNoiseScale(**kwargs)


@pytest.mark.parametrize(
    ("strategy", "mode"),
    [
        (AllReduceStrategy(), "exact"),
        (AllReduceStrategy(group_size=1), "exact"),
        (OneBitSGDStrategy(num_quantization_bits=32), "exact"),
        (OneBitSGDStrategy(), "sketch"),
        (OneBitAdamStrategy(), "sketch"),
        (ZeroOneAdamStrategy(), "sketch"),
        (SampledVocabStrategy(), "sketch"),
    ],
    ids=["allreduce", "two_level", "onebit_32", "onebit", "onebit_adam", "zero_one_adam", "sampled_vocab"],
)
def test_each_gradient_scheme_is_measured_exactly_or_by_sketch(strategy, mode):
    assert GradientNoiseScale()._mode_for(strategy, 2) == mode
    assert GradientNoiseScale(measure="sketch")._mode_for(strategy, 2) == "sketch"
    if mode == "sketch":
        with pytest.raises(ValueError, match=r"measure='exact'.*compressed"):
            GradientNoiseScale(measure="exact")._mode_for(strategy, 2)


@pytest.mark.parametrize(
    ("strategy", "why"),
    [
        (ModelAveragingStrategy(), "never averages gradients per step"),
        (BMUFStrategy(), "never averages gradients per step"),
        (DiLoCoStrategy(), "never averages gradients per step"),
        (StreamingDiLoCoStrategy(), "never averages gradients per step"),
        (SparseLoCoStrategy(), "never averages gradients per step"),
        (ParameterServerStrategy(), "never averages gradients per step"),
        (ExpertParallelStrategy(), "experts' gradients live on different ranks"),
        (DDPStrategy(), "average inside backward"),
    ],
    ids=["model_averaging", "bmuf", "diloco", "streaming", "sparseloco", "parameter_server", "expert", "ddp"],
)
def test_schemes_that_never_hold_both_gradients_are_refused_with_the_reason(strategy, why):
    with pytest.raises(ValueError, match=why):
        GradientNoiseScale()._mode_for(strategy, 2)


def test_a_single_rank_is_refused():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        GradientNoiseScale()._mode_for(AllReduceStrategy(), 1)


def test_the_batch_grows_while_the_grown_global_batch_stays_within_the_noise_scale():
    # 2 ranks of 8: grown to 16 a rank, 32 in all, which a noise scale of 32 allows and 31 does not
    assert next_batch_size(8, 2, 32.0, 2.0, 128) == 16
    assert next_batch_size(8, 2, 31.9, 2.0, 128) == 8
    assert next_batch_size(8, 2, 31.9, 2.0, 128, scale=2.0) == 16
    assert next_batch_size(8, 2, 1e9, 2.0, 12) == 12  # capped
    assert next_batch_size(12, 2, 1e9, 2.0, 12) == 12
    assert next_batch_size(8, 2, math.nan, 2.0, 128) == 8  # nothing measured yet
    assert next_batch_size(1, 1, 1e9, 1.2, 128) == 2  # at least one sample more
    assert next_batch_size(10, 2, 30.0, 1.5, 128) == 15


def test_the_callback_state_round_trips_through_a_checkpoint():
    saved = GradientNoiseScale(beta=0.5, max_batch_size=64)
    saved.estimator.update(4.0, 3.0, 8, 16)
    saved.history = [(20, 16), (40, 32)]
    state = saved.state_dict()
    assert state["batch_size"] == 32
    resumed = GradientNoiseScale(beta=0.5, max_batch_size=64)
    resumed.load_state_dict(state)
    assert resumed.estimator.state_dict() == saved.estimator.state_dict()
    assert resumed.history == saved.history
    assert resumed._resumed_size == 32  # the per-rank batch on_train_start sets again


class _Comm:
    def all_reduce(self, tensor, op, tag):  # every rank sent the same: the average is this rank's
        return tensor


class _Strategy:
    world_size = 2
    comm = _Comm()
    _nonfinite_names: list[str] = []


class _Module:
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def log(self, name, value, **kwargs) -> None:
        self.logged[-1][name] = value


def test_nothing_is_logged_while_the_noise_scale_is_not_defined():
    # a NaN in train/noise_scale reads as divergence: a step that cannot tell the noise scale does
    # not log it (the moving averages, once a step was measured, are numbers and are logged)
    noise = GradientNoiseScale(beta=0.5, measure="sketch")
    noise.mode = "sketch"
    trainer = type("Trainer", (), {"strategy": _Strategy()})()
    module = _Module()
    # per step: the ranks' mean [b, b^2] (b^2 off: uneven batches, not measured), each rank's |g|^2,
    # and a one-bucket sketch of their average whose square is |G_big|^2
    steps = ((4.0, 17.0, 1.0, 0.9), (4.0, 16.0, 1.0, 0.2), (4.0, 16.0, 1.0, 0.9))
    for b, b_sq, small_sq, big_sq in steps:
        noise._local = torch.tensor([b, b_sq, small_sq, math.sqrt(big_sq)], dtype=torch.float64)
        module.logged.append({})
        noise.on_before_optimizer_step(trainer, module, None)
    assert noise.estimator.steps == 2
    assert module.logged[0] == {}  # nothing measured yet
    assert set(module.logged[1]) == {"train/gradient_sq", "train/gradient_trace"}  # |G|^2 estimate < 0
    assert module.logged[1]["train/gradient_sq"] < 0
    assert set(module.logged[2]) == {"train/noise_scale", "train/gradient_sq", "train/gradient_trace"}
    assert module.logged[2]["train/noise_scale"] == pytest.approx(noise.estimator.noise_scale)
    assert math.isfinite(module.logged[2]["train/noise_scale"])


def test_the_noise_scale_recipe_logs_its_metrics_to_a_csv(capsys):
    from lightning_commstrats.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "lstm_noise_scale", "--print_config"])
    assert exit_info.value.code == 0
    logger = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
    assert logger["class_path"] == "lightning.pytorch.loggers.CSVLogger", logger


@pytest.mark.slow
def test_the_noise_scale_recipe_writes_the_noise_scale_and_the_batch_size(tmp_path):
    # the recipe's 2 ranks from the console command, shrunk: the CSV holds both every logged step
    command = [str(Path(sys.executable).with_name("commstrats-lm")), "fit", "--config", "lstm_noise_scale"]
    small = ["--model.embed_dim=16", "--model.hidden_dim=16", "--data.max_vocab_size=500"]
    steps = ["--trainer.max_steps=6", "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0"]
    subprocess.run([*command, *small, *steps, "--trainer.enable_progress_bar=false"], cwd=tmp_path, check=True)
    (metrics,) = tmp_path.glob("lightning_logs/lstm_noise_scale/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert all(float(r["train/batch_size"]) == 8 for r in rows)
    assert sum(bool(r["train/noise_scale"]) for r in rows) >= 3  # defined once |G|^2's average is positive
