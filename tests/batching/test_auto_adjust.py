"""AutoAdjust on one process: CNTK's candidate sizes, the choice on constructed losses whose answer is
known, a search that changes nothing, and the settings it refuses."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_commstrats import AutoAdjust
from lightning_commstrats.batching import current_batch_size, in_trial


class Rows(Dataset):
    """Sample ``i``: features ``x_i`` (4 values) and a target; fixed by ``seed``."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Linear(L.LightningModule):
    """Linear regression, plain SGD at ``lr`` (mean squared error over the batch).

    ``penalty_above``: the loss gets +1 on every batch of more samples than this: a constructed
    loss whose best size is known. ``dropout``: random numbers drawn every step."""

    def __init__(self, batch_size: int = 4, lr: float = 0.05, penalty_above: int | None = None, dropout: float = 0.0):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.drop = nn.Dropout(dropout)
        self.bs, self.lr, self.penalty_above = batch_size, lr, penalty_above
        self.trial_calls = 0
        self.sizes: list[int] = []

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=self.bs)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.layer(self.drop(x)).squeeze(-1) - y) ** 2).mean()
        if self.penalty_above is not None and len(x) > self.penalty_above:
            loss = loss + 1.0
        if in_trial(self.trainer):
            self.trial_calls += 1
        else:
            self.sizes.append(len(x))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(model: L.LightningModule, callbacks: list, epochs: int = 1, ckpt_path=None, **kwargs) -> L.Trainer:
    settings = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        callbacks=callbacks,
        enable_model_summary=False,
        **{**settings, **kwargs},
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def test_the_choice_on_a_loss_that_punishes_batches_above_16():
    # candidates from 4 by sqrt(2), rounded to multiples of 4: 4, (5.66 -> 4, tried once), 8, 12, 16,
    # 24 (22.6): the trial of 24 has batches 24, 24, 16: loss above 1.75 x the base, the search stops
    # and keeps 16, which trains the epoch.
    model = Linear(penalty_above=16, lr=0.0)
    auto = AutoAdjust(search_samples=64, round_to=4, error_margin=1.0, lr_scaling="none")
    trainer = fit(model, [auto])
    (search,) = auto.history
    assert [size for size, _ in search["trials"]] == [4, 8, 12, 16, 24]
    losses = [loss for _, loss in search["trials"]]
    assert losses[:4] == pytest.approx([losses[0]] * 4)  # lr 0: the same loss for every size up to 16
    assert search["chosen"] == 16 and current_batch_size(trainer) == 16
    assert model.sizes == [16, 16, 16, 16]


def trial_loss(start: dict[str, torch.Tensor], data: Rows, size: int, lr: float) -> float:
    """A trial mini-epoch written out: SGD over the 64 samples in batches of ``size``, from ``start``;
    the average over samples of each batch's loss before its step."""
    w, b = start["layer.weight"].clone(), start["layer.bias"].clone()
    total = 0.0
    for i in range(0, len(data), size):
        x, y = data.x[i : i + size], data.y[i : i + size]
        err = x @ w.T + b - y[:, None]
        total += float((err**2).mean()) * len(x)
        w -= lr * (2 * err * x).mean(0, keepdim=True)
        b -= lr * (2 * err).mean(0)
    return total / len(data)


@pytest.mark.parametrize(
    ("lr_scaling", "margin", "answer"), [("linear", 16.0, 32), ("sqrt", 20.0, 16), ("none", 10.0, 4)]
)
def test_trial_losses_and_choice_match_sgd_written_out(lr_scaling, margin, answer):
    # the trial losses grow with the size (fewer steps over the same 64 samples); the margin decides
    torch.manual_seed(0)
    model = Linear(lr=0.01)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    auto = AutoAdjust(search_samples=64, round_to=4, error_margin=margin, lr_scaling=lr_scaling)
    fit(model, [auto])
    (search,) = auto.history
    data = Rows()
    scale = {"linear": lambda s: s / 4, "sqrt": lambda s: math.sqrt(s / 4), "none": lambda s: 1.0}[lr_scaling]
    expected, choice = [], None
    for size in (4, 8, 12, 16, 24, 32, 44, 64, 92):  # 4 sqrt(2)^k in float32, rounded to multiples of 4
        if expected and size > 64:
            break
        expected.append((size, trial_loss(start, data, size, 0.01 * scale(size))))
        if len(expected) > 1 and expected[-1][1] > expected[0][1] * (1 + margin / 100):
            break
        choice = size
    print(lr_scaling, [(s, round(v, 4)) for s, v in expected], "->", choice)
    assert [s for s, _ in search["trials"]] == [s for s, _ in expected]
    torch.testing.assert_close([v for _, v in search["trials"]], [v for _, v in expected], rtol=1e-5, atol=1e-6)
    assert search["chosen"] == choice == answer
    assert len(expected) > 1


