"""Outer optimizers: the BMUF filter against numbers worked out by hand, its two forms (the paper's and
CNTK's) against references written from their equations, Nesterov SGD (DiLoCo) by hand, model
averaging as outer SGD, fragments, state and argument checks."""

import copy
import math

import pytest
import torch

from lightning_commstrats.outer import (
    BlockMomentum,
    CNTKBlockMomentum,
    OuterOptimizer,
    block_momentum_from_time_constant,
    resolve_outer_optimizer,
    time_constant_from_block_momentum,
)


def _bmuf(momentum, lr, nesterov):
    return OuterOptimizer(lambda params: BlockMomentum(params, lr=lr, momentum=momentum, nesterov=nesterov))


def _sync(outer, w_avg, fragment=0):
    """One block end: G = w_start - w_avg, an outer step; returns the next start point."""
    outer.step(fragment, outer.start_point(fragment) - w_avg)
    return outer.start_point(fragment)


def test_bmuf_two_blocks_with_momentum_and_nesterov_by_hand():
    outer = _bmuf(0.5, 1.0, True)
    outer.start([torch.tensor([1.0, 2.0])])
    # block 1 started at w_start = [1, 2]; the workers' average is [0.6, 2.4]
    #   delta = [-0.4, 0.4]; w_global = [0.6, 2.4]; next start = w_global + 0.5 delta = [0.4, 2.6]
    start = _sync(outer, torch.tensor([0.6, 2.4]))
    torch.testing.assert_close(outer.optimizer.state[outer.weights[0]]["delta"], torch.tensor([-0.4, 0.4]))
    torch.testing.assert_close(outer.global_weights(0), torch.tensor([0.6, 2.4]))
    torch.testing.assert_close(start, torch.tensor([0.4, 2.6]))
    # block 2 started at [0.4, 2.6]; average [0.3, 2.5]
    #   delta = 0.5 [-0.4, 0.4] + [-0.1, -0.1] = [-0.3, 0.1]; w_global = [0.3, 2.5]; start = [0.15, 2.55]
    start = _sync(outer, torch.tensor([0.3, 2.5]))
    torch.testing.assert_close(outer.optimizer.state[outer.weights[0]]["delta"], torch.tensor([-0.3, 0.1]))
    torch.testing.assert_close(outer.global_weights(0), torch.tensor([0.3, 2.5]))
    torch.testing.assert_close(start, torch.tensor([0.15, 2.55]))
    assert outer.syncs == [2]


def test_bmuf_classical_momentum_and_block_learning_rate_by_hand():
    outer = _bmuf(0.5, 0.5, False)
    outer.start([torch.tensor([1.0])])
    # avg 0: delta = 0.5 * -1 = -0.5; w_global = 0.5 = start
    torch.testing.assert_close(_sync(outer, torch.tensor([0.0])), torch.tensor([0.5]))
    # avg 1.5: delta = 0.5 * -0.5 + 0.5 * 1 = 0.25; w_global = 0.75
    torch.testing.assert_close(_sync(outer, torch.tensor([1.5])), torch.tensor([0.75]))


def _cntk(momentum, lr, nesterov, workers):
    return OuterOptimizer(
        lambda params: CNTKBlockMomentum(params, lr=lr, momentum=momentum, nesterov=nesterov, workers=workers)
    )


def _cntk_reference(w0, local_models_per_block, bm, blr, nesterov):
    """CNTK's BlockMomentumSGD::ModelAggregationProcessing, written from its source: per block, each
    worker's blockGrad = prevWeight - currentWeight, summed over workers (AllReduce); smoothed
    gradient sg = bm sg + (1 - bm) blr blockGrad (ScaleAndAdd); currentWeight = prevWeight - sg,
    then (Nesterov) currentWeight -= bm sg; prevWeight = currentWeight. Returns prevWeight after
    every block (the one model CNTK keeps: where the next block starts, what it saves)."""
    prev, sg, out = w0.double(), torch.zeros_like(w0, dtype=torch.float64), []
    for models in local_models_per_block:
        block_grad = sum(prev - w.double() for w in models(prev))
        sg = bm * sg + (1 - bm) * blr * block_grad
        current = prev - sg
        if nesterov:
            current = current - bm * sg
        prev = current
        out.append(prev)
    return out


def _paper_reference(w0, local_models_per_block, eta, zeta, nesterov):
    """Chen & Huo (ICASSP 2016), eqs. of BMUF: the aggregated model W_bar(t) (the workers' average),
    the block update G(t) = W_bar(t) - W_g(t-1), Delta(t) = eta Delta(t-1) + zeta G(t),
    W(t) = W(t-1) + Delta(t); the next block starts from W_g(t) = W(t) + eta Delta(t) (Nesterov)
    or W(t). Returns (W(t), W_g(t)) after every block."""
    w, start, delta, out = w0.double(), w0.double(), torch.zeros_like(w0, dtype=torch.float64), []
    for models in local_models_per_block:
        local = models(start)
        g = sum(m.double() for m in local) / len(local) - start
        delta = eta * delta + zeta * g
        w = w + delta
        start = w + eta * delta if nesterov else w
        out.append((w, start))
    return out


