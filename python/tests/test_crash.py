"""A head killed with SIGKILL while it writes: the file checks whole (only the recovery is
pending), the next open recovers it, and every `ran` the child had seen acknowledged as
durable is answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import numpy as np
import pytest

import superfluid_warm as sw

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import superfluid_warm as sw

    path, window, every, start = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    warm = sw.Warm.open(path, sync_window_ms=window)
    print("open", flush=True)
    i = start
    while True:
        # Request i: its own prompt (2 to 6 blocks, no prefix shared with another request).
        warm.ran("m", np.arange(i * 1000, i * 1000 + 64 * (2 + i % 5), dtype=np.uint32), f"node-{i % 7}")
        i += 1
        if i % every == 0:
            warm.sync()
            # Every ran below i returned before this sync: durable.
            print(i, flush=True)
    """
)


def prompt(i: int) -> "np.ndarray":
    return np.arange(i * 1000, i * 1000 + 64 * (2 + i % 5), dtype=np.uint32)


def run_and_kill(path: Path, window: float, every: int, start: int, acks: int) -> int:
    """Starts a child writing from request ``start``, kills it with SIGKILL once it has
    acknowledged ``acks`` more requests (at a moment of its loop left to chance); returns the
    last count it acknowledged."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(window), str(every), str(start)],
        stdout=subprocess.PIPE,
        text=True,
        # Not the package's source folder: the child imports the package the tests import.
        cwd=path.parent,
    )
    assert child.stdout is not None
    acknowledged = start
    try:
        assert child.stdout.readline().strip() == "open"
        deadline = time.monotonic() + 60
        while acknowledged < start + acks and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            acknowledged = int(line)
        # Mid-write: the child goes on between our last read and the kill.
        time.sleep(float(np.random.default_rng(acknowledged).uniform(0, 0.02)))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        # What it printed before the kill was acknowledged too.
        for line in child.stdout.read().split():
            acknowledged = max(acknowledged, int(line))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert acknowledged >= start + acks, "the child acknowledged enough before the kill"
    return acknowledged


@pytest.mark.parametrize("window, every", [(50.0, 7), (0.0, 1)])
def test_a_killed_head_loses_no_acknowledged_ran(tmp_path: Path, window: float, every: int) -> None:
    path = tmp_path / "w.redb"
    acknowledged = 0
    pids: List[int] = []
    for _round in range(3):
        acknowledged = run_and_kill(path, window, every, start=acknowledged, acks=300)
        found = sw.check_file(path)
        assert found.integrity is True, found.problems
        assert found.crashed_writer, "the kill left the file open"
        assert len(found.problems) == 1 and "crashed" in found.problems[0], found.problems
        with sw.Warm.open(path) as warm:
            stats = warm.stats()
            assert stats.recovered_from is not None
            pids.append(stats.recovered_from)
            assert stats.clock >= acknowledged
            for i in range(acknowledged):
                want = sw.Hit(f"node-{i % 7}", 64 * (2 + i % 5))
                assert warm.warmest("m", prompt(i)) == want, f"request {i} of {acknowledged} acknowledged"
        assert sw.check_file(path).healthy, "a clean close after the recovery"
    assert len(set(pids)) == 3
