"""The exceptions of superfluid_warm: one base, :class:`WarmError`, and a subclass per broad kind.

Every error of the Rust library is raised as a :class:`WarmError` (or a subclass) whose
``kind`` is the name of the Rust ``Error`` variant, ``message`` its message (which says what to
do), and ``needs_reopen`` whether this handle can take no more writes (after an I/O error: close
it and open the file again; what was committed is there).

======================  ==========================================================================
class                   kinds
======================  ==========================================================================
InvalidInputError       ``InvalidName``, ``NulInName``, ``InvalidConfig``, ``ForeignPrefix`` (also a
                        ValueError)
IndexFileError          ``AlreadyOpen``, ``NewerSchema``, ``RetiredSchema``, ``UnknownFormat``,
                        ``Corrupted``, ``FileLost``, ``CrashedWriter``, ``LegacyJson``,
                        ``BeingCreated`` (retry), ``NotWritable``
StorageError            ``Storage``, ``CommitFailed``, ``Io``, ``Thread``
ClosedError             ``Closed``: the index (or reader, or head) was closed
ForkedError             ``Forked``: a handle used in a child made by ``fork`` (``multiprocessing``)
EngineError             ``Engine``: an engine's KV event batch that does not decode
SharingError            ``Sharing``, ``Unpublished`` (``SharedWarm`` only)
WarmError               anything else: ``Codec``, ``Poisoned``, ``Panic`` (a bug in Rust, caught
                        before it reached Python), and kinds added by later versions
======================  ==========================================================================

Token ids of the wrong type are not a library error: they raise :class:`TypeError` (and an int
outside ``0..2**32`` :class:`ValueError`) before the index is asked.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple, Type

__all__ = [
    "WarmError",
    "InvalidInputError",
    "IndexFileError",
    "StorageError",
    "ClosedError",
    "ForkedError",
    "EngineError",
    "SharingError",
]


class WarmError(Exception):
    """An error of the superfluid-warm index.

    Attributes:
        kind: the Rust ``superfluid_warm::Error`` variant's name (``"InvalidName"``,
            ``"Storage"``, ...), or ``"Closed"`` / ``"Panic"`` for the binding's own.
        message: what went wrong and what to do about it.
        needs_reopen: whether this handle can write no more (redb refuses every write after an
            I/O error until the file is reopened): close it and open the file again.
    """

    kind: str
    message: str
    needs_reopen: bool

    def __init__(self, message: str, kind: str = "Error", needs_reopen: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.needs_reopen = needs_reopen

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (self.message, self.kind, self.needs_reopen))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, message={self.message!r}, needs_reopen={self.needs_reopen!r})"


class InvalidInputError(WarmError, ValueError):
    """A name (model, node, tenant) empty or too long, a setting out of range, or a prefix hashed
    for another index file's scheme. Nothing was changed."""


class IndexFileError(WarmError):
    """The file cannot be opened or used as an index: open elsewhere, written by a newer or a
    pre-release build, not an index, corrupted, lost, or (for a reader) left by a crashed head."""


class StorageError(WarmError):
    """The storage underneath failed (I/O, disk full) or a background commit did. What was
    committed before is intact; check ``needs_reopen``."""


class ClosedError(WarmError):
    """The index (or reader, or head) was closed: open the file again."""


class ForkedError(WarmError):
    """A handle opened by another process, used in a child made by ``fork`` (``os.fork``,
    ``multiprocessing`` with the ``fork`` start method): its threads and its file are the
    parent's, so the call did nothing. Open the index in the child itself (``Reader.open``
    reads it while the parent writes), or use the ``spawn`` start method."""


class EngineError(WarmError):
    """An engine's KV cache event batch could not be decoded (nothing of it was applied)."""


class SharingError(WarmError):
    """A sharing head (``SharedWarm``) cannot reach or apply its stream, or its events are not
    yet in the stream (``Unpublished``: they stay buffered and are published later)."""


_BY_KIND: Dict[str, Type[WarmError]] = {
    "InvalidName": InvalidInputError,
    "NulInName": InvalidInputError,
    "InvalidConfig": InvalidInputError,
    "ForeignPrefix": InvalidInputError,
    "AlreadyOpen": IndexFileError,
    "NewerSchema": IndexFileError,
    "RetiredSchema": IndexFileError,
    "UnknownFormat": IndexFileError,
    "Corrupted": IndexFileError,
    "FileLost": IndexFileError,
    "BeingCreated": IndexFileError,
    "NotWritable": IndexFileError,
    "CrashedWriter": IndexFileError,
    "LegacyJson": IndexFileError,
    "Storage": StorageError,
    "CommitFailed": StorageError,
    "Io": StorageError,
    "Thread": StorageError,
    "Closed": ClosedError,
    "Forked": ForkedError,
    "Engine": EngineError,
    "Sharing": SharingError,
    "Unpublished": SharingError,
}


def _from_rust(kind: str, message: str, needs_reopen: bool) -> WarmError:
    """The exception for an error of kind ``kind`` (called by the native module)."""
    return _BY_KIND.get(kind, WarmError)(message, kind, needs_reopen)
