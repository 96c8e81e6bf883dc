"""``fragment_update_alpha`` run, against the paper's mixing rule worked out by hand.

One weight that every optimizer step moves by exactly +1/4 (loss ``-w``, SGD at lr 1/4), outer SGD
at lr 1 without momentum (the global model becomes the average of the local ones: here the one
rank's), ``H = 4``, one fragment, ``tau = 1``. At step 4 the exchange of ``G = 0 - 1`` starts; at
step 5 the global model is 1 and the local weight 1.25, so the local fragment becomes
``alpha * 1.25 + (1 - alpha) * 1``. Every value is a dyadic fraction: the checks are exact.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader

from lightning_commstrats import StreamingDiLoCoStrategy


class UnitSteps(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(self.layer.weight)
        self.trace: list[float] = []

    def training_step(self, batch, batch_idx):
        return -self.layer.weight.sum() + 0.0 * batch.sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trace.append(self.layer.weight.item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.25)

    def train_dataloader(self):
        return DataLoader(RandomDataset(1, 64), batch_size=1)


def expected(alpha: float, steps: int = 12, keep: bool = False) -> tuple[list[float], float]:
    """The trace after every step and the final weight, from the rule (not from the package); with
    ``keep`` (keep_local_progress) the fragment becomes the new start plus the steps since the launch."""
    local, start, trace, launched, pending, at_launch = 0.0, 0.0, [], None, 0.0, 0.0
    for step in range(1, steps + 1):
        local += 0.25
        if launched is not None and step == launched + 1:  # tau = 1: the outer step lands
            start = start - 1.0 * pending  # outer SGD, lr 1: start - G
            local = start + (local - at_launch) if keep else alpha * local + (1 - alpha) * start
            launched = None
        if step % 4 == 0:  # H = 4: this block's pseudo-gradient leaves
            pending, launched, at_launch = start - local, step, local
        trace.append(local)
    final = start - pending if launched is not None else start  # the end-of-fit sync: the global model
    return trace, final


def fit(model: UnitSteps, strategy: StreamingDiLoCoStrategy) -> None:
    """12 steps on one CPU rank, nothing but training."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=12,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.75, 1.0])
def test_the_local_fragment_mixes_with_the_global_one(alpha):
    model = UnitSteps()
    strategy = StreamingDiLoCoStrategy(
        sync_period=4,
        num_fragments=1,
        fragment_sync_delay=1,
        fragment_update_alpha=alpha,
        outer_lr=1.0,
        outer_momentum=0.0,
        pseudo_grad_bits=32,
    )
    fit(model, strategy)
    trace, final = expected(alpha)
    assert model.trace == trace
    assert model.layer.weight.item() == final
    if alpha == 0.5:  # written out once: step 5 mixes 1.25 with the global 1
        assert trace[4] == 1.125 and trace[8] == 2.0


@pytest.mark.parametrize("keep", [False, True])
def test_keep_local_progress_keeps_the_steps_taken_while_the_exchange_was_in_flight(keep):
    model = UnitSteps()
    strategy = StreamingDiLoCoStrategy(
        sync_period=4,
        num_fragments=1,
        fragment_sync_delay=1,
        keep_local_progress=keep,
        outer_lr=1.0,
        outer_momentum=0.0,
        pseudo_grad_bits=32,
    )
    fit(model, strategy)
    trace, final = expected(0.0, keep=keep)
    assert model.trace == trace
    assert model.layer.weight.item() == final
    # kept: every one of the 12 steps of +1/4 is in the final model; replaced: the step after each of
    # the two syncs that landed during training is lost
    assert final == (3.0 if keep else 2.5)
