"""Apply each mutant of the zoo (``tests/mutants/zoo.py``) to a copy of the repository and run its tests there.

``make mutants`` (outside ``make test``). The checkout's own files are never touched: the runner copies
``lightning_commstrats/``, ``tests/``, ``recipes/``, ``benchmarks/`` (without its results) and
``pyproject.toml`` to a temporary directory once, checks that Python started there imports the copy's
package (``PYTHONPATH`` puts the copy first; the ranks that ``tests/harness.py`` starts get the copy's root
too, the harness's own checkout), and runs the selected tests of the unmutated copy once: all must pass,
else it stops. Then, one mutant at a time: the mutated line is written into the copy's file (the runner
stops when the original text is not found exactly once), ``python -m pytest -x`` runs the mutant's tests
(stopping at the first failure: a kill) within ``--timeout`` seconds (running out counts as a kill), and
the file is restored. A mutant killed by the reference (``test_reference_ranks.py``) is then run once more
against the quick matrix cases alone, to find what only the reference kills.

Writes ``results.md`` (a table) and ``results.json`` to ``--out`` (default ``tests/mutants/results/``) and
prints the kill rate and the time taken.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from zoo import MATRIX, REFERENCE, ZOO, Mutant  # noqa: E402

COPIED = ("lightning_commstrats", "tests", "recipes", "benchmarks", "pyproject.toml")
IGNORED = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", "results", "_build")
FAILED = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)
QUICK = "not slow"


@dataclass
class Outcome:
    name: str
    file: str
    what: str
    killed: bool
    by: str  # the test that failed first ("timeout", or "" for a survivor)
    seconds: float
    tests: int  # test items selected
    matrix_killed: bool | None = None  # killed by the matrix alone (asked for reference kills only)
    matrix_seconds: float | None = None
    survives: str = ""
    output_tail: str = field(default="", repr=False)

    @property
    def by_reference(self) -> bool:
        return self.killed and self.by.startswith(REFERENCE)


def copy_repository(dest: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=IGNORED)
        else:
            shutil.copy2(src, dest / name)


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import(copy: Path, env: dict[str, str]) -> None:
    """Python started in the copy imports the copy's package, not the checkout's (editable install)."""
    out = subprocess.run(
        [sys.executable, "-c", "import lightning_commstrats; print(lightning_commstrats.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy at {copy} imports lightning_commstrats from {out}, not from the copy")
    print(f"the copy imports {out}")


def collect(copy: Path, env: dict[str, str], entries: list[str], marker: str | None) -> list[str]:
    """The test ids pytest collects from ``entries`` in the copy (``marker``: a ``-m`` expression)."""
    if not entries:
        return []
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *entries]
    if marker:
        cmd[4:4] = ["-m", marker]
    done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"collecting {entries} failed (rc {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


class Selection:
    """Each zoo entry (a file: its quick tests; a node id: as named) as the test ids pytest collects."""

    def __init__(self, copy: Path, env: dict[str, str], mutants: list[Mutant]) -> None:
        entries = list(dict.fromkeys(e for m in mutants for e in plan(m)))
        files = [e for e in entries if "::" not in e]
        nodes = [e for e in entries if "::" in e]
        quick = collect(copy, env, files, QUICK)
        self.ids: dict[str, list[str]] = {f: [i for i in quick if i.split("::")[0] == f] for f in files}
        for f, ids in self.ids.items():
            if not ids:
                raise SystemExit(f"{f} holds no quick test: name its tests by node id in the zoo")
        named = collect(copy, env, nodes, None)
        for node in nodes:
            self.ids[node] = [i for i in named if i == node or i.startswith(node + "[")]
            if not self.ids[node]:
                raise SystemExit(f"{node} collects no test")

    def of(self, mutant: Mutant) -> list[str]:
        return list(dict.fromkeys(i for e in plan(mutant) for i in self.ids[e]))

    def matrix(self) -> list[str]:
        return self.ids[MATRIX]


def plan(mutant: Mutant) -> list[str]:
    """What runs against ``mutant``, in order: the reference first for the schemes it replays, the
    mutant's own tests, the reference otherwise after them, the quick matrix cases last."""
    own = [t for t in mutant.tests if t not in (REFERENCE, MATRIX)]
    order = [REFERENCE, *own] if mutant.reference_first else [*own, REFERENCE]
    return list(dict.fromkeys([*order, MATRIX]))


