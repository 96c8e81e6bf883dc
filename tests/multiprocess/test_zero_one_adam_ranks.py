"""``zero_one_adam`` on real ranks against a simulation of 0/1 Adam written from the paper's
equations (Lu et al., ICLR 2023, Algorithm 1) and the schedules' counters as DeepSpeed documents
them (``var_interval`` doubling after ``var_update_scaler`` updates; ``local_step_interval``
doubling every ``local_step_scaler`` steps up to ``local_step_clipper``), not from the package's code.
Two choices follow the package's documented defaults rather than the paper: the variance step
updates ``m`` and ``v`` from the fp32 average before its step (DeepSpeed's order), and torch's bias
correction (``s_t = lr / (1 - b1^t)``, ``v`` corrected for its number of updates).

Each rank records its own gradients before any exchange; the simulation replays them. A variance
step averages the gradients in fp32 and takes Adam's step; any other step accumulates each rank's
``lr``-scaled momentum ``u_i``; a synchronisation averages ``u`` through the two-stage 1-bit
compressor with worker and server error feedback (1-bit SGD's compressor: per column, the sign and
the mean of the entries of that sign; small and 1-D tensors exact), sets ``m = u / S`` and the
weights to ``x' - u / d`` from the last synchronisation's ``x'``; a local step moves each rank alone.

The package's default departs from the paper for values whose variance has not settled (see
``FrozenVarianceAdam``): ``d`` is at least ``variance_floor`` (0.1) times its tensor's RMS of the
bias-corrected ``sqrt(v)``, and each rank compresses ``u_i / d`` (the average then sets ``m = (u / d)
d / S`` and the weights ``x' - u / d``); ``paper=True`` runs the paper's update against the paper's
simulation.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import run_ranks
from onebit_reference import compress

pytestmark = pytest.mark.multiprocess

LR, WD, SMALL = 0.01, 0.01, 64
B1, B2, EPS, FLOOR = 0.9, 0.999, 1e-8, 0.1
FREEZE, KAPPA, SCALER, CLIPPER = 6, 2, 2, 4
STEPS = 15  # ends inside an interval of local steps: fit's last synchronisation is checked too
SHAPES = {"layer.0.weight": (16, 32), "layer.0.bias": (16,), "layer.2.weight": (2, 16), "layer.2.bias": (2,)}


def schedules(steps: int) -> tuple[set[int], set[int]]:
    """``(T_v, T_u)`` by the counters' rules, step by step."""
    t_v, t_u = set(), set()
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    for t in range(1, steps + 1):
        if t <= FREEZE:
            t_u.add(t)
            if t % var_interval == 0:
                t_v.add(t)
                var_counter += 1
                if var_counter == KAPPA:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            if t % local_interval == 0:
                t_u.add(t)
            local_counter += 1
            if local_counter == SCALER:
                local_counter, local_interval = 0, min(CLIPPER, local_interval * 2)
    return t_v, t_u


def quantized(name: str) -> bool:
    return len(SHAPES[name]) > 1 and math.prod(SHAPES[name]) > SMALL


