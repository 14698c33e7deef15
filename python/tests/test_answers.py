"""The index answers from Python as the Rust model does: on a slice of the shared trace, the
same answers whether the tokens come as lists or numpy arrays, as a replay made entirely in
Rust, and as a pure-Python model of 0.1.7's semantics."""

from __future__ import annotations

import array
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import numpy.typing as npt
import pytest

import superfluid_warm as sw
import mooncake
from mooncake import Model017, naive_node

Answer = Optional[Tuple[str, int]]


def test_the_token_rule_is_the_rust_harness_one() -> None:
    # Printed by `harness::trace::Request::tokens` (the Rust harness) for these
    # requests: length, first four tokens, last token, sum.
    golden = {
        0: (6758, [3793791033, 2433363436, 2539140574, 487265508], 4261017302, 14449076934712),
        1: (7322, [3793791033, 2433363436, 2539140574, 487265508], 2125640483, 15889088044801),
        7: (26888, [3793791033, 2433363436, 2539140574, 487265508], 2393980380, 57851995265963),
        100: (2885, [3793791033, 2433363436, 2539140574, 487265508], 2581392352, 6272299534386),
        12030: (20774, [3793791033, 2433363436, 2539140574, 487265508], 1819305487, 44604479375330),
    }
    requests = mooncake.requests()
    assert len(requests) == 12031
    for i, (length, first, last, total) in golden.items():
        r = requests[i]
        fast = r.tokens()
        assert fast.dtype == np.uint32 and fast.flags.c_contiguous
        assert (len(fast), fast[:4].tolist(), int(fast[-1]), int(fast.astype(np.uint64).sum())) == (
            length,
            first,
            last,
            total,
        )
        assert fast.tolist() == mooncake.tokens_slow(r.input_length, r.hash_ids)


def replay(warm: sw.Warm, prompts: List[npt.NDArray[np.uint32]], as_list: bool) -> List[Answer]:
    answers: List[Answer] = []
    for i, prompt in enumerate(prompts):
        tokens = prompt.tolist() if as_list else prompt
        hit = warm.warmest("m", tokens)
        answer = (hit.node, hit.tokens) if hit is not None else None
        warm.ran("m", tokens, naive_node(i, answer))
        answers.append(answer)
    return answers


@pytest.mark.parametrize("capacity", [None, 4096])
def test_lists_numpy_rust_and_0_1_7_agree(
    tmp_path: Path, prompts: List[npt.NDArray[np.uint32]], capacity: Optional[int]
) -> None:
    rust, _, nanos = sw._native._replay_rust(tmp_path / "rust.redb", "m", prompts, capacity=capacity)
    assert len(rust) == len(prompts) == len(nanos)
    with sw.Warm.open(tmp_path / "list.redb", capacity=capacity) as warm:
        from_lists = replay(warm, prompts, as_list=True)
    with sw.Warm.open(tmp_path / "numpy.redb", capacity=capacity) as warm:
        from_numpy = replay(warm, prompts, as_list=False)
        entries = warm.stats().entries
    model = Model017(capacity if capacity is not None else sw.DEFAULT_CAPACITY)
    from_model: List[Answer] = []
    for i, prompt in enumerate(prompts):
        answer = model.warmest(prompt)
        model.ran(prompt, naive_node(i, answer))
        from_model.append(answer)
    assert from_lists == rust
    assert from_numpy == rust
    assert from_model == rust
    warm_answers = sum(a is not None for a in rust)
    assert warm_answers > len(prompts) // 4, "the trace's conversations are answered warm"
    assert entries == len(model.by_prefix), "the file holds what 0.1.7 holds"
    if capacity is not None:
        assert entries <= capacity


