"""The outer-optimizer schemes on real ranks: equivalences with model averaging and gradient all-reduce,
the BMUF filter step by step at strategy level, validation on the global model at a block boundary,
compressed pseudo-gradient bytes counted by hand, the fragment rotation and delay of
``streaming_diloco``, and resume mid-block and mid-fragment."""

import pytest
import torch
from harness import run_ranks

from lightning_commstrats.compression import ColumnCodec, E3M0Codec

pytestmark = pytest.mark.multiprocess

STEPS = {"sync_period_unit": "steps"}
FRAG0 = slice(0, 512)  # the Mlp's layer.0.weight: fragment 0 of two (sizes 512 | 16 + 32 + 2)
FRAG1 = slice(512, 562)


def _close(a, b, atol):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _flat(named):
    return torch.cat([t.reshape(-1) for t in named.values()])


def _global(state):
    return torch.cat(state["state"]["outer"]["weights"])


def _exchange_reference(syncs, codec, world=2):
    """The averages the quantized pseudo-gradient exchange must return, every rank simulated here:
    ``syncs[k][r]`` is rank ``r``'s pseudo-gradient at sync ``k``. Matrices go per row (each row one
    scale set), their rows in ``world`` stripes; rank ``j`` quantizes (its tensor + its residual)
    stripe by stripe and keeps what was lost; the owner of a stripe sums the ``world`` decoded copies
    in rank order, adds its own residual, re-quantizes and keeps what that lost; the average is the
    decoded sum over ``world``. 1-D tensors are plain means."""
    res1, res2, out = {}, {}, []
    for by_rank in syncs:
        avg = {}
        for name, first in by_rank[0].items():
            if first.dim() < 2:
                avg[name] = sum(named[name] for named in by_rank) / world
                continue
            rows, width = first.shape[0], first[0].numel()
            size = -(-rows // world)
            stripes = [(min(k * size, rows), min((k + 1) * size, rows)) for k in range(world)]
            sent = {}
            for j in range(world):
                v = by_rank[j][name].reshape(rows, width) + res1.get((j, name), 0)
                for k, (a, b) in enumerate(stripes):
                    payload, deq = codec.encode(v[a:b].contiguous())
                    sent[j, k] = payload
                    v[a:b] -= deq
                res1[j, name] = v
            total = torch.empty(rows, width)
            for k, (a, b) in enumerate(stripes):
                part = sum(codec.decode(sent[j, k], b - a, width) for j in range(world)) + res2.get((k, name), 0)
                payload, deq = codec.encode(part)
                res2[k, name] = part - deq
                total[a:b] = codec.decode(payload, b - a, width)
            avg[name] = (total / world).reshape(first.shape)
        out.append(avg)
    return out


def test_equivalences_bmuf_filter_validation_and_compressed_bytes_on_two_ranks():
    bmuf = {"sync_period": 4, **STEPS, "block_momentum": 0.5, "block_learning_rate": 0.8}
    scenarios = {
        "ar_sgd": {"strategy": "allreduce", "momentum": 0.0},
        "diloco_as_ar": {
            "strategy": "diloco",
            "momentum": 0.0,
            "kwargs": {"sync_period": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
        },
        "ma4": {"strategy": "model_averaging", "kwargs": {"sync_period": 4, **STEPS}},
        "diloco_as_ma4": {"strategy": "diloco", "kwargs": {"sync_period": 4, "outer_lr": 1.0, "outer_momentum": 0.0}},
        "bmuf": {
            "strategy": "bmuf",
            "kwargs": bmuf,
            "record_exchange": True,
            "state_trace": True,
            "trace": True,
            "val_every": 4,
        },
        "diloco4": {
            "strategy": "diloco",
            "kwargs": {"sync_period": 4, "pseudo_grad_bits": 4, "small_tensor_numel": 0},
            "record_exchange": True,
            "state_trace": True,
        },
        "diloco4_e3m0": {
            "strategy": "diloco",
            "kwargs": {"sync_period": 4, "pseudo_grad_bits": 4, "pseudo_grad_codec": "e3m0", "small_tensor_numel": 0},
            "record_exchange": True,
        },
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        # outer SGD with lr 1 and no momentum is model averaging; at period 1 with plain SGD, all-reduce
        _close(res["diloco_as_ar"]["params"], res["ar_sgd"]["params"], 1e-6)
        _close(res["diloco_as_ma4"]["params"], res["ma4"]["params"], 1e-6)
    for name in scenarios:
        for res in results[1:]:
            _close(res[name]["params"], results[0][name]["params"], 0.0)

    # BMUF at strategy level, sync by sync, against the filter written out here
    bm, lr = 0.5, 0.8
    states = [r["bmuf"]["states"] for r in results]
    exchanges = [r["bmuf"]["exchanges"] for r in results]
    assert [e["step"] for e in exchanges[0]] == [4, 8]
    w = _global(states[0][0])  # the global model before the first sync: the initial weights
    delta = torch.zeros_like(w)
    for k, step in enumerate((4, 8)):
        mine = torch.stack([_flat(e[k]["mine"]) for e in exchanges])
        g = _flat(exchanges[0][k]["avg"])
        torch.testing.assert_close(g, mine.mean(0), atol=1e-6, rtol=0)  # the exchange averages
        delta = bm * delta - lr * g
        w = w + delta
        start = w + bm * delta
        for rank in range(2):
            s = states[rank][step - 1]
            torch.testing.assert_close(_global(s), w, atol=1e-6, rtol=0)
            torch.testing.assert_close(s["rank"]["weights"], start, atol=1e-6, rtol=0)  # the look-ahead
    # validation at the block boundary sees w_global, not the look-ahead point training continues from
    for res in results:
        validated, trace = res["bmuf"]["validated"], res["bmuf"]["trace"]
        assert len(validated) == 2
        for v, step in zip(validated, (4, 8), strict=True):
            torch.testing.assert_close(v, _global(res["bmuf"]["states"][step - 1]), atol=0, rtol=0)
            assert not torch.allclose(v, trace[step - 1])

    # 4-bit pseudo-gradients: the bytes by hand. Two ranks, so each matrix is two stripes of rows
    # (scales per row, the default); a rank sends the other rank's stripe (all-to-all), then its own
    # re-quantized stripe (all-gather). A stripe's payload: its scales (uniform: lo and hi per row,
    # E3M0: one per row), float32, then 4 bits per value.
    syncs = 2  # 8 steps, period 4
    for scenario, scales_per_row in (("diloco4", 2), ("diloco4_e3m0", 1)):
        w0 = 8 * 4 * scales_per_row + 8 * 32 * 4 // 8  # layer.0.weight [16, 32]: stripes of 8 rows of 32 values
        w2 = 1 * 4 * scales_per_row + 1 * 16 * 4 // 8  # layer.2.weight [2, 16]: stripes of 1 row of 16 values
        for res in results:
            stats = res[scenario]["stats"]
            assert stats["weights_quantized/bytes_sent"] == syncs * 2 * (w0 + w2), scenario
            assert stats["weights/bytes_sent"] == syncs * 2 * 9 * 4  # 18 bias values, fp32 ring: 2 (N-1) ceil(18/N)
            assert stats.get("grad/bytes_sent", 0) == 0
    # what travels is the two-stage quantized average with error feedback, exactly as simulated here,
    # the same on every rank
    for scenario, codec in (("diloco4", ColumnCodec(4)), ("diloco4_e3m0", E3M0Codec())):
        recorded = [r[scenario]["exchanges"] for r in results]
        assert [e["step"] for e in recorded[0]] == [4, 8]
        expected = _exchange_reference([[recorded[r][k]["mine"] for r in range(2)] for k in range(2)], codec)
        for k in range(2):
            for rank in range(2):
                _close(recorded[rank][k]["avg"], expected[k], 0.0)
            mine = torch.stack([_flat(recorded[r][k]["mine"]) for r in range(2)]).mean(0)
            assert not torch.equal(_flat(expected[k]), mine)  # really quantized


def test_streaming_fragments_rotate_and_land_after_the_delay():
    kwargs = {"sync_period": 8, "num_fragments": 2, "fragment_sync_delay": 2, "pseudo_grad_bits": 32}
    scenarios = {"stream": {"strategy": "streaming_diloco", "kwargs": kwargs, "max_steps": 20, "trace": True}}
    scenarios["stream_states"] = {**scenarios["stream"], "state_trace": True}
    results = run_ranks({"scenarios": scenarios}, 2)
    # recording the state waits for each exchange as it is saved; the numbers are the same
    _close(results[0]["stream_states"]["params"], results[0]["stream"]["params"], 0.0)
    traces = [r["stream"]["trace"] for r in results]
    states = [r["stream_states"]["states"] for r in results]
    # fragment 0 starts its exchange after steps 4 and 12 and lands 2 steps later; fragment 1 after 8 and 16
    landed = {0: (6, 14), 1: (10, 18)}
    for fragment, part in ((0, FRAG0), (1, FRAG1)):
        for step in range(1, 21):
            same = torch.equal(traces[0][step - 1][part], traces[1][step - 1][part])
            last = max([s for s in landed[fragment] if s <= step], default=None)
            # the ranks agree on a fragment exactly from the step its exchange landed until they train on
            assert same == (last == step), (fragment, step)
            if last == step:
                glob = _global(states[0][step - 1])[part]
                torch.testing.assert_close(traces[0][step - 1][part], glob, atol=0, rtol=0)
    for step in range(20):  # every rank holds the same global copy at every step
        assert torch.equal(_global(states[0][step]), _global(states[1][step]))
    assert states[0][5]["state"]["outer"]["syncs"] == [1, 0]
    assert states[0][17]["state"]["outer"]["syncs"] == [2, 2]
    for res in results[1:]:  # the final synchronisation: the same weights everywhere
        _close(res["stream"]["params"], results[0]["stream"]["params"], 0.0)


def test_resume_mid_block_and_mid_fragment_reproduces_the_uninterrupted_run():
    # 32 steps per epoch: the checkpoint at step 32 falls mid-block (period 5) and, for streaming,
    # while fragment 1's exchange (started after step 32) is in flight
    diloco = {"sync_period": 5, "pseudo_grad_bits": 4, "small_tensor_numel": 0}
    stream = {"sync_period": 8, "num_fragments": 2, "fragment_sync_delay": 2, "pseudo_grad_bits": 4}
    stream["small_tensor_numel"] = 0
    # sparse, streamed, the local progress kept: the checkpoint holds the error feedback and the
    # weights the exchange in flight left from
    sparse = {"sync_period": 8, "num_fragments": 2, "fragment_sync_delay": 2, "topk_chunk": 64, "topk_per_chunk": 8}
    sparse["small_tensor_numel"] = 0
    scenarios = {}
    cases = (("diloco", "diloco", diloco), ("stream", "streaming_diloco", stream), ("sparse", "sparseloco", sparse))
    for name, strategy, kw in cases:
        scenarios[f"{name}_straight"] = {"strategy": strategy, "kwargs": kw, "max_steps": 48, "ckpt_every": 32}
        scenarios[f"{name}_resumed"] = {
            "strategy": strategy,
            "kwargs": kw,
            "max_steps": 48,
            "resume": [f"{name}_straight", 32],
        }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        for name in ("diloco", "stream", "sparse"):
            _close(res[f"{name}_resumed"]["params"], res[f"{name}_straight"]["params"], 1e-6)


@pytest.mark.mpi
def test_streaming_over_mpi_overlaps_on_a_duplicated_communicator_and_equals_gloo():
    kwargs = {"sync_period": 8, "num_fragments": 2, "fragment_sync_delay": 2, "pseudo_grad_bits": 4}
    kwargs["small_tensor_numel"] = 0
    scenarios = {
        "mpi": {"strategy": "streaming_diloco", "kwargs": {**kwargs, "backend": "mpi"}, "max_steps": 20},
        "gloo": {"strategy": "streaming_diloco", "kwargs": {**kwargs, "backend": "gloo"}, "max_steps": 20},
    }
    results = run_ranks({"scenarios": scenarios}, 2, launcher="mpiexec")
    assert "MPICommunicator" in results[0]["mpi"]["comm"]
    for res in results:
        _close(res["mpi"]["params"], res["gloo"]["params"], 1e-6)
        assert res["mpi"]["stats"]["weights_quantized/calls"] == res["gloo"]["stats"]["weights_quantized/calls"] > 0
    for res in results[1:]:
        _close(res["mpi"]["params"], results[0]["mpi"]["params"], 0.0)
