"""The tests' one view of the family registry (``megatron.vlm.families`` and its planning side
``omnibal_ext.model.families``): which families are registered, what each declares, and a snapshot of the registry
that a worker pool puts back after every case. Re-point this module, and only it, when the registry moves.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    """The registered families of both sides, by name."""

    runtime: tuple
    planning: tuple


def snapshot() -> Snapshot:
    from megatron.vlm import families as runtime
    from omnibal_ext.model import families as planning

    return Snapshot(tuple(runtime.FAMILIES.items()), tuple(planning.FAMILIES.items()))


def restore(saved: Snapshot) -> None:
    """Exactly the families of ``saved`` registered again (those registered since are gone)."""
    from megatron.vlm import families as runtime
    from omnibal_ext.model import families as planning

    runtime.FAMILIES.clear()
    runtime.FAMILIES.update(saved.runtime)
    planning.FAMILIES.clear()
    planning.FAMILIES.update(saved.planning)
