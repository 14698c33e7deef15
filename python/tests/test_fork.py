"""A fork after ``Warm.open`` (``multiprocessing``'s default start method on Linux): the child's
copy of the handle raises ``ForkedError`` for every call and touches nothing of the parent's,
which goes on writing; the file stays healthy and keeps every write the parent acknowledged."""

from __future__ import annotations

import multiprocessing
import sys
import threading
from pathlib import Path
from typing import Any, Callable, List, Tuple

import numpy as np
import numpy.typing as npt
import pytest

import superfluid_warm as sw

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fork on Windows")

ROUNDS = 20
MODEL = "fork"


def prompt(i: int) -> npt.NDArray[np.uint32]:
    """Four blocks no other write uses."""
    tokens: npt.NDArray[np.uint32] = (np.arange(256, dtype=np.uint32) + np.uint32(i * 1009)) ^ np.uint32(i << 12)
    return tokens


def child(index: Any, queue: Any) -> None:
    """Every kind of call on the parent's handle, repeated; what each raised."""
    tokens = prompt(10**6)
    calls: List[Tuple[str, Callable[[], object]]] = [
        ("ran", lambda: index.ran(MODEL, tokens, "child")),
        ("sync", index.sync),
        ("warmest", lambda: index.warmest(MODEL, tokens)),
        ("warm_nodes", lambda: index.warm_nodes(MODEL, tokens)),
        ("stats", index.stats),
        ("forget_node", lambda: index.forget_node("child")),
        ("set_node_capacity", lambda: index.set_node_capacity("child", 16)),
        ("engine_stats", index.engine_stats),
        ("close", index.close),
    ]
    seen = set()
    for _ in range(20):
        for name, call in calls:
            try:
                call()
                seen.add(f"{name}: no error")
            except sw.ForkedError as e:
                seen.add(f"{name}: {e.kind}" if e.kind == "Forked" and "fork" in e.message else f"{name}: {e!r}")
            except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
                seen.add(f"{name}: {e!r}")
    queue.put(sorted(seen))


def test_a_forked_child_is_refused_and_the_parents_file_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "w.redb"
    ctx = multiprocessing.get_context("fork")
    acked: List[Tuple[int, str]] = []
    lock = threading.Lock()

    def write(warm: sw.Warm, node: str, first: int, count: int) -> None:
        done = []
        for i in range(first, first + count):
            warm.ran(MODEL, prompt(i), node)
            done.append((i, node))
            if len(done) % 4 == 0:
                warm.sync()
                with lock:
                    acked.extend(done[-4:])
        warm.sync()
        with lock:
            acked.extend(done[len(done) - len(done) % 4 :])

    # A short window: the commit thread is busy, holding the index's locks, when it forks.
    warm = sw.Warm.open(path, sync_window_ms=1)
    stop = threading.Event()

    def background() -> None:
        i = 500_000
        while not stop.is_set():
            write(warm, "parent-thread", i, 8)
            i += 8

    writer = threading.Thread(target=background)
    writer.start()
    try:
        for round_ in range(ROUNDS):
            queue = ctx.Queue()
            children = [ctx.Process(target=child, args=(warm, queue)) for _ in range(2)]
            for c in children:
                c.start()
            write(warm, f"parent-{round_}", round_ * 100, 40)
            results = [queue.get(timeout=60) for _ in children]
            for c in children:
                c.join(timeout=60)
                assert c.exitcode == 0, f"round {round_}: a child ended with {c.exitcode}"
            for seen in results:
                assert all(s.endswith(": Forked") for s in seen), f"round {round_}: {seen}"
    finally:
        stop.set()
        writer.join()
    assert not warm.closed, "the parent's handle is still open"
    assert "child" not in {n.name for n in warm.stats().nodes}, "the children wrote nothing"
    warm.close()

    check = sw.check_file(path)
    assert check.healthy and check.problems == () and check.integrity is True, check
    assert len(acked) > ROUNDS * 40
    with sw.Reader.open(path) as reader:
        for i, node in acked:
            hit = reader.warmest(MODEL, prompt(i))
            assert hit is not None and (hit.node, hit.tokens) == (node, 256), (i, node, hit)
    with sw.Warm.open(path) as again:
        assert again.stats().recovered_from is None, "closed cleanly"


def test_the_fork_hook_is_not_one_of_the_modules_names() -> None:
    assert not [n for n in dir(sw._native) if "fork" in n], "registered by the module, not exported"