def _run(outer, w0, blocks):
    """Drive an outer optimizer as the strategy does: G = w_start - mean(w_local), one step per block;
    returns (global model, next start point) after every block."""
    outer.start([w0.clone()])
    out = []
    for models in blocks:
        local = models(outer.start_point(0).double())
        outer.step(0, outer.start_point(0) - torch.stack([m.float() for m in local]).mean(0))
        out.append((outer.global_weights(0).clone(), outer.start_point(0).clone()))
    return out


def test_one_unit_per_block_at_four_workers_cntk_and_paper_differ_with_nesterov():
    # every worker moves one unit per block from where the block starts; N = 4, the defaults:
    # block momentum 1 - 1/N = 0.75, CNTK's block learning rate 1 (the paper form's 4 x 0.25 x 1 = 1)
    blocks = [lambda start: [start + 1.0] * 4] * 3
    w0 = torch.zeros(1)
    cntk = _run(_cntk(0.75, 1.0, True, workers=4), w0, blocks)
    paper = _run(_bmuf(0.75, 1.0, True), w0, blocks)
    assert [s.item() for _, s in cntk] == [1.75, 4.8125, 8.859375]
    assert [s.item() for _, s in paper] == [1.75, 4.0625, 6.796875]
    assert [w.item() for w, _ in cntk] == [1.75, 4.8125, 8.859375]  # CNTK keeps no other model
    assert [w.item() for w, _ in paper] == [1.0, 2.75, 5.0625]  # w_global, behind the look-ahead
    # the references written from each form's equations give the same numbers
    assert [p.item() for p in _cntk_reference(w0, blocks, 0.75, 1.0, True)] == [1.75, 4.8125, 8.859375]
    assert [(w.item(), s.item()) for w, s in _paper_reference(w0, blocks, 0.75, 1.0, True)] == [
        (1.0, 1.75),
        (2.75, 4.0625),
        (5.0625, 6.796875),
    ]
    # the conversion the docstring used to give, (1 - bm) blr, moves four times too little at N = 4
    (_, first), *_ = _run(_bmuf(0.75, 0.25, False), w0, blocks)
    assert first.item() == 0.25


@pytest.mark.parametrize("nesterov", [True, False])
def test_both_forms_against_their_references_on_random_workers(nesterov):
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 5, generator=gen) for _ in range(4)]  # 4 blocks, 3 workers, 5 weights
    blocks = [lambda start, d=d: [start + d[r] for r in range(3)] for d in steps]
    w0 = torch.randn(5, generator=gen)
    bm, blr = 0.6, 0.7
    cntk = _run(_cntk(bm, blr, nesterov, workers=3), w0, blocks)
    for (w, start), ref in zip(cntk, _cntk_reference(w0, blocks, bm, blr, nesterov), strict=True):
        torch.testing.assert_close(start.double(), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(w, start, atol=0, rtol=0)
    paper = _run(_bmuf(bm, blr, nesterov), w0, blocks)
    for (w, start), (ref_w, ref_start) in zip(paper, _paper_reference(w0, blocks, bm, blr, nesterov), strict=True):
        torch.testing.assert_close(w.double(), ref_w, atol=1e-5, rtol=0)
        torch.testing.assert_close(start.double(), ref_start, atol=1e-5, rtol=0)
    # without Nesterov, CNTK's blr is the paper form's zeta = N (1 - bm) blr; with it they part
    converted = _run(_bmuf(bm, 3 * (1 - bm) * blr, nesterov), w0, blocks)
    same = all(torch.allclose(a[1], b[1], atol=1e-5) for a, b in zip(converted, cntk, strict=True))
    assert same is not nesterov


def test_cntk_form_state_round_trips_and_bad_arguments():
    outer = _cntk(0.5, 1.0, True, workers=2)
    outer.start([torch.zeros(3)])
    _sync(outer, torch.ones(3))
    restored = _cntk(0.5, 1.0, True, workers=2)
    restored.load_state_dict(copy.deepcopy(outer.state_dict()), torch.device("cpu"))
    for o in (outer, restored):
        _sync(o, torch.full((3,), -2.0))
    torch.testing.assert_close(restored.global_weights(0), outer.global_weights(0))
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="workers must be an int >= 1, got 0"):
        CNTKBlockMomentum(p, workers=0)
    with pytest.raises(ValueError, match="block_momentum must be in"):
        CNTKBlockMomentum(p, momentum=1.0)
    with pytest.raises(ValueError, match="block_learning_rate must be > 0"):
        CNTKBlockMomentum(p, lr=0.0)


