"""The records the index returns, as frozen dataclasses (the native module builds them).

``Hit`` and ``Prefix``, returned on every request, are native classes for speed; these are the
reports: counts, settings, checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = [
    "NodeStats",
    "NodeCacheStats",
    "Stats",
    "ImportReport",
    "EngineCounts",
    "EngineStats",
    "EngineOutcome",
    "EngineStatus",
    "FileCheck",
    "LinkStatus",
    "ListenStatus",
    "ShareStats",
]


@dataclass(frozen=True)
class NodeStats:
    """One node incarnation the index has seen (``Stats.nodes``).

    Attributes:
        name: the node's name.
        forgotten: whether this incarnation was forgotten (``Warm.forget_node``): nothing it
            ran is answered, and its name's next ``ran`` starts a new incarnation.
    """

    name: str
    forgotten: bool


@dataclass(frozen=True)
class NodeCacheStats:
    """The KV cache the index keeps for one node (``Stats.node_caches``).

    Attributes:
        node: the node's name.
        held: blocks (64 tokens) the index counts in its cache.
        capacity: most blocks its cache holds (its own size, else the default); ``None``: no
            limit.
        floor: every block it last ran at or below this clock has left its cache (0: none yet).
    """

    node: str
    held: int
    capacity: Optional[int]
    floor: int


@dataclass(frozen=True)
class Stats:
    """What the index holds, as of the last ``ran`` (committed or not): ``Warm.stats()``.

    Attributes:
        entries: entries (block hashes) held.
        legacy_entries: of those, imported from 0.1.7 and not yet evicted.
        capacity: most entries kept.
        clock: the clock of the last ``ran``.
        nodes: every node incarnation ever seen.
        others: nodes named by blocks besides the last one to run them.
        reclaimable: blocks (or others) naming a forgotten incarnation, reclaimed as evicted.
        pending: whether changes are waiting for a commit.
        open_check: how the file was verified when opened: ``"seal"``, ``"pages"`` or
            ``"skipped"``.
        upgraded_from: the schema the file was upgraded from when opened, if it was.
        recovered_from: the process id of the head that had left the file open (crashed) when
            this one opened and recovered it, if one had.
        node_caches: the cache of each current node incarnation whose cache is kept.
    """

    entries: int
    legacy_entries: int
    capacity: int
    clock: int
    nodes: Tuple[NodeStats, ...]
    others: int
    reclaimable: int
    pending: bool
    open_check: str
    upgraded_from: Optional[int]
    recovered_from: Optional[int]
    node_caches: Tuple[NodeCacheStats, ...]


@dataclass(frozen=True)
class ImportReport:
    """What ``Warm.import_json`` did with a 0.1.7 ``warm.json``.

    Attributes:
        in_file: entries in the file.
        imported: entries written (an entry already there with a newer clock is kept).
        already_imported: this very file was imported before: nothing was done.
        evicted: entries evicted to stay within capacity afterwards.
    """

    in_file: int
    imported: int
    already_imported: bool
    evicted: int


@dataclass(frozen=True)
class EngineCounts:
    """An engine event stream's counts (``EngineStats.counts``).

    Attributes:
        batches: batches applied.
        stored: blocks stored (GPU, keyed or not).
        removed: blocks removed.
        clears: times everything the node held was dropped (the engine said so, restarted, or
            a gap could not be covered).
        restarts: engine restarts seen (its numbers started again).
        gaps: gaps seen (batches missing before one that came).
        lost: gaps a replay could not cover (the node was cleared).
        duplicate_batches: batches that came twice.
        duplicate_blocks: blocks stored again while held.
        unknown_parents: blocks stored under a parent the index does not hold.
        unknown_removals: removals of blocks the index does not hold.
        other_medium: events of a medium other than the GPU, not indexed.
        unkeyed: stores under no namespace of this index (a LoRA or salt it does not route).
        malformed: malformed events, skipped.
        unaligned: blocks of a size that does not divide 64, kept but keying nothing.
    """

    batches: int
    stored: int
    removed: int
    clears: int
    restarts: int
    gaps: int
    lost: int
    duplicate_batches: int
    duplicate_blocks: int
    unknown_parents: int
    unknown_removals: int
    other_medium: int
    unkeyed: int
    malformed: int
    unaligned: int


@dataclass(frozen=True)
class EngineStats:
    """Where one node's engine event stream stands (``Warm.engine_stats()``).

    Attributes:
        node: the node's name.
        last_seq: the sequence number of the last batch applied (``None``: none since the
            stream began or was cleared).
        last_ts: its publish time (seconds since the Unix epoch).
        engine_blocks: engine blocks the node holds, as its events said.
        by_tier: of those, how many are held in GPU memory, only in CPU memory, and only on
            storage (an offloading connector's tiers).
        blocks: 64-token blocks of the index those cover whole from a prompt's start.
        counts: the stream's counts.
        groups: the KV cache groups its events named since this head started, as
            ``(index, kind, window)``: kind ``"full"``, ``"sliding_window"`` (with its window in
            tokens), ``"chunked_local"``, ``"mamba"`` or ``"other"``. Empty for an engine that
            names none. An engine of several groups is hybrid: answered what vLLM reuses by its
            rule over every group, its holdings kept in memory only.
        unplaced_blocks: of a hybrid engine, blocks whose place its events did not give.
        group_changes: times one of its groups changed kind (each cleared the node).
    """

    node: str
    last_seq: Optional[int]
    last_ts: float
    engine_blocks: int
    by_tier: Tuple[int, int, int]
    blocks: int
    counts: EngineCounts
    groups: Tuple[Tuple[int, str, Optional[int]], ...] = ()
    unplaced_blocks: int = 0
    group_changes: int = 0


@dataclass(frozen=True)
class EngineOutcome:
    """What ``Warm.engine_batch`` (or ``engine_payload``) did with a batch.

    Attributes:
        kind: ``"applied"`` (it was the next batch, or the first of a new engine process),
            ``"duplicate"`` (already applied: nothing changed) or ``"gap"`` (not applied:
            batches before it are missing).
        replay_from: for a gap, the sequence number to ask the engine's replay endpoint for;
            apply what comes back, and if its first batch is later than this, pass that batch
            to ``Warm.engine_resync``. ``None`` otherwise.
    """

    kind: str
    replay_from: Optional[int] = None

    @property
    def applied(self) -> bool:
        """Whether the batch was applied."""
        return self.kind == "applied"

    @property
    def gap(self) -> bool:
        """Whether batches before this one are missing (see ``replay_from``)."""
        return self.kind == "gap"


@dataclass(frozen=True)
class FileCheck:
    """What ``check_file`` found, without writing the file.

    Attributes:
        healthy: nothing is wrong: redb's page checksums did not fail, every invariant holds,
            and the file needs no recovery.
        problems: every problem found, each a sentence saying what to do.
        integrity: redb's page checksums passed (``None``: not checked, a head has the file
            open).
        crashed_writer: the file was left open by a head that ended without closing it (it
            was checked on a recovered copy; a head's next open recovers it).
        crashed_writer_pid: that head's process id, where the file says.
        entries: entries the invariants' walk counted (``None``: the tables were not walked).
        side_file_missing: a running head's side file (``<file>.seal``) was deleted.
    """

    healthy: bool
    problems: Tuple[str, ...]
    integrity: Optional[bool]
    crashed_writer: bool
    crashed_writer_pid: Optional[int]
    entries: Optional[int]
    side_file_missing: bool


@dataclass(frozen=True)
class EngineStatus:
    """What a listener has seen of one engine (``ListenStatus.engines``).

    Attributes:
        node: the node.
        connected: whether its event socket was connected.
        received: batches received.
        undecodable: batches that did not decode.
        malformed: messages of the wrong shape.
        replays: replays asked for.
        replays_short: replays that did not cover their gap.
        replays_skipped: gaps not replayed while the replay endpoint was left alone.
        replaying: whether a replay was being waited for.
        replay_backoff_s: seconds until the replay endpoint is asked again.
        dropped: connections dropped for good and made again.
        lag_p50_ms: lag from publish to applied, median, in milliseconds.
        lag_p99_ms: the same, 99th percentile.
        silent_for_s: seconds since its last batch.
        error: the listening thread's newest error.
    """

    node: str
    connected: bool
    received: int
    undecodable: int
    malformed: int
    replays: int
    replays_short: int
    replays_skipped: int
    replaying: bool
    replay_backoff_s: Optional[float]
    dropped: int
    lag_p50_ms: Optional[float]
    lag_p99_ms: Optional[float]
    silent_for_s: Optional[float]
    error: Optional[str]


@dataclass(frozen=True)
class LinkStatus:
    """A listener's link to a NATS JetStream stream (``ListenStatus.sharing``).

    Attributes:
        stream: the stream.
        head: this head's name in it.
        connected: whether it was connected to the server.
        ready: whether it had opened the stream.
        applied: the stream's last event applied to the file.
        unapplied: events in the stream not yet applied.
        published: events this head published.
        buffered: events waiting to be published.
        dropped: events dropped unpublished.
        error: what was wrong with the link, if anything.
        halted: why the link stopped for good, if it did.
    """

    stream: str
    head: str
    connected: bool
    ready: bool
    applied: int
    unapplied: int
    published: int
    buffered: int
    dropped: int
    error: Optional[str]
    halted: Optional[str]


@dataclass(frozen=True)
class ListenStatus:
    """The status a listener last wrote beside an index file (``listen_status``).

    Attributes:
        pid: the listener's process id.
        running: whether it was running when it wrote this.
        written_at: when, in seconds since the Unix epoch.
        refresh_s: seconds between its writes.
        error: why it stopped on its own, if it did.
        down: why it is not running now (it stopped, its process is gone, or it has not written
            for three refreshes), or ``None`` if it is.
        sharing: its link to a shared stream, if it has one.
        engines: each engine it follows.
    """

    pid: int
    running: bool
    written_at: float
    refresh_s: float
    error: Optional[str]
    down: Optional[str]
    sharing: Optional[LinkStatus]
    engines: Tuple[EngineStatus, ...]


@dataclass(frozen=True)
class ShareStats:
    """How a sharing head stands with its NATS JetStream stream (``SharedWarm.share_stats()``).

    Attributes:
        head: this head's name.
        stream: the stream.
        connected: whether the client is connected to the server now.
        applied: the stream sequence of the last event applied here.
        durable: the stream sequence of the last event committed durably to the file.
        unapplied: events in the stream not yet applied here (as last seen).
        oldest_unapplied_age_s: how long ago the oldest of those was stored, in seconds.
        buffered: this head's events not yet in the stream.
        published: this head's events the stream acknowledged.
        dropped: this head's events dropped because the buffer was full.
        applied_events: events applied here (this head's and others').
        skipped: redelivered events at or below the position, skipped.
        rejected: events no head can apply, skipped by all.
        pending_own: this head's own events answered here but not yet back from the stream.
        error: the last transient error (the link retries it).
        halted: why the head stopped applying the stream, if it did.
    """

    head: str
    stream: str
    connected: bool
    applied: int
    durable: int
    unapplied: int
    oldest_unapplied_age_s: Optional[float]
    buffered: int
    published: int
    dropped: int
    applied_events: int
    skipped: int
    rejected: int
    pending_own: int
    error: Optional[str]
    halted: Optional[str]