def test_a_search_that_keeps_the_size_leaves_the_run_bit_for_bit_unchanged():
    # every size above 4 is punished: the search tries 4 and 8 and keeps 4; everything it changed
    # (weights, SGD state, the dropout's random numbers, the data position) is put back, so the run
    # equals one without the callback. (Not shuffled: one process shuffles with a RandomSampler that
    # draws its order from the global generator when the search looks at it; with several ranks the
    # DistributedSampler's order is fixed by seed and epoch: see tests/multiprocess.)
    def run(callbacks: list) -> tuple[torch.Tensor, Linear]:
        L.seed_everything(7)
        model = Linear(penalty_above=4, dropout=0.5)
        fit(model, callbacks, epochs=2)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), model

    auto = AutoAdjust(search_samples=32, round_to=4, lr_scaling="none")
    with_search, searched = run([auto])
    without, _ = run([])
    assert [h["chosen"] for h in auto.history] == [4, 4]
    assert [len(h["trials"]) for h in auto.history] == [2, 2]
    assert searched.trial_calls == 2 * (8 + 4)  # 32 samples in batches of 4, then of 8, per search
    assert torch.equal(with_search, without)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"error_margin": -0.5}, "error_margin"),
        ({"tuning_frequency": 0}, "tuning_frequency"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": 8, "min_batch_size": 16}, "max_batch_size"),
        ({"search_samples": 0}, "search_samples"),
        ({"round_to": 0}, "round_to"),
        ({"lr_scaling": "cubic"}, "lr_scaling"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_setting(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        AutoAdjust(**kwargs)


def test_a_maximum_below_the_batch_size_in_use_fails_when_fit_starts():
    with pytest.raises(ValueError, match=r"max_batch_size=2\).*below the batch size in use \(4\)"):
        fit(Linear(), [AutoAdjust(max_batch_size=2)])


def test_gradient_accumulation_is_refused():
    with pytest.raises(ValueError, match="accumulate_grad_batches=2"):
        fit(Linear(), [AutoAdjust(round_to=4)], accumulate_grad_batches=2)


def test_the_tuning_epochs_follow_cntk():
    auto = AutoAdjust(tuning_frequency=3)
    auto.chosen = 128
    # epochs counted from 1: the first three search, then every third
    assert [e + 1 for e in range(10) if auto.searches(e)] == [1, 2, 3, 6, 9]
    assert [auto.rounded(x) for x in (10, 31.9, 32, 95.9, 96, 181.02)] == [64, 64, 64, 64, 128, 192]
    assert list(AutoAdjust(round_to=4).candidates(4, 64)) == [4, 8, 12, 16, 24, 32, 44, 64]
    assert list(AutoAdjust(round_to=8).candidates(8, 32)) == [8, 16, 24, 32]  # float32: 31.999996 <= 32
    assert list(AutoAdjust().candidates(100, 400)) == [128, 192, 256, 384]  # 100, 141, 200, 283, 400


def test_a_decayed_learning_rate_raises_the_smallest_candidate_as_cntk():
    # the rate falls to a quarter after epoch 0: CNTK raises the minimum by 1 / sqrt(1/4) = 2, so
    # epoch 1 (whose previous choice CNTK ignores) starts its candidates at 8, not 4
    class Decaying(Linear):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)]

    model = Decaying(penalty_above=4, lr=1e-3)
    auto = AutoAdjust(search_samples=16, round_to=4, lr_scaling="none")
    trainer = fit(model, [auto], epochs=2)
    assert [h["trials"][0][0] for h in auto.history] == [4, 8]
    # from 8 on every size is punished alike: the search grows to the 16 search samples
    assert [h["chosen"] for h in auto.history] == [4, 16]
    assert float(trainer.callback_metrics["train/batch_size"]) == 16.0


def test_the_choice_and_the_learning_rate_factor_survive_a_checkpoint(tmp_path):
    class Seen(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.size = current_batch_size(trainer)
            self.lr = trainer.optimizers[0].param_groups[0]["lr"]

    # a margin so wide that every size passes: the search grows to the 16 search samples
    model = Linear(lr=0.0)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    auto = AutoAdjust(search_samples=16, round_to=4, lr_scaling="linear", max_batch_size=16, error_margin=1e6)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = fit(model, [auto, ckpt], epochs=1, enable_checkpointing=True)
    assert auto.history[0]["chosen"] == 16 and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.4)
    resumed_auto, seen = (
        AutoAdjust(search_samples=16, round_to=4, lr_scaling="linear", max_batch_size=16, error_margin=1e6),
        Seen(),
    )
    model = Linear(lr=0.0)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    trainer = fit(model, [resumed_auto, seen], epochs=2, ckpt_path=tmp_path / "last.ckpt")
    assert seen.size == 16 and seen.lr == pytest.approx(0.4)  # as the checkpoint left them
    assert [h["epoch"] for h in resumed_auto.history] == [0, 1]
    assert resumed_auto.history[1]["previous"] == 16  # epoch 1 searched from 16, its rate not scaled twice
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * resumed_auto.history[1]["chosen"] / 4)


