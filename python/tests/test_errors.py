"""Every failure is a Python exception: a WarmError subclass carrying the Rust error's kind and
message, or a TypeError/ValueError for token ids of the wrong type; never a crash."""

from __future__ import annotations

import array
import pickle
from pathlib import Path
from typing import Callable, List, Tuple

import numpy as np
import pytest

import superfluid_warm as sw

TOKENS = list(range(300))


@pytest.fixture
def warm(tmp_path: Path) -> "sw.Warm":
    return sw.Warm.open(tmp_path / "w.redb")


@pytest.mark.parametrize(
    "bad, named",
    [
        (np.arange(300), "'l'"),
        (np.arange(300, dtype=np.int32), "'i'"),
        (np.arange(300, dtype=np.uint64), "'L'"),
        (np.arange(300, dtype=np.float32), "'f'"),
        (np.arange(300, dtype=np.uint16), "'H'"),
        (np.arange(300, dtype=">u4"), "'>I'"),
        (np.arange(600, dtype=np.uint32).reshape(2, 300), "2 dimensions"),
        (np.uint32(7), "0 dimensions"),
        (np.arange(600, dtype=np.uint32)[::2], "C-contiguous"),
        (array.array("q", TOKENS), "'q'"),
        (array.array("d", [1.0]), "'d'"),
        (b"\x00\x01\x02\x03", "bytes"),
        (bytearray(8), "bytearray"),
        ("abc", "str"),
        (3, "int"),
        (None, "NoneType"),
        ([1, 2.5], "tokens[1] is a float"),
        (["1"], "tokens[0] is a str"),
    ],
)
def test_tokens_of_another_type_are_a_type_error(warm: sw.Warm, bad: object, named: str) -> None:
    for call in (
        lambda: warm.warmest("m", bad),  # type: ignore[arg-type]
        lambda: warm.warm_nodes("m", bad),  # type: ignore[arg-type]
        lambda: warm.ran("m", bad, "node"),  # type: ignore[arg-type]
        lambda: warm.prefix("m", bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError) as raised:
            call()
        assert named in str(raised.value)
    assert warm.stats().entries == 0


@pytest.mark.parametrize("bad", [[-1], [2**32], [0, 2**64], [np.int64(-3)]])
def test_ints_out_of_range_are_a_value_error(warm: sw.Warm, bad: list[int]) -> None:
    with pytest.raises(ValueError, match="not a token id"):
        warm.ran("m", bad, "node")


def test_bad_names_are_invalid_input_with_the_rust_kind(warm: sw.Warm) -> None:
    cases: List[Tuple[Callable[[], object], str]] = [
        (lambda: warm.warmest("", TOKENS), "model"),
        (lambda: warm.ran("m" * (sw.MAX_MODEL_BYTES + 1), TOKENS, "n"), "model"),
        (lambda: warm.ran("m", TOKENS, ""), "node"),
        (lambda: warm.ran("m", TOKENS, "n" * (sw.MAX_NODE_BYTES + 1)), "node"),
        (lambda: warm.ran("m", TOKENS, "n", tenant=""), "tenant"),
        (lambda: warm.warmest("m", TOKENS, tenant=b"t" * (sw.MAX_TENANT_BYTES + 1)), "tenant"),
        (lambda: warm.forget_node(""), "node"),
        (lambda: warm.set_node_capacity("", 10), "node"),
    ]
    for call, what in cases:
        with pytest.raises(sw.InvalidInputError) as raised:
            call()
        e = raised.value
        assert isinstance(e, sw.WarmError) and isinstance(e, ValueError)
        assert e.kind == "InvalidName" and what in e.message and str(e) == e.message
        assert e.needs_reopen is False
    assert warm.stats().entries == 0, "a refused call wrote nothing"


def test_settings_out_of_range_are_invalid_config(tmp_path: Path, warm: sw.Warm) -> None:
    for settings in [
        dict(capacity=0),
        dict(capacity=-5),
        dict(capacity=sw.MAX_CAPACITY + 1),
        dict(nodes_per_prefix=0),
        dict(nodes_per_prefix=sw.MAX_NODES_PER_PREFIX + 1),
        dict(node_cache_blocks=0),
        dict(sync_window_ms=-1.0),
        dict(sync_window_ms=float("nan")),
        dict(sync_window_ms=61_000.0),
        dict(cache_bytes=-1),
        dict(attention_chunk=-1),
    ]:
        with pytest.raises(sw.InvalidInputError) as raised:
            sw.Warm.open(tmp_path / "other.redb", **settings)  # type: ignore[arg-type]
        assert raised.value.kind == "InvalidConfig", settings
    for blocks in (0, -1, sw.MAX_CAPACITY + 1):
        with pytest.raises(sw.InvalidInputError) as raised:
            warm.set_node_capacity("node", blocks)
        assert raised.value.kind == "InvalidConfig"
    with pytest.raises(TypeError):
        warm.warmest("m", TOKENS, tenant=42)  # type: ignore[arg-type]


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs sysfs, which refuses even root a new file")
def test_a_folder_that_cannot_be_written_is_named_with_the_index() -> None:
    with pytest.raises(sw.IndexFileError) as raised:
        sw.Warm.open("/sys/superfluid-warm-test.redb")
    assert raised.value.kind == "NotWritable"
    assert "/sys/superfluid-warm-test.redb.seal" in raised.value.message and "Reader" in raised.value.message


def test_files_that_are_not_an_index_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.redb"
    junk.write_bytes(b"this is not a redb file at all" * 200)
    with pytest.raises(sw.IndexFileError) as raised:
        sw.Warm.open(junk)
    assert raised.value.kind == "UnknownFormat"
    assert junk.read_bytes() == b"this is not a redb file at all" * 200, "left as it is"
    with pytest.raises(sw.WarmError) as checked:
        sw.check_file(tmp_path / "missing.redb")
    assert checked.value.kind in ("Io", "UnknownFormat")
    with pytest.raises(sw.IndexFileError):
        sw.Reader.open(junk)
    directory = tmp_path / "a-directory"
    directory.mkdir()
    with pytest.raises(sw.WarmError):
        sw.Warm.open(directory)


def test_a_second_head_on_one_file_is_refused(tmp_path: Path) -> None:
    with sw.Warm.open(tmp_path / "w.redb"):
        with pytest.raises(sw.IndexFileError) as raised:
            sw.Warm.open(tmp_path / "w.redb")
        assert raised.value.kind == "AlreadyOpen"


def test_a_closed_index_raises_closed_error(warm: sw.Warm) -> None:
    warm.ran("m", TOKENS, "node")
    prefix = warm.prefix("m", TOKENS)
    warm.close()
    assert warm.closed
    warm.close()  # closing again does nothing
    for call in (
        lambda: warm.warmest("m", TOKENS),
        lambda: warm.warm_nodes("m", TOKENS),
        lambda: warm.ran("m", TOKENS, "node"),
        lambda: warm.prefix("m", TOKENS),
        lambda: warm.warmest_prefix(prefix),
        lambda: warm.ran_prefix(prefix, "node"),
        lambda: warm.sync(),
        lambda: warm.stats(),
        lambda: warm.forget_node("node"),
        lambda: warm.engine_stats(),
    ):
        with pytest.raises(sw.ClosedError) as raised:
            call()
        assert raised.value.kind == "Closed"
    # Bad tokens are refused before the index is looked at.
    with pytest.raises(TypeError):
        warm.warmest("m", "abc")  # type: ignore[arg-type]


def test_a_prefix_of_another_scheme_is_foreign(tmp_path: Path, warm: sw.Warm) -> None:
    # Two files of one build share a scheme: a prefix of one is good for the other.
    with sw.Warm.open(tmp_path / "other.redb") as other:
        prefix = other.prefix("m", TOKENS)
        assert warm.warmest_prefix(prefix) is None


def test_engine_garbage_is_an_engine_error(warm: sw.Warm) -> None:
    for payload in (b"", b"\x93\xc1", b"garbage", bytes(range(256))):
        with pytest.raises(sw.EngineError) as raised:
            warm.engine_payload("gpu-0", 0, payload, "m")
        assert raised.value.kind == "Engine"
        with pytest.raises(sw.EngineError):
            sw.decode_engine_batch(0, payload, "m")
    assert warm.engine_stats() == []


def test_errors_pickle_and_show_their_kind() -> None:
    e = sw.StorageError("disk full", "Storage", True)
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is sw.StorageError
    assert (again.kind, again.message, again.needs_reopen) == ("Storage", "disk full", True)
    assert "needs_reopen=True" in repr(e)
    assert issubclass(sw.InvalidInputError, ValueError)
    for cls in (sw.IndexFileError, sw.StorageError, sw.ClosedError, sw.EngineError, sw.SharingError):
        assert issubclass(cls, sw.WarmError)
    assert sw._errors._from_rust("SomethingNew", "m", False).__class__ is sw.WarmError


def test_a_panic_in_rust_is_a_warm_error() -> None:
    with pytest.raises(sw.WarmError) as raised:
        sw._native._panic("on purpose")
    assert type(raised.value) is sw.WarmError and raised.value.kind == "Panic"
    assert "on purpose" in raised.value.message


@pytest.mark.parametrize("huge", [2**64, 2**70, 2**200, -(2**70)])
def test_ints_of_any_size_are_refused_as_warm_errors_not_overflow(tmp_path: Path, huge: int) -> None:
    path = tmp_path / "w.redb"
    settings: List[Callable[[], sw.Warm]] = [
        lambda: sw.Warm.open(path, capacity=huge),
        lambda: sw.Warm.open(path, nodes_per_prefix=huge),
        lambda: sw.Warm.open(path, node_cache_blocks=huge),
    ]
    for setting in settings:
        with pytest.raises(sw.InvalidInputError) as raised:
            setting()
        assert raised.value.kind == "InvalidConfig"
    # Any cache size is a size (a negative one is refused): no OverflowError either way.
    if huge < 0:
        with pytest.raises(sw.InvalidInputError):
            sw.Warm.open(path, cache_bytes=huge)
    else:
        sw.Warm.open(path, cache_bytes=huge).close()
    with sw.Warm.open(path) as warm:
        warm.ran("m", TOKENS, "node")
        calls: List[Callable[[], object]] = [
            lambda: warm.set_node_capacity("node", huge),
            lambda: warm.set_node_cache_default(huge),
        ]
        for call in calls:
            with pytest.raises(sw.InvalidInputError) as raised:
                call()
            assert raised.value.kind == "InvalidConfig"
        for seq in (-1, huge):
            if 0 <= seq < 2**64:
                continue
            with pytest.raises(sw.EngineError) as engine:
                warm.engine_payload("node", seq, b"", "m")
            assert "batch number" in engine.value.message
            with pytest.raises(sw.EngineError):
                sw.decode_engine_batch(seq, b"", "m")
        assert all(c.capacity is None for c in warm.stats().node_caches), "no size was set"
        assert warm.warmest("m", TOKENS) == sw.Hit("node", 256), "nothing was lost"


def test_a_nul_byte_in_a_name_is_refused(warm: sw.Warm) -> None:
    calls: List[Callable[[], object]] = [
        lambda: warm.ran("m", TOKENS, "no\x00de"),
        lambda: warm.ran("mo\x00del", TOKENS, "node"),
        lambda: warm.set_node_capacity("no\x00de", 16),
        lambda: warm.forget_node("\x00"),
    ]
    for call in calls:
        with pytest.raises(sw.InvalidInputError) as raised:
            call()
        assert raised.value.kind == "NulInName" and "NUL" in raised.value.message
    assert warm.stats().nodes == ()


def test_already_open_names_no_rust_type(tmp_path: Path) -> None:
    path = tmp_path / "w.redb"
    with sw.Warm.open(path):
        with pytest.raises(sw.IndexFileError) as raised:
            sw.Warm.open(path)
    assert raised.value.kind == "AlreadyOpen" and "Snapshot" not in raised.value.message
    assert "Reader" in raised.value.message
