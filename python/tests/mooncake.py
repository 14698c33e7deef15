"""The shared Mooncake conversation trace, turned into tokens by the rule every tool of the
repository uses (``traces/README.md``, ``benches/harness/src/trace.rs``), and a pure-Python model of
0.1.7's answers to check the index against."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

TRACE = Path(__file__).resolve().parents[2] / "traces" / "mooncake-conversation.jsonl"
TOKENS_PER_HASH_ID = 512
BLOCK = 64
MIN_BLOCKS = 2
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's finalizer, on Python ints (the reference for the numpy form)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def tokens_slow(input_length: int, hash_ids: List[int]) -> List[int]:
    """Token ``j`` is ``splitmix64(hash_ids[j // 512] * 512 + j % 512) >> 32``."""
    return [
        splitmix64((hash_ids[j // TOKENS_PER_HASH_ID] * TOKENS_PER_HASH_ID + j % TOKENS_PER_HASH_ID) & MASK64) >> 32
        for j in range(input_length)
    ]


def tokens(input_length: int, hash_ids: List[int]) -> npt.NDArray[np.uint32]:
    """``tokens_slow``, vectorised (uint64 arithmetic wraps as Rust's ``wrapping_*`` does)."""
    j = np.arange(input_length, dtype=np.uint64)
    ids = np.asarray(hash_ids, dtype=np.uint64)
    x = ids[j // np.uint64(TOKENS_PER_HASH_ID)] * np.uint64(TOKENS_PER_HASH_ID) + j % np.uint64(TOKENS_PER_HASH_ID)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.ascontiguousarray((x >> np.uint64(32)).astype(np.uint32))


@dataclass(frozen=True)
class Request:
    """One request of the trace."""

    input_length: int
    hash_ids: List[int] = field(repr=False)

    def tokens(self) -> npt.NDArray[np.uint32]:
        """The prompt as a numpy uint32 array."""
        return tokens(self.input_length, self.hash_ids)


def requests(limit: Optional[int] = None) -> List[Request]:
    """The first ``limit`` requests of the trace (all of them by default)."""
    out: List[Request] = []
    with TRACE.open() as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(Request(int(r["input_length"]), [int(h) for h in r["hash_ids"]]))
            if limit is not None and len(out) >= limit:
                break
    return out


def chain(prompt: npt.NDArray[np.uint32]) -> Iterator[int]:
    """A key per whole 64-token block, chained (a stand-in for the index's own hash: only
    equality of prefixes matters to the answers)."""
    key = 0
    for b in range(len(prompt) // BLOCK):
        key = hash((key, prompt[b * BLOCK : (b + 1) * BLOCK].tobytes()))
        yield key


class Model017:
    """0.1.7's semantics (``benches/harness/src/baseline.rs``): a map from each block of a prefix to the
    node that last ran it and a clock; ``warmest`` walks the blocks from the first while they
    are known; past ``capacity`` entries, every entry at or below the clock of the oldest
    eighth's boundary is evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clock = 0
        self.by_prefix: Dict[int, Tuple[str, int]] = {}

    def warmest(self, prompt: npt.NDArray[np.uint32]) -> Optional[Tuple[str, int]]:
        best: Optional[Tuple[str, int]] = None
        for n, key in enumerate(chain(prompt)):
            known = self.by_prefix.get(key)
            if known is None:
                break
            best = (known[0], (n + 1) * BLOCK)
        if best is not None and best[1] >= MIN_BLOCKS * BLOCK:
            return best
        return None

    def ran(self, prompt: npt.NDArray[np.uint32], node: str) -> None:
        self.clock += 1
        for key in chain(prompt):
            self.by_prefix[key] = (node, self.clock)
        if len(self.by_prefix) > self.capacity:
            ages = sorted(at for _, at in self.by_prefix.values())
            cut = ages[self.capacity // 8]
            self.by_prefix = {k: v for k, v in self.by_prefix.items() if v[1] > cut}


def naive_node(i: int, hit: Optional[Tuple[str, int]]) -> str:
    """The routing rule of the Rust replay tests: the warm node, else round robin over 8."""
    return hit[0] if hit is not None else f"node-{i % 8}"
