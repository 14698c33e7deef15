"""Type stubs of the native module ``superfluid_warm._native`` (PyO3). Import from
``superfluid_warm``, which re-exports everything here."""

import os
import sys
from types import TracebackType
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple, Type, TypeVar, Union, final

from ._types import EngineOutcome, EngineStats, FileCheck, ImportReport, ListenStatus, ShareStats, Stats

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

class _ArrayInterface(Protocol):
    """A numpy array (whose buffer protocol numpy's stubs declare only from Python 3.12)."""

    @property
    def __array_interface__(self) -> Dict[str, Any]: ...

#: Token ids: ints in ``0..2**32`` (a list, tuple or any iterable: copied), or a C-contiguous
#: 1-D buffer of uint32 such as a numpy ``uint32`` array or ``array('I')`` (read in place, not
#: copied). Another dtype raises ``TypeError``.
Tokens = Union[Iterable[int], Buffer, _ArrayInterface]
#: A tenant: ``str`` (its UTF-8 bytes) or ``bytes``; ``None`` for the model's shared namespace.
Tenant = Union[str, bytes, None]
#: A file path.
StrPath = Union[str, "os.PathLike[str]"]

_Self = TypeVar("_Self")

HAS_NATS: bool
__version__: str
BLOCK_TOKENS: int
MIN_BLOCKS: int
HASH_SCHEME: str
SCHEMA_VERSION: int
DEFAULT_CAPACITY: int
MAX_CAPACITY: int
DEFAULT_NODES_PER_PREFIX: int
MAX_NODES_PER_PREFIX: int
MAX_MODEL_BYTES: int
MAX_NODE_BYTES: int
MAX_TENANT_BYTES: int

@final
class Hit:
    """The node that ran the longest remembered prefix of a prompt, how many tokens of the
    prompt that prefix is (a multiple of 64, at least 128), and where the node keeps it.
    Compared and hashed by value."""

    __match_args__ = ("node", "tokens", "tier", "gpu_tokens")
    @property
    def node(self) -> str:
        """The node's name."""
    @property
    def tokens(self) -> int:
        """How many tokens of the prompt the node ran."""
    @property
    def tier(self) -> str:
        """The slowest tier the node keeps that prefix in, by its engine's KV events:
        ``"gpu"``, ``"cpu"`` or ``"storage"`` (``"other"``: unknown to this build); ``"gpu"``
        for a node known by its ``ran``s."""
    @property
    def gpu_tokens(self) -> int:
        """Of ``tokens``, how many from the prompt's start are in GPU memory."""
    def __init__(self, node: str, tokens: int, tier: str = "gpu", gpu_tokens: Optional[int] = None) -> None:
        """A hit (for tests and fakes), by default all of it in GPU memory."""
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Prefix:
    """A prompt's block hashes, made once by ``prefix(...)`` for the question
    (``warmest_prefix``, ``warm_nodes_prefix``) and the answer (``ran_prefix``) of one
    request. Tied to the hash scheme of the index that made it."""

    @property
    def blocks(self) -> int:
        """Whole 64-token blocks in the prompt."""
    @property
    def tokens(self) -> int:
        """Tokens covered by whole blocks."""
    @property
    def model(self) -> str:
        """The model it was hashed for."""
    @property
    def has_tenant(self) -> bool:
        """Whether it was hashed for a tenant."""
    def __len__(self) -> int: ...

@final
class EngineBatch:
    """One batch of an engine's KV cache events, made by ``decode_engine_batch``."""

    @property
    def seq(self) -> int:
        """The engine's sequence number (from 0 per engine process)."""
    @property
    def ts(self) -> float:
        """When the engine published it (seconds since the Unix epoch)."""
    def __len__(self) -> int: ...

