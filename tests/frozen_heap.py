"""Keeping a long test process's garbage collections cheap (the suite's pytest process, a worker pool's ranks).

A full collection scans every object the collector tracks: in a process that imported torch, megatron-core and
transformers (about 490,000 objects) it takes 0.24 s, more as tests cache models. The suite's processes collect
often: a pool rank after every case (``pool_worker.CaseState.restore``), and Energon's loaders at each iterator's
start (``GcDataset``: ``gc.collect(); gc.freeze()``, then ``gc.unfreeze()`` at its end). Measured on 2026-12-03, the
unit tier spent 37 s of its 207 in collections. So what has survived so far (the imports, session fixtures, caches)
is frozen out of the collector's sight (``freeze_survivors``), and Energon's ``gc.freeze`` / ``gc.unfreeze`` pair is
kept from touching the frozen heap (``keep_frozen_through_energon``): a collection then scans only what came since.
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
    """Energon's ``GcDataset`` without its ``gc.freeze`` and ``gc.unfreeze`` (its collections stay).  Its unfreeze
    would put the frozen imports back in the collector's sight; its freeze, kept without the unfreeze, froze for good
    whatever was alive at a loader's start: a run's model, optimizer and process groups, whose cycles then were never
    collected (about 16 groups' gloo threads left by every Energon run in a pool rank of a world of one)."""
    names = {name: getattr(gc, name) for name in dir(gc) if not name.startswith("_")}
    gc_dataset.gc = types.SimpleNamespace(**{**names, "freeze": lambda: None, "unfreeze": lambda: None})