def run_pytest(copy: Path, env: dict[str, str], ids: list[str], timeout: float) -> tuple[int | None, str, float]:
    """``pytest -x`` on ``ids`` in the copy: (exit code, or None on timeout; output; seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *ids]
    began = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the test run and every rank it started
        out, _ = proc.communicate()
        rc = None
    return rc, out, time.perf_counter() - began


def first_failure(out: str) -> str:
    """The first test that failed; an error (in a fixture: the ranks' run itself) is marked so."""
    found = FAILED.search(out)
    if found is None:
        return "(no test named: see the output)"
    kind, test = found.groups()
    return test if kind == "FAILED" else f"{test} (error)"


class Applied:
    """``mutant`` written into the copy's file for the ``with`` block, the original put back after."""

    def __init__(self, copy: Path, mutant: Mutant) -> None:
        self.path = copy / mutant.file
        self.mutant = mutant
        self.original = self.path.read_text()

    def _write(self, text: str) -> None:
        self.path.write_text(text)
        # the source changes in place, maybe within a second and at the same size: no stale bytecode
        for cached in (self.path.parent / "__pycache__").glob(f"{self.path.stem}.*.pyc"):
            cached.unlink()

    def __enter__(self) -> Applied:
        self._write(self.mutant.apply(self.original))  # ValueError unless the original occurs once
        return self

    def __exit__(self, *exc: object) -> None:
        self._write(self.original)


def run_mutant(copy: Path, env: dict[str, str], mutant: Mutant, ids: list[str], timeout: float) -> Outcome:
    with Applied(copy, mutant):
        rc, out, seconds = run_pytest(copy, env, ids, timeout)
    if rc in (4, 5):  # usage error, nothing collected: the runner's fault, not a kill
        raise SystemExit(f"mutant {mutant.name}: pytest exited {rc}:\n{out[-3000:]}")
    killed = rc != 0
    by = "timeout" if rc is None else first_failure(out) if killed else ""
    return Outcome(
        mutant.name,
        mutant.file,
        mutant.what,
        killed,
        by,
        round(seconds, 1),
        len(ids),
        survives=mutant.survives,
        output_tail=out[-4000:],
    )


def write_results(out_dir: Path, outcomes: list[Outcome], times: dict[str, float], subset: bool) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    killed = [o for o in outcomes if o.killed]
    survivors = [o for o in outcomes if not o.killed]
    rate = len(killed) / len(outcomes) if outcomes else 0.0
    reference_only = [o for o in outcomes if o.by_reference and o.matrix_killed is False]
    total = sum(times.values())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = {
        "date": stamp,
        "subset": subset,
        "mutants": len(outcomes),
        "killed": len(killed),
        "kill_rate": rate,
        "seconds": {k: round(v, 1) for k, v in times.items()},
        "outcomes": [{k: v for k, v in asdict(o).items() if k != "output_tail"} for o in outcomes],
        "survivor_outputs": {o.name: o.output_tail for o in survivors},
        # the kills that were not a test's assertion: an error (the ranks' run itself failed), a timeout
        "error_outputs": {o.name: o.output_tail for o in killed if o.by == "timeout" or o.by.endswith("(error)")},
    }
    (out_dir / "results.json").write_text(json.dumps(data, indent=1) + "\n")

    lines = [
        "# Mutants the suite must kill",
        "",
        "<!-- results -->",
        "",
        f"`make mutants` (`tests/mutants/run.py`), {stamp}: **{len(outcomes)} mutants, {len(killed)} killed"
        f" ({rate:.1%})**, {len(survivors)} survived. Time: {total / 60:.1f} min in all (the unmutated copy's"
        f" tests {times.get('baseline', 0):.0f} s, the mutants {times.get('mutants', 0):.0f} s, the matrix"
        f" alone against the reference's kills {times.get('matrix', 0):.0f} s), on two shared CPU cores.",
        "",
        "| # | mutant | file | the mistake | killed by | s | matrix alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, o in enumerate(outcomes, 1):
        by = f"`{o.by}`" if o.killed else "**survived**"
        matrix = {None: "", True: "killed", False: "**survived**"}[o.matrix_killed]
        short = o.file.removeprefix("lightning_commstrats/")
        lines.append(f"| {i} | `{o.name}` | `{short}` | {o.what} | {by} | {o.seconds:.0f} | {matrix} |")
    lines += ["", "Survivors:", ""]
    lines += [f"- `{o.name}`: {o.survives or 'UNEXPLAINED'}" for o in survivors] or ["- none"]
    lines += ["", "Killed by the reference and not by the quick matrix cases alone:", ""]
    lines += [f"- `{o.name}`: {o.what}" for o in reference_only] or ["- none"]
    lines.append("")
    path = out_dir / "results.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run these mutants (names) only")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's test run (default 900)")
    parser.add_argument("--no-matrix", action="store_true", help="skip the matrix-alone pass over reference kills")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated copy's run (not for a report)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where results.md and .json go")
    parser.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    args = parser.parse_args(argv)

    mutants = list(ZOO)
    if args.only:
        unknown = set(args.only) - {m.name for m in ZOO}
        if unknown:
            parser.error(f"no such mutants: {sorted(unknown)}")
        mutants = [m for m in ZOO if m.name in args.only]
    for m in mutants:  # every mutant applies to the checkout as it is, before anything runs
        m.apply((ROOT / m.file).read_text())

    began = time.perf_counter()
    copy = Path(tempfile.mkdtemp(prefix="commstrats-mutants-"))
    times: dict[str, float] = {}
    try:
        copy_repository(copy)
        env = environment(copy)
        check_import(copy, env)
        selection = Selection(copy, env, mutants)
        times["setup"] = time.perf_counter() - began

        if not args.no_baseline:
            union = list(dict.fromkeys(i for m in mutants for i in selection.of(m)))
            print(f"the unmutated copy: {len(union)} tests ...", flush=True)
            rc, out, seconds = run_pytest(copy, env, union, args.timeout * 2)
            times["baseline"] = seconds
            if rc != 0:
                print(out[-6000:])
                raise SystemExit(f"the unmutated copy fails its tests (rc {rc}): no mutant can be judged")
            print(f"  all {len(union)} pass ({seconds:.0f} s)", flush=True)

        outcomes: list[Outcome] = []
        t0 = time.perf_counter()
        for n, mutant in enumerate(mutants, 1):
            ids = selection.of(mutant)
            outcome = run_mutant(copy, env, mutant, ids, args.timeout)
            outcomes.append(outcome)
            verdict = f"killed by {outcome.by}" if outcome.killed else "SURVIVED"
            print(f"[{n}/{len(mutants)}] {mutant.name}: {verdict} ({outcome.seconds:.0f} s)", flush=True)
        times["mutants"] = time.perf_counter() - t0

        if not args.no_matrix:
            t0 = time.perf_counter()
            for outcome in outcomes:
                if not outcome.by_reference:
                    continue
                mutant = next(m for m in mutants if m.name == outcome.name)
                with Applied(copy, mutant):
                    rc, _, seconds = run_pytest(copy, env, selection.matrix(), args.timeout)
                outcome.matrix_killed, outcome.matrix_seconds = rc != 0, round(seconds, 1)
                say = "killed" if outcome.matrix_killed else "survived"
                print(f"  matrix alone, {outcome.name}: {say} ({seconds:.0f} s)", flush=True)
            times["matrix"] = time.perf_counter() - t0
    finally:
        if args.keep:
            print(f"the copy stays at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)

    path = write_results(args.out, outcomes, times, subset=bool(args.only))
    killed = sum(o.killed for o in outcomes)
    total = time.perf_counter() - began
    print(f"\n{killed}/{len(outcomes)} mutants killed ({killed / len(outcomes):.1%}) in {total / 60:.1f} min; {path}")
    for o in outcomes:
        if not o.killed:
            print(f"  survived: {o.name}: {o.survives or 'UNEXPLAINED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
