"""Process-level helpers shared by the adapters."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


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
