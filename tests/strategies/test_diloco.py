"""`diloco` and `streaming_diloco` in one process: construction errors, defaults, one-device training."""

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import DiLoCoStrategy, StreamingDiLoCoStrategy
from lightning_commstrats.strategies.periodic import fragment_bounds


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (DiLoCoStrategy, {"pseudo_grad_bits": 3}, r"pseudo_grad_bits=3 is not supported; choose one of \(2, 4, 8"),
        (DiLoCoStrategy, {"pseudo_grad_bits": 1}, "pseudo_grad_bits=1 is not supported"),
        (StreamingDiLoCoStrategy, {"pseudo_grad_bits": 64}, "pseudo_grad_bits=64 is not supported"),
        (DiLoCoStrategy, {"sync_period": 0}, "sync_period must be a positive int, got 0"),
        (DiLoCoStrategy, {"sync_period_unit": "epochs"}, "sync_period_unit='epochs' is not supported"),
        (
            StreamingDiLoCoStrategy,
            {"sync_period": 20, "num_fragments": 4, "fragment_sync_delay": 5},
            r"fragment_sync_delay=5 must be < sync_period / num_fragments = 20/4",
        ),
        (StreamingDiLoCoStrategy, {"num_fragments": 0}, "num_fragments must be an int >= 1, got 0"),
        (StreamingDiLoCoStrategy, {"sync_period": 4, "num_fragments": 8, "fragment_sync_delay": 0}, "num_fragments=8"),
        (StreamingDiLoCoStrategy, {"fragment_sync_delay": -1}, "fragment_sync_delay must be an int >= 0"),
        (StreamingDiLoCoStrategy, {"fragment_update_alpha": 1.5}, r"fragment_update_alpha must be a number in \["),
        (StreamingDiLoCoStrategy, {"fragment_update_alpha": -0.1}, r"fragment_update_alpha must be a number in \["),
        (StreamingDiLoCoStrategy, {"sync_period_unit": "samples"}, "streaming_diloco counts optimizer steps"),
        (DiLoCoStrategy, {"outer_optimizer": "torch.nn.Linear"}, r"outer_optimizer='torch\.nn\.Linear' is not a"),
        (DiLoCoStrategy, {"outer_optimizer": lambda params: params}, "not a torch.optim.Optimizer"),
        (DiLoCoStrategy, {"outer_optimizer": 3}, "outer_optimizer=3 must be a class path"),
        (DiLoCoStrategy, {"outer_lr": -1.0}, "outer_lr must be a number > 0, got -1.0"),
        (DiLoCoStrategy, {"outer_optimizer_kwargs": {"dampening": -3}}, "outer_optimizer=None could not be built"),
    ],
)
def test_bad_arguments_fail_at_construction(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_defaults_are_the_papers():
    d = DiLoCoStrategy()
    assert (d.sync_period, d.sync_period_unit, d.pseudo_grad_bits, d.num_fragments) == (500, "steps", 32, 1)
    opt = d.outer_factory()([torch.nn.Parameter(torch.zeros(1))])
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.SGD) and (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    s = StreamingDiLoCoStrategy()
    assert (s.sync_period, s.num_fragments, s.fragment_sync_delay, s.pseudo_grad_bits) == (100, 4, 5, 4)
    adam = DiLoCoStrategy(outer_optimizer="torch.optim.Adam", outer_lr=0.01).outer_factory()
    assert isinstance(adam([torch.nn.Parameter(torch.zeros(1))]), torch.optim.Adam)


def test_fragments_are_contiguous_balanced_and_never_empty():
    assert fragment_bounds([512, 16, 32, 2], 2) == [(0, 1), (1, 4)]
    assert fragment_bounds([5, 5, 5, 5], 2) == [(0, 2), (2, 4)]
    assert fragment_bounds([1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert fragment_bounds([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    assert fragment_bounds([7], 1) == [(0, 1)]


def _trainer(strategy, steps=6):
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_more_fragments_than_parameter_tensors_fails_before_training():
    model = BoringModel()  # two parameter tensors
    with pytest.raises(ValueError, match="num_fragments=3 is larger than the model's 2 parameter tensors"):
        _trainer(StreamingDiLoCoStrategy(sync_period=6, num_fragments=3, fragment_sync_delay=1)).fit(model)


def test_one_device_trains_and_ends_on_the_global_model():
    model = BoringModel()
    strategy = StreamingDiLoCoStrategy(sync_period=4, num_fragments=2, fragment_sync_delay=1)
    _trainer(strategy).fit(model)
    assert strategy.outer is not None and strategy.outer.syncs == [2, 2]  # steps 2, 6 | 4, and the final sync
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(final, strategy.global_weights(), atol=0, rtol=0)
    assert strategy.comm_stats.bytes_sent == 0
