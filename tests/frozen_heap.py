"""Keeping a long test process's garbage collections cheap (the suite's pytest process, a worker pool's ranks).

A full collection scans every object the collector tracks: in a process that imported torch, megatron-core and
transformers (about 490,000 objects) it takes 0.24 s, more as tests cache models. The suite's processes collect
often: a pool rank after every case (``pool_worker.CaseState.restore``), and Energon's loaders at each iterator's
start (``GcDataset``: ``gc.collect(); gc.freeze()``, then ``gc.unfreeze()`` at its end). Measured on 2026-12-03, the
unit tier spent 37 s of its 207 in collections. So what has survived so far (the imports, session fixtures, caches)
is frozen out of the collector's sight (``freeze_survivors``), and Energon's ``gc.unfreeze`` is kept from putting it
back (``keep_frozen_through_energon``): a collection then scans only what came since.
"""
from __future__ import annotations

import gc
import types

from megatron.energon.wrappers import gc_dataset


def freeze_survivors() -> None:
    """Collect (what the tests so far left in reference cycles), then freeze what survived."""
    gc.collect()
    gc.freeze()


def keep_frozen_through_energon() -> None:
    """Energon's ``GcDataset`` without its ``gc.unfreeze`` (its collections and its freeze stay): what it froze at a
    loader's start stays frozen after it, with what was frozen before."""
    names = {name: getattr(gc, name) for name in dir(gc) if not name.startswith("_")}
    gc_dataset.gc = types.SimpleNamespace(**{**names, "unfreeze": lambda: None})
