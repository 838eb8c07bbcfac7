"""Which checkpoints of a ``--save`` folder are this run's lineage, and which a save prunes.

A run's lineage is the checkpoint it continues from, when that is in its ``--save`` folder, with the older ones
there, and then its own saves. Anything else in the folder is another lineage: checkpoints after the one a
run rolls back to (``--load DIR --ckpt-step 10 --save DIR``), or all of them when the run does not continue from
this folder (a fresh start, or ``--load`` of another folder). Before its first save, rank 0 moves those, and the
tracker when it names one of them, to ``DIR/superseded/<time>/``, and says so: nothing is deleted, and the
folder's tracker and ``iter_*`` folders are then this lineage's alone (``--load DIR`` continues it; moving the
folders back returns to the other lineage).

``--keep-checkpoints N`` then keeps the newest N of the lineage, the one just saved (which the tracker names)
among them; it never removes a checkpoint newer than the one just saved.
"""
from __future__ import annotations

import os
import time

from .files import fsync_dir, write_text
from .layout import TRACKER, complete_iterations, iteration_dir

SUPERSEDED = "superseded"


def other_lineage(iterations: list[int], continues_from: int | None) -> list[int]:
    """The ``iterations`` (a folder's complete checkpoints) that are not of the lineage of a run continuing from
    checkpoint ``continues_from`` of that folder (None: from none of them)."""
    return [i for i in iterations if continues_from is None or i > continues_from]


def to_prune(iterations: list[int], saved: int, keep: int | None) -> list[int]:
    """The checkpoints a save of iteration ``saved`` removes under ``--keep-checkpoints keep`` (None: none): of
    those up to ``saved``, all but the newest ``keep``; never one after ``saved``."""
    if not keep:
        return []
    return [i for i in iterations if i <= saved][:-keep]


def _listed(iterations: list[int]) -> str:
    shown = ", ".join(map(str, iterations[:6]))
    return shown + (f", ..., {iterations[-1]} ({len(iterations)} checkpoints)" if len(iterations) > 6 else "")


def set_aside(root: str, continues_from: int | None, stamp: str | None = None) -> str | None:
    """Move the checkpoints of ``root`` that are not this run's lineage (``other_lineage``) and the tracker to
    ``root/superseded/<stamp>/``; write a tracker naming ``continues_from`` when it is in ``root``. Returns the
    log line, None when nothing was moved. Rank 0 alone calls it, before the run's first save."""
    others = other_lineage(complete_iterations(root), continues_from)
    if not others:
        return None
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    aside = os.path.join(root, SUPERSEDED, stamp)
    os.makedirs(aside)
    for i in others:
        os.rename(iteration_dir(root, i), iteration_dir(aside, i))
    tracker = os.path.join(root, TRACKER)
    if os.path.exists(tracker):
        os.rename(tracker, os.path.join(aside, TRACKER))
    if continues_from is not None:
        write_text(tracker, str(continues_from))
    fsync_dir(root)
    why = (f"this run continues from its iteration {continues_from}" if continues_from is not None else
           "this run does not continue from a checkpoint of this folder")
    return (f"> --save {root}: {why}, so its checkpoints of iterations {_listed(others)} are another lineage: moved "
            f"with the tracker to {aside} (nothing deleted; move them back to return to that lineage)")