def simulate(
    start: dict[str, torch.Tensor], grads: list[list[dict[str, torch.Tensor]]], decoupled: bool, paper: bool = True
):
    """Every rank's weights after every step, and after fit's last synchronisation (``paper=False``:
    the package's default, ``u_i / d`` compressed and ``d`` floored)."""
    n = len(grads)
    t_v, t_u = schedules(STEPS)
    xs = [{k: v.double().clone() for k, v in start.items()} for _ in range(n)]  # each rank's weights
    ms = [{k: torch.zeros_like(v) for k, v in xs[0].items()} for _ in range(n)]
    v = {k: torch.zeros_like(t) for k, t in xs[0].items()}
    us = [{k: torch.zeros_like(t) for k, t in xs[0].items()} for _ in range(n)]
    anchor = {k: t.clone() for k, t in xs[0].items()}  # x': the weights at the last synchronisation
    worker = [{k: torch.zeros_like(t) for k, t in xs[0].items()} for _ in range(n)]
    server = {k: torch.zeros_like(t) for k, t in xs[0].items()}
    lr_sum, decay, updates = 0.0, 1.0, 0
    trace = []

    def denominator(k, floored=True):
        root = (v[k] / (1 - B2**updates)).sqrt()
        return root + EPS if paper or not floored else torch.maximum(root, FLOOR * root.square().mean().sqrt()) + EPS

    def synchronize():
        nonlocal lr_sum, decay
        for k in anchor:
            if quantized(k):
                sent = []
                for r in range(n):
                    w = us[r][k] + worker[r][k]
                    sent.append(compress(w))
                    worker[r][k] = w - sent[r]
                s = sum(sent) / n + server[k]
                u = compress(s)
                server[k] = s - u
            else:
                u = sum(us[r][k] for r in range(n)) / n
            x = anchor[k] * decay - (u / denominator(k) if paper else u)
            moment = u / lr_sum if paper else u * denominator(k) / lr_sum
            for r in range(n):
                ms[r][k], xs[r][k], us[r][k] = moment.clone(), x.clone(), torch.zeros_like(u)
            anchor[k] = x.clone()
        lr_sum, decay = 0.0, 1.0

    for t in range(1, STEPS + 1):
        own = [
            {k: g.double() + (0 if decoupled else WD * xs[r][k]) for k, g in grads[r][t - 1].items()} for r in range(n)
        ]
        step = LR / (1 - B1**t)
        factor = 1 - LR * WD if decoupled else 1.0
        if t in t_v:  # Adam on the averaged gradient; every rank holds the same x and m here
            updates += 1
            for k in anchor:
                g = sum(o[k] for o in own) / n
                m = B1 * ms[0][k] + (1 - B1) * g
                v[k] = B2 * v[k] + (1 - B2) * g * g
                x = xs[0][k] * factor - step * m / denominator(k, floored=False)  # Adam's own step
                for r in range(n):
                    ms[r][k], xs[r][k] = m.clone(), x.clone()
                anchor[k] = x.clone()
        else:
            lr_sum, decay = lr_sum + step, decay * factor
            for r in range(n):
                for k in anchor:
                    m = B1 * ms[r][k] + (1 - B1) * own[r][k]
                    us[r][k] = us[r][k] + step * (m if paper else m / denominator(k))
                    ms[r][k] = m
                    xs[r][k] = xs[r][k] * factor - step * m / denominator(k)
            if t in t_u:
                synchronize()
        trace.append([torch.cat([x[k].reshape(-1) for k in SHAPES]) for x in xs])
    if STEPS not in t_u:
        synchronize()
    final = torch.cat([xs[0][k].reshape(-1) for k in SHAPES])
    return trace, final


def unflat(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for k, shape in SHAPES.items():
        out[k] = flat[i : i + math.prod(shape)].reshape(shape)
        i += math.prod(shape)
    return out


def scenario(optimizer: str, world: int = 2, paper: bool = False, **extra) -> dict:
    kwargs = {
        "var_freeze_step": FREEZE,
        "var_update_scaler": KAPPA,
        "local_step_scaler": SCALER,
        "local_step_clipper": CLIPPER,
        "small_tensor_numel": SMALL,
    }
    if paper:
        kwargs.update(variance_floor=0.0, compress_after_preconditioner=False)
    model = {"optimizer": optimizer, "lr": LR, "weight_decay": WD}
    base = {"strategy": "zero_one_adam", "kwargs": kwargs, "model_kwargs": model, "max_steps": STEPS, "devices": world}
    return {**base, "trace": True, "record_gradients": True, **extra}


def test_the_schedules_are_the_documented_ones():
    t_v, t_u = schedules(STEPS)
    assert sorted(t_v) == [1, 2, 4, 6]  # kappa = 2 updates at interval 1, then at interval 2
    assert sorted(t_u) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]  # intervals 1, 1, 2, 4 (clipped at 4)


@pytest.mark.parametrize(
    ("world", "optimizer", "paper"),
    [(2, "adamw", False), (2, "adamw", True), pytest.param(3, "adam", False, marks=pytest.mark.slow)],
)
def test_the_update_is_the_papers_step_by_step_through_variance_1_bit_and_local_steps(world, optimizer, paper):
    ranks = [r["zo"] for r in run_ranks({"scenarios": {"zo": scenario(optimizer, world, paper)}}, world)]
    _, t_u = schedules(STEPS)
    for t in sorted(t_u):  # after every synchronisation every rank holds the same weights, to the bit
        for r in ranks[1:]:
            assert torch.equal(ranks[0]["trace"][t - 1], r["trace"][t - 1]), t
    assert not torch.equal(ranks[0]["trace"][8], ranks[1]["trace"][8])  # step 9 is local: the ranks part
    for r in ranks[1:]:  # fit's last synchronisation (step 15 was local)
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"].values(), r["params"].values(), strict=True))
    grads = [r["gradients"] for r in ranks]
    trace, final = simulate(unflat(ranks[0]["start_params"]), grads, optimizer == "adamw", paper)
    for t in range(1, STEPS + 1):
        prev = ranks[0]["trace"][t - 2] if t > 1 else ranks[0]["start_params"]
        moved = float((ranks[0]["trace"][t - 1].double() - prev.double()).abs().max())
        for rank, r in enumerate(ranks):
            err = float((r["trace"][t - 1].double() - trace[t - 1][rank]).abs().max())
            print(f"step {t} rank {rank}: largest update {moved:.3e}, largest difference {err:.3e}")
            assert err < 1e-6 * max(1.0, moved * 1e3), (t, rank)
    got = torch.cat([ranks[0]["params"][k].reshape(-1) for k in SHAPES]).double()
    assert (got - final).abs().max() < 1e-6


