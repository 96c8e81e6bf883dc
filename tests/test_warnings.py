"""What a user sees on stderr from a sharded run of the package's own model: no warning that looks
like a correctness bug where none is (issue: FSDP2's note about views, DTensor's about random
operators on a CPU mesh, torch's deprecated collective names). Run as a user runs it, in a process of
its own: pytest's own warning capture would override the filters under test."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = """
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
import lightning_commstrats as lc
from lightning_commstrats.models import LanguageModel

torch.manual_seed(0)
tokens = torch.randint(0, 64, (8, 9))
data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
trainer = L.Trainer(
    accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    strategy=lc.DiLoCoStrategy(sync_period=1, sync_period_unit="steps", shard="fsdp", group_size=1,
                               shard_policy={"min_unit_numel": 1}),
    plugins=[lc.LayeredMixedPrecision(preset="layered", dtype="bf16")],
)
with trainer.init_module(empty_init=True):
    model = LanguageModel(arch="transformer", vocab_size=64, embed_dim=16, hidden_dim=16, num_layers=2,
                          num_heads=2, ffn_dim=32, max_seq_len=8, num_experts=2)
trainer.fit(model, data, data)
trainer.validate(model, data)
print("FITTED")
"""

LOOK_LIKE_BUGS = (
    "returned a view tensor",
    "DTensor random operators may not have complete support",
    "is deprecated. Please use `torch.distributed.",
    "configure_model sharded the model itself",
)


def test_a_sharded_empty_built_run_of_the_package_model_says_nothing_that_looks_like_a_bug():
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "FITTED" in run.stdout, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if any(s in line for s in LOOK_LIKE_BUGS)]
    assert said == [], said