def test_warm_nodes_and_prefixes_agree_with_rust(tmp_path: Path, prompts: List[npt.NDArray[np.uint32]]) -> None:
    some = prompts[:600]
    _, rust_lists, _ = sw._native._replay_rust(tmp_path / "rust.redb", "m", some, warm_nodes=True)
    with sw.Warm.open(tmp_path / "py.redb") as warm:
        for i, prompt in enumerate(some):
            listed = warm.warm_nodes("m", prompt)
            assert [(h.node, h.tokens) for h in listed] == rust_lists[i], f"request {i}"
            # Hashed once, used twice: the same answer as the plain calls.
            prefix = warm.prefix("m", prompt)
            assert prefix.tokens == len(prompt) // 64 * 64 and prefix.model == "m"
            hit = warm.warmest_prefix(prefix)
            assert hit == warm.warmest("m", prompt)
            assert warm.warm_nodes_prefix(prefix) == listed
            assert (hit is None and not listed) or (hit is not None and listed and listed[0] == hit)
            warm.ran_prefix(prefix, naive_node(i, (hit.node, hit.tokens) if hit else None))


def test_tenants_agree_with_rust_and_never_share(tmp_path: Path, prompts: List[npt.NDArray[np.uint32]]) -> None:
    some = prompts[:300]
    rust, _, _ = sw._native._replay_rust(tmp_path / "rust.redb", "m", some, tenant="tenant-42")
    with sw.Warm.open(tmp_path / "py.redb") as warm:
        answers: List[Answer] = []
        for i, prompt in enumerate(some):
            hit = warm.warmest("m", prompt, tenant="tenant-42")
            answer = (hit.node, hit.tokens) if hit else None
            warm.ran("m", prompt, naive_node(i, answer), tenant=b"tenant-42")
            answers.append(answer)
        assert answers == rust
        assert all(warm.warmest("m", p) is None for p in some), "the model's own namespace is not the tenant's"
        assert all(warm.warmest("m", p, tenant="tenant-7") is None for p in some)
        assert warm.prefix("m", some[0], tenant="t").has_tenant


def test_every_token_container_gives_the_same_answer(tmp_path: Path, prompts: List[npt.NDArray[np.uint32]]) -> None:
    prompt = prompts[3]
    with sw.Warm.open(tmp_path / "w.redb") as warm:
        warm.ran("m", prompt, "node-a")
        want = sw.Hit("node-a", len(prompt) // 64 * 64)
        as_list = prompt.tolist()
        containers = [
            prompt,
            as_list,
            tuple(as_list),
            array.array("I", as_list),
            memoryview(array.array("I", as_list)),
            np.frombuffer(prompt.tobytes(), dtype=np.uint32),
            np.asarray(prompt, dtype="<u4"),
            iter(as_list),
            (t for t in as_list),
            [np.uint32(t) for t in as_list[:300]] + as_list[300:],
            np.array(prompt, copy=True)[:],
        ]
        for tokens in containers:
            assert warm.warmest("m", tokens) == want, type(tokens)
        # A read-only array is read in place as well.
        frozen = prompt.copy()
        frozen.setflags(write=False)
        assert warm.warmest("m", frozen) == want
        # A slice is a view: its own prefix.
        assert warm.warmest("m", prompt[:200]) == sw.Hit("node-a", 192)
        assert warm.warmest("m", prompt[:127]) is None
        assert warm.warmest("m", np.zeros(0, dtype=np.uint32)) is None
        assert warm.warmest("m", []) is None


def test_hit_is_a_value() -> None:
    hit = sw.Hit("n", 128)
    assert (hit.node, hit.tokens, hit.tier, hit.gpu_tokens) == ("n", 128, "gpu", 128)
    assert hit == sw.Hit("n", 128, "gpu", 128) and hit != sw.Hit("n", 192) and hit != sw.Hit("n", 128, "cpu", 0)
    assert len({hit, sw.Hit("n", 128)}) == 1
    assert repr(hit) == "Hit(node='n', tokens=128, tier='gpu', gpu_tokens=128)"
    assert sw.Hit.__match_args__ == ("node", "tokens", "tier", "gpu_tokens")
    with pytest.raises(ValueError):
        sw.Hit("n", 128, "tape")
