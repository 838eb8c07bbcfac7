"""Model families, runtime side: family name -> ``RuntimeFamily`` (``megatron.vlm.components``).

Each family lives in ``megatron/vlm/families/<name>/`` and gives every unit kind of its planning side
(``omnibal_ext.model.families``, registered in ``omnibal_ext.model.units.FAMILIES``) a runtime component.
Shared code reaches a unit's module, inputs, checkpoint keys and HF mapping only through them.
"""
from __future__ import annotations

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import ModelSpec, Unit

from megatron.vlm.components import RuntimeComponent, RuntimeFamily

from .internvl import INTERNVL
from .qwen2_5_vl.family import QWEN2_5_VL
from .qwen3_vl.family import QWEN3_VL

FAMILIES: dict[str, RuntimeFamily] = {INTERNVL.name: INTERNVL, QWEN2_5_VL.name: QWEN2_5_VL,
                                   QWEN3_VL.name: QWEN3_VL}


def register(family: RuntimeFamily) -> None:
    """Add (or replace) a runtime family."""
    FAMILIES[family.name] = family


def unregister(name: str) -> None:
    FAMILIES.pop(name, None)


def runtime_family(spec: ModelSpec) -> RuntimeFamily:
    try:
        return FAMILIES[spec.family]
    except KeyError:
        raise UserError(f"model {spec.name!r}: no runtime for family {spec.family!r}; "
                        f"known: {', '.join(FAMILIES)}") from None


def component_of(spec: ModelSpec, unit: Unit) -> type[RuntimeComponent]:
    """The runtime component class of ``unit`` (a unit of ``build_units(spec)``)."""
    return runtime_family(spec).component(unit.kind)


def stage_inputs(spec: ModelSpec, units):
    """What a stage holding ``units`` reads of a micro-batch (``StageInputs``): the union of their components'."""
    from megatron.vlm.batches import StageInputs

    reads = set()
    for unit in units:
        reads |= component_of(spec, unit).reads
    return StageInputs.reading(reads)
