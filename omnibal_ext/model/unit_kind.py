"""One kind of unit of a model, declared in one place: a ``UnitKind``.

Every unit of a model's unit list (``omnibal_ext.model.units``) is of one kind, and its kind says all there is to know
about it:

* ``name``: the family's name for the kind (a profile's, a cost table's and a report's ``kind``; unique within the
  family);
* ``role``: its layout letter (``spec.ROLES``): what the layout syntax, the partition search and the recompute planner
  see of it;
* ``cost``: the ``CostComponent`` class that prices one unit of it for one micro-batch on one TP rank (tensor-free:
  FLOPs, parameters, activation bytes, TP/EP bytes); ``cost_of(spec)`` binds it to a model;
* ``runtime``: ``"module:Class"`` of its run-time component (``megatron.vlm.stage.components.RuntimeComponent``: the
  module it builds from megatron-core parts, its forward, its checkpoint keys, how the profiler runs one unit);
* ``reads``: the parts of a micro-batch a stage holding it needs (``megatron.vlm.stage.micro_batch.StageInputs``
  fields: "pixels", "tokens", "labels", "packing"); a stage reads the union of its units' kinds';
* ``hf``: ``"module:function"`` of its Hugging Face mapping, ``(unit, table) -> None``, which adds the unit's tensors
  to a ``megatron.vlm.hf.recipes.Table`` (our key -> the HF tensors it is made of); "" for a kind without one.

Why two of them are names, not objects: the planner path (``omnibal plan``, ISF, the partition search) runs where
torch, megatron-core and transformers are not installed, and a run-time component or an HF mapping cannot be defined
without them. A declaration that names them keeps the whole kind in one object that imports without torch; the
planners read ``name``, ``role`` and ``cost`` only. The trainer, the profiler and the HF converter import the named
parts on first use (``resolve``) and check them then (``megatron.vlm.stage.components.runtime_of``,
``megatron.vlm.hf.keys.hf_mapping_of``): a name that does not resolve to what it must is a ``TypeError`` naming the
kind (a bug of its family).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from .components import CostComponent
from .spec import ROLES, ModelSpec


@dataclass(frozen=True)
class UnitKind:
    """One kind of unit (module docstring): name, role, cost, and where its run-time component and its Hugging Face
    mapping live. ``reads`` takes any iterable of part names (held as a frozenset)."""

    name: str
    role: str
    cost: type[CostComponent]
    runtime: str = ""
    reads: frozenset[str] = frozenset()
    hf: str = ""

    def __post_init__(self):
        if self.role not in ROLES:
            raise TypeError(f"unit kind {self.name!r}: role {self.role!r} is no layout letter ({', '.join(ROLES)})")
        if not (isinstance(self.cost, type) and issubclass(self.cost, CostComponent)):
            raise TypeError(f"unit kind {self.name!r}: cost {self.cost!r} is no CostComponent class")
        for field, ref in (("runtime", self.runtime), ("hf", self.hf)):
            if ref and ref.count(":") != 1:
                raise TypeError(f"unit kind {self.name!r}: {field} {ref!r} is not 'module:attribute'")
        object.__setattr__(self, "reads", frozenset(self.reads))

    def cost_of(self, spec: ModelSpec) -> CostComponent:
        """Its cost component bound to ``spec`` (and to this kind: its ``kind`` and ``code``)."""
        return self.cost(spec, self)

    def load_runtime(self) -> Any:
        """The object ``runtime`` names, imported on first use (the planners never call this: it imports torch)."""
        if not self.runtime:
            raise UserError(f"unit kind {self.name!r} has no run-time side (UnitKind.runtime is empty)")
        return resolve(self.runtime)

    def load_hf(self) -> Any:
        """The object ``hf`` names, imported on first use."""
        if not self.hf:
            raise UserError(f"unit kind {self.name!r} has no Hugging Face mapping (UnitKind.hf is empty)")
        return resolve(self.hf)


# one entry of a family's unit list: (global name, kind, layer number or None)
UnitEntry = tuple[str, UnitKind, int | None]


def resolve(ref: str) -> Any:
    """The attribute ``ref`` (``"module:attribute"``) names, its module imported by name."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)
