"""Benchmark: what calling the index from Python costs a router, on the shared conversation trace.

Per request, as a router does: ``warmest`` (where is this prompt warm?), then ``ran`` on the
warm node (else ``node-{i % 8}``); timed per request. Four ways, on a fresh index file each, in
one process and one run, rotated so that none always goes first:

- ``rust``: the same two calls made from Rust (``_native._replay_rust``: a loop in Rust over
  the same prompts; no Python in the timed part);
- ``numpy``: from Python, tokens as numpy ``uint32`` arrays (read in place, not copied);
- ``list``: from Python, tokens as ``list[int]`` (converted on every call);
- ``numpy+prefix``: from Python, hashed once with ``prefix`` and used by ``warmest_prefix`` and
  ``ran_prefix`` (one hash instead of two).

Prints p50 and p99 per request for each, per run, then the spread over the runs and what numpy
input adds to the Rust p50 (target: at most 5 us).

    python bench.py [--requests N] [--runs R] [--dir DIR] [--json]

It needs a build with the ``test-hooks`` feature (``_replay_rust``), as ``ci.sh`` makes:
``pip install ./python --config-settings=build-args="--features test-hooks"``.

The garbage collector is off while a replay is timed (a router's own garbage is not the
index's cost).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import numpy.typing as npt

# This script's folder holds the package's sources: without the built module (installed with
# pip, not `maturin develop`) they must not shadow the installed package.
_HERE = Path(__file__).resolve().parent
if not any(p.suffix in (".so", ".pyd") for p in (_HERE / "superfluid_warm").glob("_native*")):
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE / "tests"))
import superfluid_warm as sw  # noqa: E402
import mooncake  # noqa: E402 (the trace's token rule, shared with the tests)

MODEL = "m"
Prompts = List[npt.NDArray[np.uint32]]


def replay_python(path: Path, prompts: Sequence[object]) -> List[int]:
    """``warmest`` then ``ran`` per request from Python; nanoseconds per request."""
    nanos: List[int] = []
    clock = time.perf_counter_ns
    with sw.Warm.open(path) as warm:
        warmest, ran = warm.warmest, warm.ran
        for i, tokens in enumerate(prompts):
            started = clock()
            hit = warmest(MODEL, tokens)  # type: ignore[arg-type]
            ran(MODEL, tokens, hit.node if hit is not None else f"node-{i % 8}")  # type: ignore[arg-type]
            nanos.append(clock() - started)
    return nanos


def replay_prefix(path: Path, prompts: Prompts) -> List[int]:
    """``prefix`` once, then ``warmest_prefix`` and ``ran_prefix``; nanoseconds per request."""
    nanos: List[int] = []
    clock = time.perf_counter_ns
    with sw.Warm.open(path) as warm:
        for i, tokens in enumerate(prompts):
            started = clock()
            prefix = warm.prefix(MODEL, tokens)
            hit = warm.warmest_prefix(prefix)
            warm.ran_prefix(prefix, hit.node if hit is not None else f"node-{i % 8}")
            nanos.append(clock() - started)
    return nanos


def replay_rust(path: Path, prompts: Prompts) -> List[int]:
    """The same calls made from Rust (its tokens copied into Rust before the clock starts)."""
    _, _, nanos = sw._native._replay_rust(path, MODEL, prompts)
    return nanos


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=None, help="the first N requests (default: all 12,031)")
    parser.add_argument("--runs", type=int, default=3, help="runs of the four replays (default 3)")
    parser.add_argument("--dir", type=Path, default=None, help="where the index files go (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)

    requests = mooncake.requests(args.requests)
    prompts: Prompts = [r.tokens() for r in requests]
    lists = [p.tolist() for p in prompts]
    tokens = sum(len(p) for p in prompts)
    print(
        f"{len(prompts)} requests, {tokens / len(prompts):,.0f} tokens each on average; "
        f"superfluid-warm {sw.__version__}, Python {sys.version.split()[0]}",
        file=sys.stderr,
    )
    ways: Dict[str, Callable[[Path], List[int]]] = {
        "rust": lambda path: replay_rust(path, prompts),
        "numpy": lambda path: replay_python(path, prompts),
        "list": lambda path: replay_python(path, lists),
        "numpy+prefix": lambda path: replay_prefix(path, prompts),
    }
    names = list(ways)
    runs: List[Dict[str, Dict[str, float]]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for run in range(args.runs):
            figures: Dict[str, Dict[str, float]] = {}
            order = names[run % len(names) :] + names[: run % len(names)]
            for name in order:
                path = Path(tmp) / f"run{run}-{name.replace('+', '-')}.redb"
                gc.collect()
                gc.disable()
                try:
                    nanos = np.asarray(ways[name](path), dtype=np.float64) / 1000.0
                finally:
                    gc.enable()
                figures[name] = {
                    "p50_us": float(np.percentile(nanos, 50)),
                    "p99_us": float(np.percentile(nanos, 99)),
                    "mean_us": float(nanos.mean()),
                }
            runs.append(figures)
            line = "  ".join(f"{n} p50 {figures[n]['p50_us']:.1f} / p99 {figures[n]['p99_us']:.1f} us" for n in names)
            print(f"run {run + 1}: {line}", file=sys.stderr)

    def spread(name: str, key: str) -> str:
        values = [r[name][key] for r in runs]
        return f"{min(values):.1f}-{max(values):.1f}"

    added = [r["numpy"]["p50_us"] - r["rust"]["p50_us"] for r in runs]
    added_list = [r["list"]["p50_us"] - r["rust"]["p50_us"] for r in runs]
    if args.json:
        print(json.dumps({"requests": len(prompts), "runs": runs, "numpy_adds_p50_us": added}, indent=2))
    else:
        print(f"per request, warmest + ran, {len(prompts)} requests, {args.runs} runs (lowest-highest over the runs):")
        print(f"{'':14}{'p50 us':>14}{'p99 us':>16}")
        for name in names:
            print(f"{name:14}{spread(name, 'p50_us'):>14}{spread(name, 'p99_us'):>16}")
        print(f"numpy input adds to the Rust p50: {min(added):+.1f} to {max(added):+.1f} us (target <= 5 us: "
              f"{'met' if max(added) <= 5.0 else 'not met'})")
        print(f"list input adds to the Rust p50: {min(added_list):+.1f} to {max(added_list):+.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
