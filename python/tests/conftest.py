"""Shared fixtures: a slice of the conversation trace, as numpy arrays and as lists."""

from __future__ import annotations

from typing import List

import numpy as np
import numpy.typing as npt
import pytest

import mooncake

#: Requests of the trace the answer tests replay (the whole trace is 12,031).
SLICE = 1500


@pytest.fixture(scope="session")
def prompts() -> List[npt.NDArray[np.uint32]]:
    """The first ``SLICE`` prompts of the trace, as C-contiguous uint32 arrays."""
    return [r.tokens() for r in mooncake.requests(SLICE)]


@pytest.fixture(scope="session")
def prompt_lists(prompts: List[npt.NDArray[np.uint32]]) -> List[List[int]]:
    """The same prompts as lists of ints."""
    return [p.tolist() for p in prompts]
