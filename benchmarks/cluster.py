"""An emulated cluster on one machine: hosts as Linux network namespaces on a rate-limited star.

Every host is a network namespace with one interface ``eth0`` and its own address in
198.18.0.0/24 (the range set aside for network benchmarks, RFC 2544); a further namespace holds a
bridge, the switch. Each host's link is a veth pair whose two ends are shaped with ``tc ... tbf``,
so a host sends and receives at most ``rate`` (netem is not available here: there is no added
delay, only bandwidth). Links can differ per host, and hosts can be grouped: hosts of one group
talk through their own switch at the fast rate, and the groups' switches are joined by an uplink
at another rate (a pruned fat-tree in miniature).

Only addresses assigned here, inside namespaces created here, are used. Everything is removed on
exit, on Ctrl-C, on SIGTERM and on errors; ``python benchmarks/cluster.py cleanup`` removes what
a killed run left behind. Without root or permission for ``ip netns``, :class:`ClusterUnavailable`
says why, and callers fall back to loopback (and say so).

    python benchmarks/cluster.py demo --hosts 2 --rate 100   # create, measure a transfer, remove
    python benchmarks/cluster.py cleanup
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

PREFIX = "cstrat"
SUBNET = "198.18.0"


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no ``ip``, or not permitted)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The namespaces whose name starts with ``prefix-``."""
    try:
        out = _ip("netns", "list", check=False).stdout
    except FileNotFoundError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace of ``prefix`` (their veth ends and qdiscs go with them)."""
    removed = []
    for ns in namespaces(prefix):
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
    return removed


def check_available() -> None:
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces need root; this process is not root")
    probe = f"{PREFIX}-probe{os.getpid()}"
    try:
        result = _ip("netns", "add", probe, check=False)
    except FileNotFoundError as err:
        raise ClusterUnavailable("the `ip` command (iproute2) is not installed") from err
    if result.returncode != 0:
        raise ClusterUnavailable(f"`ip netns add` is not permitted here: {result.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def _tbf(ns: str, dev: str, rate_mbit: float) -> None:
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(int(rate_bytes / 100), 16_000)  # 10 ms of traffic, at least a few full frames
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit}mbit",
            "burst",
            str(burst),
            "latency",
            "100ms",
        ],
        check=True,
        capture_output=True,
        text=True,
    )


class EmulatedCluster:
    """``hosts`` namespaces on a star of rate-limited links, optionally in groups joined by an uplink.

    Args:
        hosts: number of hosts (one rank each).
        rate_mbit: each host's link rate in Mbit/s (both directions).
        groups: number of groups of consecutive hosts, each with its own switch; the switches are
            joined through a core switch by uplinks of ``uplink_mbit``.
        uplink_mbit: rate of each group's uplink (default: ``rate_mbit``).
        prefix: name prefix of everything created.
    """

    def __init__(
        self,
        hosts: int,
        rate_mbit: float,
        groups: int = 1,
        uplink_mbit: float | None = None,
        prefix: str = PREFIX,
    ) -> None:
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        if groups < 1 or hosts % groups:
            raise ValueError(f"groups must divide hosts, got {groups} groups for {hosts} hosts")
        self.hosts = hosts
        self.rate_mbit = rate_mbit
        self.groups = groups
        self.uplink_mbit = uplink_mbit or rate_mbit
        self.prefix = prefix
        self._up = False
        self._previous_handlers: dict[int, object] = {}

    def host_ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> EmulatedCluster:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        check_available()
        cleanup(self.prefix)  # a previous run that was killed hard
        atexit.register(self.destroy)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise

    def _on_signal(self, signum: int, frame: object) -> None:
        self.destroy()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)  # type: ignore[operator]
        raise SystemExit(128 + signum)

    def destroy(self) -> None:
        if not self._up:
            return
        self._up = False
        cleanup(self.prefix)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous_handlers.clear()

    def _switch(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", ns, "link", "set", "br0", "up")
        return ns

    def _wire(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str, rate_mbit: float) -> None:
        """A veth pair between two namespaces, each end shaped to ``rate_mbit`` on egress."""
        tmp_a, tmp_b = f"{self.prefix}{os.getpid() % 10000}a", f"{self.prefix}{os.getpid() % 10000}b"
        _ip("link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        _ip("link", "set", tmp_a, "netns", ns_a)
        _ip("link", "set", tmp_b, "netns", ns_b)
        _ip("-n", ns_a, "link", "set", tmp_a, "name", dev_a)
        _ip("-n", ns_b, "link", "set", tmp_b, "name", dev_b)
        _ip("-n", ns_a, "link", "set", dev_a, "up")
        _ip("-n", ns_b, "link", "set", dev_b, "up")
        _tbf(ns_a, dev_a, rate_mbit)
        _tbf(ns_b, dev_b, rate_mbit)

    def _build(self) -> None:
        per_group = self.hosts // self.groups
        switches = [self._switch(f"sw{g}") for g in range(self.groups)]
        if self.groups > 1:
            core = self._switch("core")
            for g, sw in enumerate(switches):
                self._wire(sw, "up0", core, f"g{g}", self.uplink_mbit)
                _ip("-n", sw, "link", "set", "up0", "master", "br0")
                _ip("-n", core, "link", "set", f"g{g}", "master", "br0")
        for i in range(self.hosts):
            ns = self.host_ns(i)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            sw = switches[i // per_group]
            self._wire(ns, "eth0", sw, f"p{i}", self.rate_mbit)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")

    # ------------------------------------------------------------------ using it

    def popen(self, i: int, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside host ``i``."""
        return subprocess.Popen(["ip", "netns", "exec", self.host_ns(i), *cmd], **kwargs)

    def tx_bytes(self, i: int) -> int:
        """Bytes sent so far by host ``i``'s interface (the kernel's counter)."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.host_ns(i), "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout)

    def uplink_tx_bytes(self, group: int) -> int:
        """Bytes that left group ``group`` through its uplink so far (the kernel's counter of the
        group switch's uplink port): the traffic on the slow links out of that group."""
        out = subprocess.run(
            ["ip", "netns", "exec", f"{self.prefix}-sw{group}", "cat", "/sys/class/net/up0/statistics/tx_bytes"],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout)


@contextmanager
def cluster_or_loopback(
    loopback: bool,
    hosts: int,
    rate_mbit: float,
    groups: int = 1,
    uplink_mbit: float | None = None,
    prefix: str = PREFIX,
) -> Iterator[tuple[EmulatedCluster | None, str]]:
    """An :class:`EmulatedCluster` for the time of the ``with`` (removed after it), or None on loopback:
    when ``loopback`` asks for it, or when namespaces cannot be made here (said on stdout). Yields the
    cluster and where the runs run, in words, as the results record it."""
    if loopback:
        yield None, "loopback (no rate limit)"
        return
    cluster = EmulatedCluster(hosts, rate_mbit, groups, uplink_mbit, prefix)
    try:
        cluster.create()
    except ClusterUnavailable as err:
        print(f"emulated cluster unavailable ({err}); falling back to loopback", flush=True)
        yield None, f"loopback (no rate limit; emulated cluster unavailable: {err})"
        return
    where = f"emulated cluster, {rate_mbit:g} Mbit/s links"
    if groups > 1:
        where = (
            f"emulated cluster: groups of {hosts // groups} at {rate_mbit:g} Mbit/s,"
            f" uplinks at {cluster.uplink_mbit:g} Mbit/s"
        )
    try:
        yield cluster, where
    finally:
        cluster.destroy()


def _demo(hosts: int, rate: float, seconds: float) -> None:
    """Create a cluster, push data from host 1 to host 0 for a few seconds, report the rate, remove."""
    with EmulatedCluster(hosts, rate) as c:
        server = c.popen(0, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        before = c.tx_bytes(1)
        client = c.popen(1, [sys.executable, "-c", _SOURCE, c.address(0), str(seconds)])
        client.wait(timeout=seconds + 30)
        sent = c.tx_bytes(1) - before
        server.wait(timeout=10)
        print(
            f"{hosts} hosts at {rate} Mbit/s: host 1 sent {sent / 1e6:.2f} MB in {seconds:.1f}s"
            f" = {sent * 8 / seconds / 1e6:.1f} Mbit/s on the wire;"
            f" host 0 received {server.stdout.read().strip()} bytes"
        )
    print("namespaces left:", namespaces() or "none")


_SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 29999)); s.listen(1)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n)
"""

_SOURCE = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 29999)); end = time.time() + float(sys.argv[2]); buf = b"x" * (1 << 16)
while time.time() < end: s.sendall(buf)
s.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="create a cluster, measure one link, remove it")
    demo.add_argument("--hosts", type=int, default=2)
    demo.add_argument("--rate", type=float, default=100.0, help="Mbit/s")
    demo.add_argument("--seconds", type=float, default=3.0)
    hold = sub.add_parser("hold", help="create a cluster and keep it until interrupted or --seconds pass")
    hold.add_argument("--hosts", type=int, default=2)
    hold.add_argument("--rate", type=float, default=100.0, help="Mbit/s")
    hold.add_argument("--seconds", type=float, default=60.0)
    sub.add_parser("cleanup", help="remove every namespace of the prefix")
    parser.add_argument("--prefix", default=PREFIX, help=f"name prefix (default {PREFIX})")
    args = parser.parse_args()
    if args.cmd == "cleanup":
        print("removed:", cleanup(args.prefix) or "nothing")
    elif args.cmd == "hold":
        with EmulatedCluster(args.hosts, args.rate, prefix=args.prefix):
            print("ready:", " ".join(namespaces(args.prefix)), flush=True)
            time.sleep(args.seconds)
    else:
        _demo(args.hosts, args.rate, args.seconds)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
