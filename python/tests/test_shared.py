"""SharedWarm (built with the `nats` feature): two heads share one view through a real NATS
JetStream server on a loopback port. Skipped without the feature or without `nats-server`
(`$NATS_SERVER`, the path, or Debian's /usr/sbin)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pytest

import superfluid_warm as sw


def nats_server() -> Optional[str]:
    for candidate in (os.environ.get("NATS_SERVER"), shutil.which("nats-server"), "/usr/sbin/nats-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


# CI sets SUPERFLUID_WARM_REQUIRE_NATS=1 where it built the nats feature and installed a
# server: there a skip would hide a missing piece, so it fails instead.
if os.environ.get("SUPERFLUID_WARM_REQUIRE_NATS") == "1":
    assert sw.HAS_NATS, "SUPERFLUID_WARM_REQUIRE_NATS=1 but the package was built without the nats feature"
    assert nats_server() is not None, "SUPERFLUID_WARM_REQUIRE_NATS=1 but no nats-server was found"

pytestmark = [
    pytest.mark.skipif(not sw.HAS_NATS, reason="built without the nats feature"),
    pytest.mark.skipif(nats_server() is None, reason="no nats-server"),
]


def start_server(store: Path) -> "tuple[subprocess.Popen[bytes], int]":
    """A JetStream server on a free port. A port free when asked may be taken before the server
    binds it (another test's server, or the Rust suite's beside this one): the server then exits
    at once, and another port is tried."""
    binary = nats_server()
    assert binary is not None
    for _ in range(10):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while server.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not listen"
                time.sleep(0.05)
        # What listens may be someone else's: ours is still running.
        time.sleep(0.1)
        if server.poll() is None:
            return server, port
        server.wait(timeout=10)
    raise AssertionError("nats-server found no free port in 10 tries")


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    server, port = start_server(tmp_path / "nats")
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_two_heads_share_one_view(tmp_path: Path, nats_url: str) -> None:
    tokens = np.arange(1000, 1512, dtype=np.uint32)
    with sw.SharedWarm.open(tmp_path / "a.redb", nats_url, "warm", "head-a") as a, sw.SharedWarm.open(
        tmp_path / "b.redb", nats_url, "warm", "head-b"
    ) as b:
        a.wait_ready(10.0)
        b.wait_ready(10.0)
        ticket = a.ran("m", tokens, "node-3")
        assert a.warmest("m", tokens) == sw.Hit("node-3", 512), "answered at once by its own head"
        assert b.wait_for(ticket, 10.0), "applied by the other head"
        assert b.warmest("m", tokens) == sw.Hit("node-3", 512)
        prefix = b.prefix("m", tokens.tolist(), tenant="t")
        assert b.wait_for(b.ran_prefix(prefix, "node-5"), 10.0)
        assert a.wait_for(b.ran_prefix(prefix, "node-6"), 10.0)
        assert a.warmest_prefix(a.prefix("m", tokens, tenant="t")) == sw.Hit("node-6", 512)
        a.sync()
        index, share = a.stats()
        assert index.entries > 0 and share.head == "head-a" and share.stream == "warm" and share.connected
        assert share.published >= 1 and a.share_stats().applied >= 1
        assert isinstance(b.lags_ns(), list)
        a.forget_node("node-3")
        assert a.warmest("m", tokens) is None
        assert b.wait_for(b.set_node_capacity("node-6", 100), 10.0)
    assert a.closed and b.closed


def test_sharing_settings_are_checked(tmp_path: Path, nats_url: str) -> None:
    with pytest.raises(sw.SharingError) as raised:
        sw.SharedWarm.open(tmp_path / "a.redb", "not a url", "warm", "head-a")
    assert raised.value.kind == "Sharing"
    with pytest.raises(sw.SharingError):
        sw.SharedWarm.open(tmp_path / "a.redb", nats_url, "bad stream name", "head-a")
    with pytest.raises(sw.InvalidInputError) as config:
        sw.SharedWarm.open(tmp_path / "a.redb", nats_url, "warm", "head-a", sync_window_ms=0)
    assert config.value.kind == "InvalidConfig"