class _Index:
    """The read side every index shares (``Warm``, ``Reader``, ``SharedWarm``)."""

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
    @property
    def path(self) -> str:
        """The index file's path."""
    def prefix(self, model: str, tokens: Tokens, tenant: Tenant = None) -> Prefix:
        """Hashes ``tokens`` for ``model`` (and ``tenant``) once, for ``warmest_prefix``,
        ``warm_nodes_prefix`` and ``ran_prefix``."""
    def warmest(self, model: str, tokens: Tokens, tenant: Tenant = None) -> Optional[Hit]:
        """The node that ran the longest remembered prefix of ``tokens``, and how many tokens
        that prefix is; ``None`` under two blocks (128 tokens)."""
    def warm_nodes(self, model: str, tokens: Tokens, tenant: Tenant = None) -> List[Hit]:
        """Every remembered node that ran a prefix of ``tokens`` (at least two blocks),
        longest first (ties: the newest first); the first is ``warmest``'s answer."""
    def warmest_prefix(self, prefix: Prefix) -> Optional[Hit]:
        """``warmest`` for a prefix made by ``prefix``."""
    def warm_nodes_prefix(self, prefix: Prefix) -> List[Hit]:
        """``warm_nodes`` for a prefix made by ``prefix``."""
    def close(self) -> None:
        """Closes it; later calls raise ``ClosedError``; closing again does nothing."""
    def __enter__(self: _Self) -> _Self: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

@final
class Warm(_Index):
    """Which node last ran each prompt prefix, kept in a crash-safe redb file. Open with
    ``Warm.open``; share one across threads; close with ``close()`` or ``with``."""

    @classmethod
    def open(
        cls,
        path: StrPath,
        *,
        capacity: Optional[int] = None,
        nodes_per_prefix: Optional[int] = None,
        node_cache_blocks: Optional[int] = None,
        sync_window_ms: Optional[float] = None,
        cache_bytes: Optional[int] = None,
        check_integrity: bool = True,
        compact_on_close: bool = True,
        engine_grace_ms: Optional[float] = None,
        attention_chunk: Optional[int] = None,
        import_json: Optional[StrPath] = None,
    ) -> "Warm":
        """Opens (or creates) the index at ``path``; a file left by a crash is recovered to
        its last commit."""
    def ran(self, model: str, tokens: Tokens, node: str, tenant: Tenant = None) -> None:
        """Records that ``node`` ran ``tokens`` for ``model``: atomic, answered at once,
        durable after ``sync()`` or within the sync window."""
    def ran_prefix(self, prefix: Prefix, node: str) -> None:
        """``ran`` for a prefix made by ``prefix``."""
    def forget_node(self, name: str) -> None:
        """Forgets node ``name`` (its KV cache is gone), durably."""
    def set_node_capacity(self, name: str, blocks: Optional[int]) -> None:
        """Sets node ``name``'s KV cache size in 64-token blocks (``None``: the default)."""
    def set_node_cache_default(self, blocks: Optional[int]) -> None:
        """Sets (``None``: removes) the default KV cache size of a node."""
    def sync(self) -> None:
        """Makes every ``ran`` that returned before this call durable."""
    def stats(self) -> Stats:
        """Counts and settings, as of every ``ran`` that returned."""
    def import_json(self, path: StrPath) -> ImportReport:
        """Imports a 0.1.7 ``warm.json`` in one transaction."""
    def engine_batch(self, node: str, batch: EngineBatch) -> EngineOutcome:
        """Applies one batch of node ``node``'s engine KV cache events."""
    def engine_payload(self, node: str, seq: int, payload: Buffer, model: str) -> EngineOutcome:
        """Decodes one ZMQ message of vLLM's (or SGLang's) KV events (``seq``: its second frame
        as an int, ``payload``: its third) and applies it to node ``node``."""
    def engine_resync(self, node: str, batch: EngineBatch) -> None:
        """Node ``node``'s engine cannot give the batches before ``batch``: what it was known
        to hold is dropped and ``batch`` starts its stream again."""
    def engine_stats(self) -> List[EngineStats]:
        """Where each engine stream stands and what each node holds."""

