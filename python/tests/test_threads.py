"""Several Python threads route at once on one index: every call releases the GIL, answers
stay those of each thread's own sequence, and nothing is lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

import superfluid_warm as sw
from mooncake import Model017, naive_node

Answer = Optional[Tuple[str, int]]


def test_threads_routing_at_once_answer_as_each_alone(
    tmp_path: Path, prompts: List[npt.NDArray[np.uint32]], prompt_lists: List[List[int]]
) -> None:
    threads = 4
    some = prompts[:400]
    results: Dict[int, List[Answer]] = {}
    errors: List[BaseException] = []
    readers_done = threading.Event()
    start = threading.Barrier(threads + 1)

    with sw.Warm.open(tmp_path / "w.redb") as warm:

        def route(t: int) -> None:
            # Each thread its own model: its answers depend on its own calls alone, whatever
            # the others do meanwhile. Half the threads pass lists, half numpy arrays.
            model = f"model-{t}"
            answers: List[Answer] = []
            try:
                start.wait()
                for i, prompt in enumerate(some):
                    tokens = prompt_lists[i] if t % 2 else prompt
                    prefix = warm.prefix(model, tokens) if t == 3 else None
                    hit = warm.warmest_prefix(prefix) if prefix is not None else warm.warmest(model, tokens)
                    answer = (hit.node, hit.tokens) if hit else None
                    node = naive_node(i, answer)
                    if prefix is not None:
                        warm.ran_prefix(prefix, node)
                    else:
                        warm.ran(model, tokens, node)
                    answers.append(answer)
                    if i % 100 == 99:
                        warm.sync()
            except BaseException as e:  # noqa: BLE001 (reported by the main thread)
                errors.append(e)
            results[t] = answers

        def read() -> None:
            # Questions of another model while the routers write: never an error.
            try:
                start.wait()
                while not readers_done.is_set():
                    for prompt in some[:50]:
                        warm.warm_nodes("model-0", prompt)
                    warm.stats()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        workers = [threading.Thread(target=route, args=(t,)) for t in range(threads)]
        reader = threading.Thread(target=read)
        for w in workers:
            w.start()
        reader.start()
        for w in workers:
            w.join(timeout=120)
        readers_done.set()
        reader.join(timeout=60)
        assert not errors, errors
        assert not any(w.is_alive() for w in workers)

        model = Model017(sw.DEFAULT_CAPACITY)
        expected: List[Answer] = []
        for i, prompt in enumerate(some):
            answer = model.warmest(prompt)
            model.ran(prompt, naive_node(i, answer))
            expected.append(answer)
        for t in range(threads):
            assert results[t] == expected, f"thread {t}"
        # Every thread's last word is kept.
        for t in range(threads):
            hit = warm.warmest(f"model-{t}", some[-1])
            assert hit is not None and hit.tokens == len(some[-1]) // 64 * 64


def test_calls_release_the_gil(tmp_path: Path) -> None:
    # A long hash (32 MiB of token ids) in one thread; a pure-Python loop in another makes
    # progress meanwhile only if the call released the GIL.
    big = np.arange(1 << 23, dtype=np.uint32)
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    with sw.Warm.open(tmp_path / "w.redb") as warm:
        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            time.sleep(0.05)
            progress = []
            for _ in range(3):
                before = counter[0]
                warm.prefix("m", big)
                progress.append(counter[0] - before)
        finally:
            stop.set()
            spinner.join()
        assert max(progress) > 0, progress


def test_close_waits_for_calls_in_progress_and_later_calls_raise(tmp_path: Path) -> None:
    warm = sw.Warm.open(tmp_path / "w.redb")
    tokens = np.arange(1 << 22, dtype=np.uint32)
    outcome: List[object] = []

    def hammer() -> None:
        try:
            while True:
                warm.ran("m", tokens, "node-a")
        except sw.ClosedError as e:
            outcome.append(e)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    t = threading.Thread(target=hammer)
    t.start()
    time.sleep(0.1)
    warm.close()
    t.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], sw.ClosedError), outcome
    with sw.Warm.open(tmp_path / "w.redb") as again:
        assert again.warmest("m", tokens[:1000]) == sw.Hit("node-a", 960)