def test_strategies_whose_state_cannot_be_rolled_back_are_refused_by_name():
    from lightning_commstrats import AllReduceStrategy, DiLoCoStrategy, OneBitSGDStrategy, ParameterServerStrategy
    from lightning_commstrats.batching.auto_adjust import check_rollback

    with pytest.raises(ValueError, match=r"ParameterServerStrategy\(mode='async'\)"):
        check_rollback(ParameterServerStrategy(mode="async"))
    with pytest.raises(ValueError, match=r"AllReduceStrategy\(shard='fsdp'\)"):
        check_rollback(AllReduceStrategy(shard="fsdp"))
    ft = DiLoCoStrategy(fault_tolerance={"lighthouse": "http://127.0.0.1:29510", "replica_id": "a"})
    with pytest.raises(ValueError, match="DiLoCoStrategy with fault_tolerance"):
        check_rollback(ft)
    with pytest.raises(ValueError, match="FSDPStrategy"):
        check_rollback(L.pytorch.strategies.FSDPStrategy())
    for fine in (ParameterServerStrategy(mode="sync"), OneBitSGDStrategy(), DiLoCoStrategy()):
        check_rollback(fine)


def test_the_loss_scaler_is_rolled_back():
    # layered fp16 with dynamic loss scaling on one rank of allreduce: each trial step counts a clean
    # step in the scaler (growth_interval 3: the scale doubles within a trial); after the search the
    # scaler is where it was, and the trained epoch moves it as a run without the search would
    from lightning_commstrats import AllReduceStrategy, LayeredMixedPrecision

    class Probe(AutoAdjust):
        def on_train_epoch_start(self, trainer, pl_module):
            self.before = dict(trainer.precision_plugin.state_dict()["scaler"])
            self.ends = []
            super().on_train_epoch_start(trainer, pl_module)

        def _trial(self, trainer, pl_module, snapshot, indices, size):
            loss = super()._trial(trainer, pl_module, snapshot, indices, size)
            self.ends.append(dict(trainer.precision_plugin.state_dict()["scaler"]))
            return loss

        def _choose(self, trainer, size, epoch, trials, spent):
            self.after = dict(trainer.precision_plugin.state_dict()["scaler"])
            super()._choose(trainer, size, epoch, trials, spent)

    probe = Probe(search_samples=16, round_to=4, lr_scaling="none")
    plugin = LayeredMixedPrecision("O1", dtype="fp16", device="cpu", growth_interval=3, init_scale=2.0**6)
    fit(Linear(penalty_above=4), [probe], strategy=AllReduceStrategy(), plugins=[plugin])
    assert probe.ends[0] == {"scale": 2.0**7, "clean_steps": 1, "skipped_steps": 0}  # 4 steps: one growth
    assert probe.after == probe.before == {"scale": 2.0**6, "clean_steps": 0, "skipped_steps": 0}


def test_with_dataloader_workers_the_trials_still_take_the_epochs_first_samples():
    # two workers hold two batches each (of the size before the search) when the first epoch starts:
    # they come first, then the chosen size; the trials trained on the epoch's first 16 samples
    class Indexed(Rows):
        def __getitem__(self, i: int):
            return self.x[i], self.y[i], i

    class Model(Linear):
        def __init__(self):
            super().__init__(lr=0.01)
            self.trained, self.tried = [], []

        def train_dataloader(self):
            return DataLoader(Indexed(), batch_size=4, num_workers=2)

        def training_step(self, batch, batch_idx):
            x, y, i = batch
            if in_trial(self.trainer):
                if batch_idx == 0:
                    self.tried.append([])
                self.tried[-1].extend(i.tolist())
            else:
                self.trained.append(i.tolist())
            return super().training_step((x, y), batch_idx)

    model = Model()
    auto = AutoAdjust(search_samples=16, round_to=4, lr_scaling="none", error_margin=1e6, max_batch_size=16)
    fit(model, [auto])
    assert auto.history[0]["chosen"] == 16
    assert all(trial == list(range(16)) for trial in model.tried) and len(model.tried) == 4  # 4, 8, 12, 16
    assert [len(b) for b in model.trained] == [4, 4, 4, 4, 16, 16, 16]
    assert [i for b in model.trained for i in b] == list(range(64))
