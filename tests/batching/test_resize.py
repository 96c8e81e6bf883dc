"""The batch-size mechanism: every sample of an epoch once, whatever the sizes, and Lightning's count
of batches kept right."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from lightning_commstrats.batching import (
    ResizableBatchSampler,
    current_batch_size,
    lr_factor,
    make_resizable,
    set_batch_size,
)


class Indices(Dataset):
    """Sample ``i`` is the row ``[i, i, ...]`` (32 features), so a batch tells which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((32,), float(i))


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.zeros(8, 32))


class Recorder(BoringModel):
    def __init__(self, n: int = 30, batch_size: int = 4, shuffle: bool = False, drop_last: bool = False) -> None:
        super().__init__()
        self.n, self.bs, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seen: list[list[list[int]]] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indices(self.n), batch_size=self.bs, shuffle=self.shuffle, drop_last=self.drop_last)

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch, batch_idx):
        self.seen[-1].append([int(v) for v in batch[:, 0]])
        return super().training_step(batch, batch_idx)


class Resize(L.Callback):
    """Sets the size to ``plan[(epoch, batch_idx)]`` after that batch."""

    def __init__(self, plan: dict[tuple[int, int], int], lr_scaling: str = "none") -> None:
        self.plan, self.lr_scaling = plan, lr_scaling
        self.batches_per_epoch: list[int] = []

    def on_train_start(self, trainer, pl_module):
        make_resizable(trainer)

    def on_train_epoch_start(self, trainer, pl_module):
        make_resizable(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        size = self.plan.get((trainer.current_epoch, batch_idx))
        if size is not None:
            set_batch_size(trainer, size, self.lr_scaling)

    def on_train_epoch_end(self, trainer, pl_module):
        self.batches_per_epoch.append(trainer.num_training_batches)


def fit(model: Recorder, callback: Resize, epochs: int = 2, **trainer_kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return trainer


def test_every_sample_once_per_epoch_while_the_size_grows_and_shrinks():
    model = Recorder(n=30, batch_size=4)
    # epoch 0: 4, 4, then 7 (30 - 8 = 22 = 7 + 7 + 7 + 1); epoch 1 starts at 7, shrinks to 3 after batch 1
    trainer = fit(model, Resize({(0, 1): 7, (1, 1): 3}))
    sizes = [[len(b) for b in epoch] for epoch in model.seen]
    assert sizes == [[4, 4, 7, 7, 7, 1], [7, 7, 3, 3, 3, 3, 3, 1]]
    for epoch in model.seen:  # in order, each once
        assert [i for b in epoch for i in b] == list(range(30))
    assert current_batch_size(trainer) == 3
    assert trainer.fit_loop.max_batches == 8


def test_shuffled_epochs_and_drop_last_drop_only_the_short_last_batch():
    torch.manual_seed(0)
    model = Recorder(n=30, batch_size=4, shuffle=True, drop_last=True)
    fit(model, Resize({(0, 0): 8}), epochs=2)
    first, second = ([i for b in e for i in b] for e in model.seen)
    assert [len(b) for b in model.seen[0]] == [4, 8, 8, 8]  # 2 samples left < 8: dropped, as drop_last says
    assert [len(b) for b in model.seen[1]] == [8, 8, 8]
    assert len(set(first)) == len(first) == 28 and len(set(second)) == len(second) == 24
    assert first != second[: len(first)]  # a new order each epoch


def test_validation_at_the_epoch_end_still_runs_after_a_change():
    class Val(Recorder):
        def val_dataloader(self):
            return DataLoader(Indices(4), batch_size=4)

    model = Val(n=30, batch_size=4)
    callback = Resize({(0, 0): 10})
    trainer = fit(model, callback, epochs=1, val_check_interval=1.0, num_sanity_val_steps=0)
    assert [len(b) for b in model.seen[0]] == [4, 10, 10, 6]
    assert trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed == 1


def test_learning_rate_scaling_rules():
    model = Recorder(n=30, batch_size=4)
    trainer = fit(model, Resize({(0, 0): 16}, lr_scaling="linear"), epochs=1)
    # BoringModel: SGD at 0.1 and a StepLR that multiplies by 0.1 at the epoch's end, scaled alike
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 4 * 0.1)
    assert lr_factor(trainer) == pytest.approx(4.0)
    model = Recorder(n=30, batch_size=4)
    trainer = fit(model, Resize({(0, 0): 16}, lr_scaling="sqrt"), epochs=1)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 2 * 0.1)


def test_the_sampler_alone_peeks_without_taking():
    sampler = ResizableBatchSampler(SequentialSampler(range(10)), 3)
    assert sampler.upcoming(4) == [0, 1, 2, 3]
    it = iter(sampler)
    assert next(it) == [0, 1, 2]
    sampler.size = 5
    assert sampler.upcoming(2) == [3, 4]
    assert len(sampler) == 1 + 2
    assert list(it) == [[3, 4, 5, 6, 7], [8, 9]]
    assert sampler.upcoming(2) == [0, 1]  # the next epoch's


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        (lambda: DataLoader(Indices(8), batch_size=None), "plain BatchSampler"),
        (lambda: DataLoader(Stream(), batch_size=2), "map-style"),
    ],
)
def test_loaders_it_cannot_resize_are_refused_by_name(loader, match):
    class Model(Recorder):
        def train_dataloader(self):
            return loader()

    with pytest.raises((ValueError, TypeError), match=match):
        fit(Model(), Resize({}), epochs=1)


def test_a_reloaded_dataloader_keeps_the_size_in_use():
    model = Recorder(n=30, batch_size=4)
    fit(model, Resize({(0, 0): 6}), epochs=2, reload_dataloaders_every_n_epochs=1)
    assert [[len(b) for b in epoch] for epoch in model.seen] == [[4, 6, 6, 6, 6, 2], [6, 6, 6, 6, 6]]


def test_resizing_needs_the_sampler_in_place_before_the_epoch_starts():
    class Late(Resize):
        def on_train_start(self, trainer, pl_module):
            pass

        def on_train_epoch_start(self, trainer, pl_module):
            pass

    with pytest.raises(RuntimeError, match="before the epoch's first batch"):
        fit(Recorder(n=30, batch_size=4), Late({(0, 1): 8}), epochs=1)


def test_upcoming_follows_set_epoch_until_the_first_batch_is_drawn():
    from torch.utils.data.distributed import DistributedSampler

    inner = DistributedSampler(range(16), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler = ResizableBatchSampler(inner, 2)
    it = iter(sampler)  # made before set_epoch, as Lightning does when a run resumes at epoch 5
    inner.set_epoch(5)
    expected = list(inner)
    assert sampler.upcoming(3) == expected[:3]
    assert [i for b in it for i in b] == expected
    inner.set_epoch(6)
    assert sampler.upcoming(8) == list(inner)  # between epochs: the next epoch's


def test_the_progress_bar_total_follows_a_change_of_size():
    class BarTotals(L.Callback):
        def __init__(self) -> None:
            self.totals: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.totals.append(trainer.progress_bar_callback.train_progress_bar.total)

    model = Recorder(n=30, batch_size=4)
    totals = BarTotals()
    # 30 samples: 8 batches of 4; grown to 7 after the second, 6 batches (4, 4, 7, 7, 7, 1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[Resize({(0, 1): 7}), totals],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    assert totals.totals == [8, 6, 6, 6, 6, 6]
