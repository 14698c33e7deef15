"""superfluid-warm: which node last ran each prompt prefix, for cache-aware LLM routing.

A router (a head) asks the index where a prompt's KV cache is warm before it places a request,
and tells it after::

    from superfluid_warm import Warm

    with Warm.open("warm.redb") as warm:
        hit = warm.warmest("qwen-2.5-7b", tokens)      # Hit(node, tokens) or None
        node = hit.node if hit else pick_least_loaded()
        warm.ran("qwen-2.5-7b", tokens, node)          # atomic; durable within 50 ms

``tokens`` is a ``list[int]`` or, read in place without a copy, a numpy ``uint32`` array (or
any C-contiguous buffer of uint32). Every call releases the GIL while it hashes, searches or
waits for a commit: any number of threads may share one ``Warm``. A token array must not be
written by another thread while a call reads it.

The index is the Rust crate ``superfluid-warm``; this package is its PyO3 binding. See
``README.md`` for the whole API.
"""

from __future__ import annotations

import os as _os

from ._errors import (
    ClosedError,
    EngineError,
    ForkedError,
    IndexFileError,
    InvalidInputError,
    SharingError,
    StorageError,
    WarmError,
)
from ._types import (
    EngineCounts,
    EngineOutcome,
    EngineStats,
    EngineStatus,
    FileCheck,
    ImportReport,
    LinkStatus,
    ListenStatus,
    NodeCacheStats,
    NodeStats,
    ShareStats,
    Stats,
)
from ._native import (
    BLOCK_TOKENS,
    DEFAULT_CAPACITY,
    DEFAULT_NODES_PER_PREFIX,
    HAS_NATS,
    HASH_SCHEME,
    MAX_CAPACITY,
    MAX_MODEL_BYTES,
    MAX_NODE_BYTES,
    MAX_NODES_PER_PREFIX,
    MAX_TENANT_BYTES,
    MIN_BLOCKS,
    SCHEMA_VERSION,
    EngineBatch,
    Hit,
    Prefix,
    Reader,
    Warm,
    __version__,
    check_file,
    decode_engine_batch,
    listen_status,
)

if HAS_NATS:
    from ._native import SharedWarm, Ticket

__all__ = [
    "Warm",
    "Reader",
    "Hit",
    "Prefix",
    "EngineBatch",
    "decode_engine_batch",
    "check_file",
    "listen_status",
    "Stats",
    "NodeStats",
    "NodeCacheStats",
    "ImportReport",
    "EngineCounts",
    "EngineStats",
    "EngineOutcome",
    "FileCheck",
    "ListenStatus",
    "EngineStatus",
    "LinkStatus",
    "ShareStats",
    "WarmError",
    "InvalidInputError",
    "IndexFileError",
    "StorageError",
    "ClosedError",
    "ForkedError",
    "EngineError",
    "SharingError",
    "HAS_NATS",
    "BLOCK_TOKENS",
    "MIN_BLOCKS",
    "HASH_SCHEME",
    "SCHEMA_VERSION",
    "DEFAULT_CAPACITY",
    "MAX_CAPACITY",
    "DEFAULT_NODES_PER_PREFIX",
    "MAX_NODES_PER_PREFIX",
    "MAX_MODEL_BYTES",
    "MAX_NODE_BYTES",
    "MAX_TENANT_BYTES",
    "__version__",
]

if HAS_NATS:
    __all__ += ["SharedWarm", "Ticket"]
