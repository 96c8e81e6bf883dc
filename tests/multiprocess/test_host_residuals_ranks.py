"""Error-feedback residuals of the gradient schemes kept on the host, on real ranks (gloo, CPU).

2 ranks in groups of one: the slow hop (``slow_hop_bits=4``) crosses the two groups every step.
``onebit_sgd`` and ``allreduce`` run sharded (``shard="fsdp"``); ``onebit_adam`` and ``zero_one_adam``,
which refuse ``shard``, run whole in groups of one and compress Adam's momentum after a warm-up of two
fp32 steps. The 1-bit schemes hold two kinds of residuals (their 1-bit exchange's, for the embedding,
and the slow hop's, for the fp32 tensors), ``allreduce`` the slow hop's. With ``residuals="host"``
every holder keeps them at the host, and the training is bit for bit the one with residuals on the
device: the residuals only wait elsewhere. The ranks train on the CPU, where the host is the device
(nothing is copied or pinned), so what tells the two apart here is where each holder says it keeps
them; the pinned copies themselves are exercised on CUDA (tests/test_host_residuals.py, marked cuda).
"""

from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).parent / "shard_worker.py"
SHARD = {"shard": "fsdp", "group_size": 1, "shard_policy": {"min_unit_numel": 1}, "slow_hop_bits": 4}
GROUPS = {"group_size": 1, "slow_hop_bits": 4}
QUIET = {"floor_warning": None, "settling_warning": None}  # the checks of a long run's freeze
# key: (scheme, its arguments, optimizer, the holders of residuals)
SCHEMES = {
    "onebit": ("onebit_sgd", {"num_quantization_bits": 1, **SHARD}, "sgd", ("hop", "exchange")),
    "allreduce": ("allreduce", SHARD, "sgd", ("hop",)),
    "onebit_adam": ("onebit_adam", {"freeze_step": 2, **QUIET, **GROUPS}, "adamw", ("hop", "exchange")),
    "zero_one_adam": (
        "zero_one_adam",
        {"var_freeze_step": 2, "var_update_scaler": 1, "local_step_clipper": 1, **QUIET, **GROUPS},
        "adamw",
        ("hop", "exchange"),
    ),
}


def test_gradient_schemes_keep_residuals_on_the_host_bit_for_bit():
    scenarios = {}
    for key, (scheme, kwargs, optimizer, _) in SCHEMES.items():
        base = {"strategy": scheme, "kwargs": kwargs, "max_steps": 4, "optimizer": optimizer, "devices": 2}
        scenarios[f"{key}_device"] = base
        scenarios[f"{key}_host"] = {**base, "kwargs": {**kwargs, "residuals": "host"}}
    ranks = run_ranks({"scenarios": scenarios}, 2, script=WORKER)
    for key, (_, _, _, holders) in SCHEMES.items():
        for res in ranks:
            device, host = res[f"{key}_device"], res[f"{key}_host"]
            assert set(host["residuals"]) == set(holders), (key, host["residuals"])
            for holder in holders:
                kept = host["residuals"][holder]
                assert kept["home"] == "cpu", (key, holder, kept)
                assert kept["tensors"], (key, holder)  # the run made residuals
                # the ranks train on the CPU even where CUDA is there: the host is the device, nothing is pinned
                assert all(d == "cpu" and not p for d, p in kept["tensors"]), (key, holder, kept)
                assert device["residuals"][holder]["home"] == "None", (key, holder)
            # the memory accounting counts them where they are: on the host
            held = sum(h["bytes"] for h in host["residuals"].values())
            assert host["memory"]["scheme"].get("cpu", 0) >= held > 0, (key, host["memory"])
            # where the residuals wait changes nothing of the training
            assert host["losses"] == device["losses"], key
            for name, w in device["final"].items():
                assert torch.equal(host["final"][name], w), (key, name)
        # and the replicas agree
        for name, w in ranks[0][f"{key}_host"]["final"].items():
            assert torch.equal(ranks[1][f"{key}_host"]["final"][name], w), (key, name)
