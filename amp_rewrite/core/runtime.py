"""Helpers shared by the adapters: GC pausing, option normalising."""
from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic collector for the duration of a pass.

    A model's IR is millions of objects with nothing cyclic to free; the collector rescanning
    them while the pass allocates cost more than the pass itself (measured on a 50k-node ONNX
    model and on BERT-base's fx graph).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def listed(items: Iterable | str | os.PathLike) -> tuple:
    """Options that take several paths or patterns also take one: a bare string is one item,
    not a list of characters (``keep_fp32="*"`` would otherwise pin every node)."""
    return (items,) if isinstance(items, (str, os.PathLike)) else tuple(items)
