"""``commstrats-lighthouse``: where it listens (the loopback interface unless ``--bind`` says
otherwise, the run store at the same address as the Lighthouse), and how it stops."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from harness import _base_env

from lightning_commstrats.fault_tolerance import (
    LIGHTHOUSE_BIND,
    TORCHFT_AVAILABLE,
    RunStore,
    bind_host,
    lighthouse_main,
    lighthouse_parser,
    listen_socket,
)


def test_the_default_is_the_loopback_interface():
    assert LIGHTHOUSE_BIND == "127.0.0.1"
    assert lighthouse_parser().parse_args([]).bind == "127.0.0.1"
    assert lighthouse_parser().parse_args(["--bind", "0.0.0.0"]).bind == "0.0.0.0"
    assert "default 127.0.0.1" in " ".join(lighthouse_parser().format_help().split())


@pytest.mark.parametrize(
    ("value", "host"),
    [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0"), ("[::]", "::"), ("::", "::"), ("::1", "::1"), ("h", "h")],
)
def test_bind_takes_an_address(value, host):
    assert bind_host(value) == host


@pytest.mark.parametrize(("value", "message"), [("1.2.3.4:5", "without a port"), ("", "give an address")])
def test_bind_refuses_a_port_or_nothing(value, message):
    with pytest.raises(ValueError, match=message):
        bind_host(value)


def test_a_bad_bind_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        lighthouse_main(["--bind", "10.0.0.1:29510"])
    assert exit_info.value.code == 2
    assert "--bind '10.0.0.1:29510': give the address without a port" in capsys.readouterr().err


def test_the_store_socket_listens_where_it_is_told():
    with listen_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    with listen_socket("0.0.0.0", 0) as sock:
        assert sock.getsockname()[0] == "0.0.0.0"


def listening(port: int) -> set[str]:
    """The local addresses with a TCP socket listening at ``port`` (Linux's /proc/net/tcp)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                if len(address) == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
                else:  # four little-endian 32-bit words
                    words = bytes.fromhex(address)
                    raw = b"".join(words[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, raw))
    return found


@pytest.mark.skipif(not TORCHFT_AVAILABLE, reason="needs torchft")
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's table of sockets")
@pytest.mark.parametrize(("bind", "expected"), [([], {"127.0.0.1"}), (["--bind", "0.0.0.0"], {"0.0.0.0"})])
def test_the_lighthouse_and_its_store_listen_at_the_bind_address_and_stop_on_sigterm(bind, expected):
    from torch.distributed import TCPStore

    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from lightning_commstrats.fault_tolerance import lighthouse_main; sys.exit(lighthouse_main())",
            "--port",
            "0",
            *bind,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_base_env(),
    )
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 60
        while "listening at" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "listening at" in line, line
        port = int(line.split("listening at ")[1].split()[0].rsplit(":", 1)[1])
        assert f"run store at port {port + 1}" in line
        if not bind:  # an address replicas can use as it is printed, not this machine's name
            assert f"listening at http://127.0.0.1:{port} " in line
        assert listening(port) == expected
        assert listening(port + 1) == expected
        store = TCPStore("127.0.0.1", port + 1, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
        assert store.get(RunStore.JOIN_TIMEOUT_KEY) == b"5000"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