def test_the_bytes_of_each_kind_of_step_counted_by_hand():
    world = 2
    ranks = [r["zo"] for r in run_ranks({"scenarios": {"zo": scenario("adamw")}}, world)]
    t_v, t_u = schedules(STEPS)
    fp32 = 2 * (world - 1) * math.ceil(562 / world) * 4  # the whole gradient: 16x32 + 50 floats, ring
    # u in 1 bit: layer.0.weight's 16 x 32 in 2 stripes of 16 columns, a stripe 2 float32 scales per
    # column and 1 bit per value = 16 x 8 + 16 x 16 / 8 = 160 bytes, sent in stage 1 and stage 2;
    # the 50 small values in fp32: a ring all-reduce of 2 chunks of 25 floats, 200 bytes
    for r in ranks:
        steps = r["step_bytes"]
        assert len(steps) == STEPS
        for t, step in enumerate(steps, start=1):
            quant, dense = step.get("grad_quantized/bytes_sent", 0), step.get("grad/bytes_sent", 0)
            if t in t_v:
                assert (quant, dense) == (0, fp32), t
            elif t in t_u:
                assert (quant, dense) == (320, 200), t
            else:
                assert (quant, dense) == (0, 0), t
        # fit's last synchronisation (step 15 was local): once more the 1-bit u, after the last step
        total = r["total_bytes"]
        assert total["grad_quantized/bytes_sent"] == 320 * (len(t_u - t_v) + 1)
        assert total["grad/bytes_sent"] == fp32 * len(t_v) + 200 * (len(t_u - t_v) + 1)


def test_a_checkpoint_inside_an_interval_of_local_steps_resumes_bit_for_bit():
    # 256 samples / (2 ranks x 32) = 4 steps an epoch, a checkpoint every epoch: at step 4 (a
    # variance step), 8 (a 1-bit sync) and 12; with 3 steps an epoch (batch 43 -> 3 batches) at
    # step 9, inside an interval of local steps (each rank's own weights, momentum and u_i)
    full = scenario("adamw", ckpt_every=3, batch_size=43)
    resumed = scenario("adamw", resume=["full", 9], batch_size=43)
    results = run_ranks({"scenarios": {"full": full, "resumed": resumed}}, 2)
    assert not torch.equal(results[0]["full"]["trace"][8], results[1]["full"]["trace"][8])
    for r in results:
        after = r["full"]["trace"][9:]
        assert len(after) == len(r["resumed"]["trace"]) == STEPS - 9
        for a, b in zip(after, r["resumed"]["trace"], strict=True):
            assert torch.equal(a, b)
        assert all(
            torch.equal(a, b)
            for a, b in zip(r["full"]["params"].values(), r["resumed"]["params"].values(), strict=True)
        )


def test_a_non_finite_gradient_in_a_local_step_drops_the_interval_at_its_synchronisation():
    # an inf in rank 0's gradient at step 9 (a local step: rank 0's weights go non-finite alone);
    # step 10's synchronisation averages a non-finite u and is skipped: every rank returns to the
    # weights of step 8 (the interval's x'), and training goes on from there, finite and in step
    extra = {"inject_inf": [8, 0], "kwargs": {**scenario("adamw")["kwargs"], "nonfinite": "skip"}}
    ranks = [r["zo"] for r in run_ranks({"scenarios": {"zo": scenario("adamw", **extra)}}, 2)]
    assert not torch.isfinite(ranks[0]["trace"][8]).all() and torch.isfinite(ranks[1]["trace"][8]).all()
    for r in ranks:
        assert torch.equal(r["trace"][9], ranks[0]["trace"][7])  # back at x', the same on both ranks
        assert all(torch.isfinite(t).all() for t in r["trace"][9:])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"].values(), ranks[1]["params"].values(), strict=True))
    assert all(torch.isfinite(t).all() for t in ranks[0]["params"].values())
