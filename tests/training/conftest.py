"""Shared fixtures for the training tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # These models are tiny: with 2 threads on a shared 2-core box, thread hand-offs cost more
    # than the math (measured 15x slower), so run single-threaded and restore afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
