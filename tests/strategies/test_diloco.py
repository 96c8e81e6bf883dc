"""`diloco` and `streaming_diloco` in one process: construction errors, defaults, one-device training."""

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import BMUFStrategy, DiLoCoStrategy, ModelAveragingStrategy, StreamingDiLoCoStrategy
from lightning_commstrats.strategies.base import STATE_KEY
from lightning_commstrats.strategies.fragments import fragment_bounds


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (DiLoCoStrategy, {"pseudo_grad_bits": 3}, r"pseudo_grad_bits=3 is not supported; choose one of \(2, 4, 8"),
        (DiLoCoStrategy, {"pseudo_grad_bits": 1}, "pseudo_grad_bits=1 is not supported"),
        (StreamingDiLoCoStrategy, {"pseudo_grad_bits": 64}, "pseudo_grad_bits=64 is not supported"),
        (
            StreamingDiLoCoStrategy,
            {"pseudo_grad_codec": "fp4"},
            r"pseudo_grad_codec='fp4' is not supported; choose one of \('uniform', 'e3m0', 'topk', 'statistical'\)",
        ),
        (
            StreamingDiLoCoStrategy,
            {"pseudo_grad_codec": "e3m0", "pseudo_grad_bits": 8},
            "pseudo_grad_codec='e3m0' is a 4-bit format: it needs pseudo_grad_bits=4, got pseudo_grad_bits=8",
        ),
        (DiLoCoStrategy, {"pseudo_grad_codec": "e3m0"}, "it needs pseudo_grad_bits=4, got pseudo_grad_bits=32"),
        (BMUFStrategy, {"pseudo_grad_codec": "e3m0", "pseudo_grad_bits": 2}, "got pseudo_grad_bits=2"),
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
        (
            DiLoCoStrategy,
            {"sync_period": 64, "sync_period_unit": "samples", "fragment_sync_delay": 3},
            "fragment_sync_delay=3 counts optimizer steps: it needs sync_period_unit='steps', got 'samples'",
        ),
        (BMUFStrategy, {"outer_lr": 0.1}, "BMUFStrategy has a fixed outer step and does not take outer_lr"),
        (BMUFStrategy, {"outer_optimizer": "torch.optim.Adam"}, "does not take outer_optimizer"),
        (ModelAveragingStrategy, {"outer_momentum": 0.9}, "ModelAveragingStrategy has a fixed outer step"),
    ],
)
def test_bad_arguments_fail_at_construction(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_defaults_are_the_papers_but_the_outer_momentum():
    d = DiLoCoStrategy()
    assert (d.sync_period, d.sync_period_unit, d.pseudo_grad_bits, d.num_fragments) == (500, "steps", 32, 1)
    # the paper's outer Nesterov SGD at lr 0.7, its momentum 0.5 instead of 0.9 (a steady-state gain of
    # 1.4x instead of 7x: benchmarks/results/diloco_defaults/); the same for the streaming form
    for strategy in (d, StreamingDiLoCoStrategy()):
        opt = strategy.outer_factory()([torch.nn.Parameter(torch.zeros(1))])
        group = opt.param_groups[0]
        assert isinstance(opt, torch.optim.SGD)
        assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.5, True)
    paper = DiLoCoStrategy(outer_momentum=0.9).outer_factory()([torch.nn.Parameter(torch.zeros(1))])
    assert paper.param_groups[0]["momentum"] == 0.9
    s = StreamingDiLoCoStrategy()
    assert (s.sync_period, s.num_fragments, s.fragment_sync_delay, s.pseudo_grad_bits) == (100, 4, 5, 4)
    assert s.pseudo_grad_codec == d.pseudo_grad_codec == "uniform"  # not the paper's E3M0 unless asked
    assert StreamingDiLoCoStrategy(pseudo_grad_codec="e3m0").pseudo_grad_codec == "e3m0"
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


class _RecordLocalWeights(L.Callback):
    """Placed before ModelCheckpoint: what the ranks' local weights are at each validation's end."""

    def __init__(self):
        self.local = {}

    def on_validation_end(self, trainer, pl_module):
        stash = trainer.strategy._stash
        if stash is not None:
            self.local[trainer.global_step] = torch.cat([t.reshape(-1) for t in stash]).clone()


def test_a_checkpoint_saved_at_validation_keeps_the_local_weights_not_the_global_model(tmp_path):
    torch.manual_seed(0)
    record = _RecordLocalWeights()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{step}")
    strategy = DiLoCoStrategy(sync_period=10)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=15,
        val_check_interval=5,
        limit_val_batches=1,
        logger=False,
        callbacks=[record, ckpt],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    saved = torch.load(tmp_path / "step=5.ckpt", weights_only=False)
    local = saved[STATE_KEY]["rank"]["weights"]
    global_model = torch.cat([v.reshape(-1) for v in saved["state_dict"].values()])
    assert not torch.equal(record.local[5], global_model)  # mid-block: the two differ
    torch.testing.assert_close(local, record.local[5], atol=0, rtol=0)


def test_after_the_final_sync_fragments_take_turns_again_and_a_resumed_run_goes_on(tmp_path):
    torch.manual_seed(0)
    strategy = StreamingDiLoCoStrategy(sync_period=8, num_fragments=2, fragment_sync_delay=1)
    trainer = _trainer(strategy, steps=5)
    trainer.fit(BoringModel())
    assert strategy.schedule.block_start == [1, 5]  # as at a start from step 5: fragment 0 due at 9, fragment 1 at 13
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    resumed = StreamingDiLoCoStrategy(sync_period=8, num_fragments=2, fragment_sync_delay=1)
    _trainer(resumed, steps=20).fit(BoringModel(), ckpt_path=tmp_path / "end.ckpt")
    # (fragment, step its exchange started after, step applied after): the rotation goes on, then the final sync
    assert list(resumed.sync_history) == [(0, 9, 10), (1, 13, 14), (0, 17, 18), (0, 20, 20), (1, 20, 20)]
