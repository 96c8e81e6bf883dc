"""The fault-tolerance walk-through (docs/fault_tolerance.md), run as written: the block between its
``walkthrough`` markers is the single source, run by bash with a short setting through the variables it reads
(``STEPS``, ``PORT``, ``FAIL_AFTER``, ``BACK_AFTER``). It must finish by itself, every replica that
was not killed exiting with status 0, and leave no process behind (the Lighthouse stopped by PID)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import _base_env

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "fault_tolerance.md"  # the page that holds the walk-through
BEGIN, END = "<!-- walkthrough:begin", "<!-- walkthrough:end -->"
LM_LINE = re.compile(r"\[lm\] valid perplexity ([\d.]+)")
STEPS = 128

pytestmark = pytest.mark.skipif(
    not (Path(sys.executable).parent / "commstrats-lighthouse").exists(),
    reason="the console commands are not installed beside this interpreter (pip install -e .)",
)


def walkthrough() -> str:
    """The shell block between the fault-tolerance page's walk-through markers."""
    text = PAGE.read_text()
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    block = re.search(r"^```bash\n(.*?)^```$", section, flags=re.DOTALL | re.MULTILINE)
    assert block, "no ```bash block between the walk-through markers"
    return block.group(1)


def free_port_pair() -> int:
    """A port P with P and P + 1 free on the loopback interface (the Lighthouse and its run store)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_block_is_a_script_without_broad_kills():
    block = walkthrough()
    assert "pkill" not in block and "killall" not in block
    assert "kill -9 $r2" in block and "kill $lighthouse" in block
    assert re.search(r"^for pid in \$r0 \$r1 \$r2b; do wait \$pid", block, flags=re.MULTILINE)  # not a bare wait
    assert "${STEPS:-192}" in block and "${PORT:-29510}" in block


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_walkthrough_runs_as_written_and_finishes(tmp_path):
    env = _base_env()
    env.pop("TORCHFT_LIGHTHOUSE", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # The restarted replica must join before the run ends (one that comes after the end exits with
    # status 1, saying so): r2 fails at 20 s and comes back at once, and the run has 128 steps (8 syncs
    # of 16) left to go, 30 s or more at 0.25 s a step (three replicas on a fast machine), two to four
    # minutes on 2 shared cores
    env.update(STEPS=str(STEPS), PORT=str(free_port_pair()), FAIL_AFTER="20", BACK_AFTER="1")
    proc = subprocess.Popen(
        ["bash", "-c", walkthrough()],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the block's processes share this group: nothing can outlive the test
    )
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
        pytest.fail(
            "the walk-through did not finish in 540 s (or a process it started, the Lighthouse not stopped,"
            f" still holds its output):\n{out}\n{logs}"
        )
    finally:
        deadline = time.monotonic() + 30
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = group_alive(proc.pid)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
    logs = {p.stem: p.read_text() for p in tmp_path.glob("*.log")}
    detail = out + "".join(f"\n--- {name}\n{text[-3000:]}" for name, text in sorted(logs.items()))
    assert proc.returncode == 0, detail
    assert not left, "processes of the walk-through outlived it (the Lighthouse not stopped?)\n" + detail
    assert "commstrats-lighthouse: listening at http://127.0.0.1:" in out, detail
    assert len(re.findall(r"^replica \d+ exited with status 0$", out, flags=re.MULTILINE)) == 3, detail
    # the replicas that finished end with the same global model, and each says its perplexity
    perplexities = {name: LM_LINE.findall(logs[name]) for name in ("r0", "r1", "r2b")}
    assert all(len(found) == 1 for found in perplexities.values()), detail
    assert len({found[0] for found in perplexities.values()}) == 1, perplexities
    assert all(f"`max_steps={STEPS}` reached" in logs[name] for name in perplexities), detail
    if "should_commit completed should_commit=true" in logs["r2"]:
        # r2 had committed a sync before it was killed, so the run was past step 0 when r2 came back:
        # the restarted replica took the run's state (on a loaded machine r2 may die before its first
        # sync, and come back in time for the run's first quorum, with nothing to heal)
        assert "healing is required" in logs["r2b"], detail
