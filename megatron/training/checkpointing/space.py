"""Disk space for checkpoints: an estimate of one checkpoint's size, the start-of-run check of ``--save``, and
telling a full disk from other failures of a save."""
from __future__ import annotations

import errno
import shutil

from omnibal_ext.model.cost_model import unit_param_counts

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# torch.save's zip writer reports a failed write without its errno (e.g. "[enforce fail at inline_container.cc:672]
# . unexpected pos 704 vs 598", "PytorchStreamWriter failed writing file"): judged by the free space left
_TORCH_WRITER = ("inline_container", "PytorchStreamWriter")
_NEARLY_FULL = 1 << 20  # bytes: less free than this after a failed write is a full disk
# what the parameter count leaves out (padded vocabulary rows, RNG, data and scheduler state, the files' metadata):
# the weights and moments counted were 88% and 90% of tiny's checkpoint files (2026-12-03, with and without a frozen
# ViT), so the estimate adds 15%: a warning rather comes one checkpoint early than one late
MARGIN = 1.15


def checkpoint_bytes(spec, trains: tuple[bool, ...] | None, bf16: bool) -> int:
    """About the bytes of one checkpoint of model ``spec`` (trains: per unit, whether it trains; None: all): every
    weight (2 bytes in bf16, else 4) and, per trained parameter, Adam's two fp32 moments and, in bf16, its fp32 main
    copy, plus ``MARGIN`` for what the count leaves out (LoRA adapters are not counted)."""
    counts = unit_param_counts(spec)
    trained = sum(n for n, t in zip(counts, trains or [True] * len(counts)) if t)
    return int(MARGIN * (sum(counts) * (2 if bf16 else 4) + trained * (12 if bf16 else 8)))


def free_bytes(folder: str) -> int:
    return shutil.disk_usage(folder).free


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def space_warning(folder: str, need: int, free: int) -> str | None:
    """The start-of-run warning when fewer than two checkpoints of ``need`` bytes fit in ``free`` bytes (a save
    writes the new checkpoint before pruning the old ones), else None."""
    if free >= 2 * need:
        return None
    fit = "not even one" if free < need else "only one"
    return (f"> warning: --save {folder}: {gib(free)} free, {fit} checkpoint of about {gib(need)} fits (a save needs "
            "room for the new checkpoint before --keep-checkpoints removes old ones)")


def _causes(error: BaseException):
    """``error``, its causes and contexts, and the per-rank failures a PyTorch DCP CheckpointException carries."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # {rank: (exception, traceback)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def write_failure(error: BaseException, folder: str) -> str | None:
    """What went wrong writing into ``folder`` when ``error`` is a failed write ("no space left on device", or
    another OSError's message); None when it is not one (a bug)."""
    causes = list(_causes(error))
    oserrors = [e for e in causes if isinstance(e, OSError) and e.errno is not None]
    if any(e.errno in _NO_SPACE for e in oserrors):
        return "no space left on device"
    if any(any(mark in str(e) for mark in _TORCH_WRITER) for e in causes) and free_bytes(folder) < _NEARLY_FULL:
        return "no space left on device"
    if oserrors:
        return f"{oserrors[0].strerror} ({type(oserrors[0]).__name__})"
    return None