@final
class Reader(_Index):
    """A file's answers as of its last commit, read-only, whether or not a head has it open."""

    @classmethod
    def open(cls, path: StrPath) -> "Reader":
        """Opens ``path`` read-only at its last commit."""

@final
class Ticket:
    """A sharing head's event (``SharedWarm.ran``), to wait for with ``SharedWarm.wait_for``.
    Only when built with the ``nats`` feature."""

    def __eq__(self, other: object) -> bool: ...

@final
class SharedWarm(_Index):
    """A head's index shared with other heads through a NATS JetStream stream. Only when built
    with the ``nats`` feature (``HAS_NATS``): ``maturin build --release --features nats``."""

    @classmethod
    def open(
        cls,
        path: StrPath,
        url: str,
        stream: str,
        head: str,
        *,
        capacity: Optional[int] = None,
        nodes_per_prefix: Optional[int] = None,
        node_cache_blocks: Optional[int] = None,
        sync_window_ms: Optional[float] = None,
        cache_bytes: Optional[int] = None,
        check_integrity: bool = True,
        compact_on_close: bool = True,
        engine_grace_ms: Optional[float] = None,
        attention_chunk: Optional[int] = None,
        max_age_s: Optional[float] = None,
        max_bytes: Optional[int] = None,
        buffer_events: Optional[int] = None,
        publish_timeout_ms: Optional[float] = None,
    ) -> "SharedWarm":
        """Opens the head's file and starts sharing (without waiting for the server)."""
    def ran(self, model: str, tokens: Tokens, node: str, tenant: Tenant = None) -> Ticket:
        """As ``Warm.ran``, shared through the stream."""
    def ran_prefix(self, prefix: Prefix, node: str) -> Ticket:
        """``ran`` for a prefix made by ``prefix``."""
    def forget_node(self, name: str) -> None:
        """As ``Warm.forget_node``; returns once the forget is in the stream."""
    def set_node_capacity(self, name: str, blocks: Optional[int]) -> Ticket:
        """As ``Warm.set_node_capacity``, for every head of the stream."""
    def wait_ready(self, timeout_s: float) -> None:
        """Waits until the head has connected and opened its stream."""
    def wait_for(self, ticket: Ticket, timeout_s: float) -> bool:
        """Waits until this head has applied ``ticket``'s event; whether it has."""
    def wait_applied(self, seq: int, timeout_s: float) -> bool:
        """Waits until this head has applied the stream up to ``seq``; whether it has."""
    def sync(self) -> None:
        """Makes this head's events durable (in the stream, and its file committed)."""
    def stats(self) -> Tuple[Stats, ShareStats]:
        """The head's index's counts and how it stands with the stream."""
    def share_stats(self) -> ShareStats:
        """How the head stands with the stream."""
    def lags_ns(self) -> List[int]:
        """Publish-to-applied lags of other heads' events applied here, in nanoseconds."""

def decode_engine_batch(seq: int, payload: Buffer, model: str) -> EngineBatch:
    """Decodes one ZMQ message of vLLM's (or SGLang's) KV cache events."""

def check_file(path: StrPath) -> FileCheck:
    """Checks the index file at ``path`` without writing it."""

def listen_status(path: StrPath) -> Optional[ListenStatus]:
    """The status a listener last wrote beside the index file at ``path``, if any."""

# Test hooks: only in a build with the ``test-hooks`` feature (``ci.sh``'s), not a user's.

def _panic(message: str) -> None:
    """Test hook: panics in Rust; raises ``WarmError`` of kind ``"Panic"``."""

def _replay_rust(
    path: StrPath,
    model: str,
    prompts: Sequence[Tokens],
    *,
    capacity: Optional[int] = None,
    sync_window_ms: Optional[float] = None,
    tenant: Tenant = None,
    warm_nodes: bool = False,
) -> Tuple[List[Optional[Tuple[str, int]]], List[List[Tuple[str, int]]], List[int]]:
    """Test hook (the tests and bench.py): a replay made entirely in Rust."""
