"""`sampled_vocab` on real ranks: all words selected = allreduce; unselected rows never move;
ranks identical after every step; composition with 1-bit; bytes of ids and rows counted apart."""

import pytest
import torch
from harness import ring_bytes, run_ranks

pytestmark = pytest.mark.multiprocess

V, H = 50, 16
LM = {"model": "lm", "trace": True, "max_steps": 6}


def _ranks_identical_every_step(results, name):
    for res in results[1:]:
        for a, b in zip(res[name]["trace"], results[0][name]["trace"], strict=True):
            assert torch.equal(a, b)


def _output_rows(flat_params, tied):
    # LSTMLM parameter order: embedding (V x H), lstm..., output weight (V x H, absent when tied), bias (V)
    if tied:
        return flat_params[: V * H].view(V, H)
    return flat_params[-(V * H + V) : -V].view(V, H)


def test_all_words_equal_allreduce_and_unselected_rows_never_move():
    adam = {"optimizer": "adam", "lr": 0.05}
    scenarios = {
        "ar": {**LM, "strategy": "allreduce", "model_kwargs": adam},
        "all_words": {
            **LM,
            "strategy": "sampled_vocab",
            "model_kwargs": adam,
            "kwargs": {"alpha": V, "beta": 0, "word_counts": "data"},
        },
        "few_words": {
            **LM,
            "strategy": "sampled_vocab",
            "model_kwargs": adam,
            "kwargs": {"alpha": 3, "beta": 2, "word_counts": "data"},
        },
        "few_tied": {
            **LM,
            "strategy": "sampled_vocab",
            "model_kwargs": {**adam, "tie_weights": True},
            "kwargs": {"alpha": 0.1, "beta": 0.04, "word_counts": "data", "error_feedback": True},
        },
        "onebit_inner": {
            **LM,
            "strategy": "sampled_vocab",
            "model_kwargs": adam,
            "kwargs": {
                "alpha": 3,
                "beta": 2,
                "word_counts": "data",
                "num_quantization_bits": 1,
                "small_tensor_numel": 100,
            },
        },
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for name in scenarios:
        _ranks_identical_every_step(results, name)
    for a, b in zip(results[0]["all_words"]["trace"], results[0]["ar"]["trace"], strict=True):
        assert torch.equal(a, b)
    for name, tied in (("few_words", False), ("few_tied", True), ("onebit_inner", False)):
        trace, rows = results[0][name]["trace"], results[0][name]["rows"]
        moved_any = False
        for step in range(1, len(trace)):
            before, after = _output_rows(trace[step - 1], tied), _output_rows(trace[step], tied)
            selected = torch.zeros(V, dtype=torch.bool)
            selected[rows[step]] = True
            assert 0 < int(selected.sum()) < V
            assert torch.equal(after[~selected], before[~selected]), f"{name} step {step}: an unselected row moved"
            moved_any |= not torch.equal(after[selected], before[selected])
        assert moved_any
    for res in results:
        stats = res["few_words"]["stats"]
        assert stats["vocab_ids/calls"] == 6 * 2  # lengths, then the padded ids
        assert stats["vocab_rows/calls"] == 6
        assert stats["vocab_rows/bytes_sent"] > 0 and stats["vocab_ids/bytes_sent"] > 0
        assert res["onebit_inner"]["stats"]["grad_quantized/calls"] == 6 * 2
    # rows bytes: the selected rows of the embedding, the output weight and bias, and one value that
    # says whether every rank's vocabulary gradients are finite, ring all-reduced
    rows = results[0]["few_words"]["rows"][-1]
    width = H + H + 1
    last = results[0]["few_words"]["last_step"]
    assert last["vocab_rows/bytes_sent"] == ring_bytes(rows.numel() * width + 1, 4, 2)