def test_nesterov_sgd_two_syncs_by_hand():
    # DiLoCo's outer step: torch SGD, lr 0.7, momentum 0.9, Nesterov; buf = 0.9 buf + G; w -= 0.7 (G + 0.9 buf)
    outer = OuterOptimizer(resolve_outer_optimizer(None, lr=0.7, momentum=0.9))
    outer.start([torch.tensor([1.0, -1.0])])
    # sync 1: avg [0.8, -0.5] -> G = [0.2, -0.5]; buf = G; w = [1, -1] - 0.7 * 1.9 G = [0.734, -0.335]
    torch.testing.assert_close(_sync(outer, torch.tensor([0.8, -0.5])), torch.tensor([0.734, -0.335]))
    # sync 2: avg [0.634, -0.235] -> G = [0.1, -0.1]; buf = 0.9 [0.2, -0.5] + G = [0.28, -0.55]
    #   w = [0.734, -0.335] - 0.7 ([0.1, -0.1] + 0.9 [0.28, -0.55]) = [0.4876, 0.0815]
    torch.testing.assert_close(_sync(outer, torch.tensor([0.634, -0.235])), torch.tensor([0.4876, 0.0815]))


def test_outer_sgd_unit_rate_no_momentum_and_bmuf_zero_momentum_are_model_averaging():
    for outer in (OuterOptimizer(resolve_outer_optimizer(None, 1.0, 0.0)), _bmuf(0.0, 1.0, False)):
        outer.start([torch.randn(100)])
        for _ in range(3):
            avg = torch.randn(100)
            torch.testing.assert_close(_sync(outer, avg), avg)


def test_fragments_step_alone_and_state_round_trips():
    outer = OuterOptimizer(resolve_outer_optimizer(None, 0.7, 0.9))
    outer.start([torch.zeros(3), torch.ones(2)])
    _sync(outer, torch.full((3,), -1.0), fragment=0)
    torch.testing.assert_close(outer.global_weights(1), torch.ones(2))  # the other fragment untouched
    assert outer.syncs == [1, 0]
    restored = OuterOptimizer(resolve_outer_optimizer(None, 0.7, 0.9))
    restored.check_state(outer.state_dict(), [3, 2])
    with pytest.raises(ValueError, match="fragments of"):
        restored.check_state(outer.state_dict(), [5])
    saved = copy.deepcopy(outer.state_dict())  # as a checkpoint holds it: tensors of its own
    restored.load_state_dict(saved, torch.device("cpu"))
    for o in (outer, restored):
        _sync(o, torch.full((3,), -2.0), fragment=0)
    torch.testing.assert_close(restored.global_weights(0), outer.global_weights(0))


def test_any_torch_optimizer_class_or_path_and_bad_ones():
    adam = resolve_outer_optimizer("torch.optim.Adam", lr=0.1, momentum=0.9)  # Adam takes no momentum
    assert isinstance(adam([torch.nn.Parameter(torch.zeros(1))]), torch.optim.Adam)
    sgd = resolve_outer_optimizer(torch.optim.SGD, lr=0.5, momentum=0.0)([torch.nn.Parameter(torch.zeros(1))])
    assert sgd.param_groups[0]["nesterov"] is False
    with pytest.raises(ValueError, match=r"outer_optimizer='torch\.optim\.NoSuch' cannot be imported"):
        resolve_outer_optimizer("torch.optim.NoSuch", 0.7, 0.9)
    with pytest.raises(ValueError, match=r"not a torch\.optim\.Optimizer subclass"):
        resolve_outer_optimizer(torch.nn.Linear, 0.7, 0.9)
    with pytest.raises(ValueError, match=r"returned list, not a torch\.optim\.Optimizer"):
        resolve_outer_optimizer(lambda params: list(params), 0.7, 0.9)
    with pytest.raises(ValueError, match="could not be built"):
        resolve_outer_optimizer("torch.optim.SGD", lr=-1.0, momentum=0.0)


def test_time_constant_round_trip():
    bm = block_momentum_from_time_constant(time_constant=1000.0, sync_period=100)
    assert bm == pytest.approx(math.exp(-0.1))
    assert time_constant_from_block_momentum(bm, 100) == pytest.approx(1000.0)
    assert time_constant_from_block_momentum(0.0, 100) == 0.0


def test_bad_block_momentum_arguments():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="block_momentum must be in"):
        BlockMomentum(p, momentum=1.0)
    with pytest.raises(ValueError, match="block_learning_rate must be > 0"):
        BlockMomentum(p, lr=0.0, momentum=0.5)
    with pytest.raises(ValueError, match="block_momentum_as_time_constant must be > 0"):
        block_momentum_from_time_constant(0.0, 10)
