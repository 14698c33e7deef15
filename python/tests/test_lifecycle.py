"""Open, use, close, reopen: answers are kept; the file checks healthy; the reports are the
library's; 0.1.7's file imports; an engine's KV events are applied."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, List

import numpy as np
import numpy.typing as npt
import pytest

import superfluid_warm as sw

REPO = Path(__file__).resolve().parents[2]


def test_reopen_after_close_keeps_every_answer(tmp_path: Path, prompts: List[npt.NDArray[np.uint32]]) -> None:
    path = tmp_path / "w.redb"
    some = prompts[:300]
    with sw.Warm.open(path, capacity=1 << 16, sync_window_ms=5) as warm:
        assert not warm.closed and warm.path == str(path)
        for i, prompt in enumerate(some):
            warm.ran("m", prompt, f"node-{i % 8}")
        before = [warm.warmest("m", p) for p in some]
        lists = [warm.warm_nodes("m", p) for p in some[:50]]
        stats = warm.stats()
    assert warm.closed and "closed" in repr(warm)
    assert stats.capacity == 1 << 16 and stats.clock == len(some) and stats.entries > 0
    assert {n.name for n in stats.nodes} == {f"node-{i}" for i in range(8)}
    healthy = sw.check_file(path)
    assert healthy.healthy and healthy.problems == () and healthy.integrity is True
    assert not healthy.crashed_writer and healthy.entries == stats.entries
    with sw.Warm.open(path) as again:
        assert [again.warmest("m", p) for p in some] == before
        assert [again.warm_nodes("m", p) for p in some[:50]] == lists
        reopened = again.stats()
        assert reopened.capacity == 1 << 16, "the capacity is recorded in the file"
        assert reopened.open_check == "seal" and reopened.recovered_from is None
        assert reopened.entries == stats.entries
    # A reader answers as the head did, without a head.
    with sw.Reader.open(path) as reader:
        assert [reader.warmest("m", p) for p in some] == before
        assert reader.warm_nodes_prefix(reader.prefix("m", some[0])) == lists[0]
    assert reader.closed
    with pytest.raises(sw.ClosedError):
        reader.warmest("m", some[0])


def test_forget_and_node_caches(tmp_path: Path, prompts: List[npt.NDArray[np.uint32]]) -> None:
    with sw.Warm.open(tmp_path / "w.redb", node_cache_blocks=1000) as warm:
        warm.ran("m", prompts[0], "node-a")
        warm.ran("m", prompts[0], "node-b")
        assert [h.node for h in warm.warm_nodes("m", prompts[0])] == ["node-b", "node-a"]
        warm.forget_node("node-b")
        warm.forget_node("never-seen")
        assert warm.warmest("m", prompts[0]) == sw.Hit("node-a", len(prompts[0]) // 64 * 64)
        stats = warm.stats()
        assert [(n.name, n.forgotten) for n in stats.nodes] == [("node-a", False), ("node-b", True)]
        warm.set_node_capacity("node-a", 2)
        caches = {c.node: c for c in warm.stats().node_caches}
        assert caches["node-a"].capacity == 2 and caches["node-a"].held <= 2
        hit = warm.warmest("m", prompts[0])
        assert hit is None or hit.tokens <= 128
        warm.set_node_capacity("node-a", None)
        warm.set_node_cache_default(None)
        assert all(c.capacity is None for c in warm.stats().node_caches)


def test_sync_window_zero_commits_every_ran(tmp_path: Path) -> None:
    with sw.Warm.open(tmp_path / "w.redb", sync_window_ms=0) as warm:
        warm.ran("m", list(range(256)), "node")
        assert warm.stats().pending is False
        warm.sync()


def test_the_0_1_7_file_imports_with_every_answer(tmp_path: Path) -> None:
    fixture = REPO / "migrations" / "0001-from-0.1.7-json"
    with sw.Warm.open(tmp_path / "w.redb") as warm:
        report = warm.import_json(fixture / "warm.json")
        assert report.imported == report.in_file > 0 and not report.already_imported
        assert warm.import_json(fixture / "warm.json").already_imported
        queries = [json.loads(line) for line in (fixture / "queries.jsonl").read_text().splitlines() if line]
        assert len(queries) == 400
        for q in queries:
            want = q["answer"]
            got = warm.warmest(q["model"], q["tokens"])
            assert got == (sw.Hit(want["node"], want["tokens"]) if want else None)
        assert warm.stats().legacy_entries == report.imported


# --- engine events: a minimal msgpack writer for vLLM's batch `[ts, events, dp_rank]` ---


def pack(value: Any) -> bytes:
    """msgpack of None, bool, int >= 0, float, str, list (what a KV event batch holds)."""
    if value is None:
        return b"\xc0"
    if isinstance(value, bool):
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        return b"\xcf" + struct.pack(">Q", value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        raw = value.encode()
        return b"\xd9" + bytes([len(raw)]) + raw
    if isinstance(value, list):
        return b"\xdd" + struct.pack(">I", len(value)) + b"".join(pack(v) for v in value)
    raise TypeError(type(value))


def stored(hashes: List[int], parent: Any, tokens: List[int], block_size: int) -> List[Any]:
    return ["BlockStored", hashes, parent, tokens, block_size]


def test_engine_events_make_the_engine_the_source_of_truth(tmp_path: Path) -> None:
    prompt = list(range(1000, 1256))  # 16 engine blocks of 16 tokens: 4 blocks of the index
    hashes = list(range(1, 17))
    first = pack([1700000000.0, [stored(hashes, None, prompt, 16)], 0])
    with sw.Warm.open(tmp_path / "w.redb") as warm:
        outcome = warm.engine_payload("gpu-0", 0, first, "m")
        assert outcome == sw.EngineOutcome("applied") and outcome.applied
        assert warm.warmest("m", prompt) == sw.Hit("gpu-0", 256)
        assert warm.engine_payload("gpu-0", 0, bytearray(first), "m").kind == "duplicate"
        gap = warm.engine_payload("gpu-0", 5, pack([1700000001.0, [], 0]), "m")
        assert gap.gap and gap.replay_from == 0
        # The engine evicts the last 8 blocks: it holds 128 tokens of the prompt.
        removed = sw.decode_engine_batch(1, memoryview(pack([1700000002.0, [["BlockRemoved", hashes[8:]]], 0])), "m")
        assert (removed.seq, len(removed)) == (1, 1)
        assert warm.engine_batch("gpu-0", removed).applied
        assert warm.warmest("m", prompt) == sw.Hit("gpu-0", 128)
        [stats] = warm.engine_stats()
        assert (stats.node, stats.last_seq, stats.engine_blocks, stats.blocks) == ("gpu-0", 1, 8, 2)
        assert stats.counts.batches == 2 and stats.counts.gaps == 1 and stats.counts.removed == 8
        # No replay covers the gap: the node starts again from a later batch.
        warm.engine_resync("gpu-0", sw.decode_engine_batch(9, pack([1700000003.0, [["AllBlocksCleared"]], 0]), "m"))
        assert warm.warmest("m", prompt) is None
        assert warm.engine_stats()[0].last_seq == 9


def test_a_hybrid_engine_is_answered_what_every_group_holds(tmp_path: Path) -> None:
    # gpt-oss's layout: a sliding window of 128 tokens (group 0) beside full attention (group 1).
    # The window keeps only the last 8 blocks of the 16; a prompt that extends this one reuses
    # all 256 tokens (the full group holds them, the window its last 8 blocks).
    prompt = list(range(1000, 1256))
    hashes = list(range(1, 17))

    def in_group(hashes: List[int], group: int, kind: str, window: Any) -> List[Any]:
        return ["BlockStored", hashes, None, prompt, 16, None, "GPU", None, None, group, kind, window]

    step = [in_group(hashes[8:], 0, "sliding_window", 128), in_group(hashes, 1, "full_attention", None)]
    longer = prompt + list(range(5000, 5040))
    with sw.Warm.open(tmp_path / "w.redb") as warm:
        assert warm.engine_payload("gpu-0", 0, pack([1700000000.0, step, 0]), "m").applied
        assert warm.warmest("m", longer) == sw.Hit("gpu-0", 256)
        [stats] = warm.engine_stats()
        assert stats.groups == ((0, "sliding_window", 128), (1, "full", None))
        assert (stats.engine_blocks, stats.unplaced_blocks, stats.group_changes) == (16, 0, 0)
        # The window's copy of the last block goes: no run of 8 before the end, none from the
        # first block: vLLM would reuse nothing, and nothing is claimed.
        removed = pack([1700000001.0, [["BlockRemoved", [16], "GPU", 0]], 0])
        assert warm.engine_payload("gpu-0", 1, removed, "m").applied
        assert warm.warmest("m", longer) is None


def test_an_offloaded_prefix_is_answered_with_its_tier(tmp_path: Path) -> None:
    prompt = list(range(1000, 1256))
    hashes = list(range(1, 17))
    with sw.Warm.open(tmp_path / "w.redb") as warm:
        assert warm.engine_payload("gpu-0", 0, pack([1.0, [stored(hashes, None, prompt, 16)], 0]), "m").applied
        # An offloading connector copies the last 8 engine blocks to CPU memory (a store without
        # tokens), then the GPU drops them: 128 tokens stay on the GPU, 256 are loadable.
        offload = ["BlockStored", hashes[8:], hashes[7], [], 16, None, "CPU"]
        assert warm.engine_payload("gpu-0", 1, pack([2.0, [offload], 0]), "m").applied
        assert warm.warmest("m", prompt) == sw.Hit("gpu-0", 256, "gpu", 256)
        assert warm.engine_payload("gpu-0", 2, pack([3.0, [["BlockRemoved", hashes[8:], "GPU"]], 0]), "m").applied
        assert warm.warmest("m", prompt) == sw.Hit("gpu-0", 256, "cpu", 128)
        assert warm.warm_nodes("m", prompt) == [sw.Hit("gpu-0", 256, "cpu", 128)]
        [stats] = warm.engine_stats()
        assert stats.by_tier == (8, 8, 0) and stats.engine_blocks == 16


def test_a_listeners_status_reads_as_the_librarys_type(tmp_path: Path) -> None:
    path = tmp_path / "w.redb"
    assert sw.listen_status(path) is None, "no listener wrote one"
    status = tmp_path / "w.redb.listen.json"
    # What `superfluid-warm listen` writes as it stops (its fields; tests/listen.rs reads a real one).
    engine: dict[str, Any] = {
        "node": "gpu-0", "connected": False, "received": 12, "undecodable": 0, "malformed": 1, "replays": 2,
        "replays_short": 0, "replays_skipped": 0, "replaying": False, "replay_backoff_s": None, "dropped": 0,
        "lag_p50_ms": 1.5, "lag_p99_ms": 9.0, "silent_for_s": 0.2, "error": None,
    }
    written = {"pid": 1, "running": False, "written_at": 0.0, "refresh_s": 10.0, "error": "the file was deleted",
               "sharing": None, "engines": [engine]}
    status.write_text(json.dumps(written))
    read = sw.listen_status(path)
    assert isinstance(read, sw.ListenStatus)
    assert read.error == "the file was deleted" and not read.running and read.sharing is None
    assert read.down is not None and read.down.startswith("stopped")
    assert read.engines == (sw.EngineStatus(**engine),)
    status.write_text("{")
    with pytest.raises(sw.IndexFileError, match="status file"):
        sw.listen_status(path)
