"""The one ordered list of pipeline units of a model, and the registry of model families
(``omnibal_ext.model.families``).

Every part of OmniBal speaks of the same units by the same names: the trainer builds a pipeline
stage from a contiguous slice of the list, the profiler and the cost model give each unit its
costs, the partition search splits the list, the recompute planner chooses over it and the
simulator replays it.  A family says which units its model has (``omnibal_ext.model.families``);
their roles come in the order of the layout letters::

    I (ViT embedding), v* (ViT layers), P (projector), E (LLM embedding), t* (LLM layers), L (head)

A list: vit.embed, vit.layer.0 .. vit.layer.{Lv-1}, projector, llm.embed, llm.layer.0 .. llm.layer.{Ll-1},
llm.head.
"""
from __future__ import annotations

import dataclasses
import itertools

from ..errors import UserError
from .components import CostComponent
from .families import FAMILIES, PRESETS, Family, default_model, family_of  # noqa: F401  (the registry; callers take it from here)
from .spec import ROLES, LanguageSpec, ModelSpec, Unit
from .unit_kind import UnitEntry


def build_units(spec: ModelSpec) -> list[Unit]:
    """The ordered unit list of ``spec``."""
    return [Unit(name, kind.name, i, kind.role, layer) for i, (name, kind, layer) in enumerate(_unit_list(spec))]


def unit_components(spec: ModelSpec) -> list[CostComponent]:
    """The cost component of every unit of ``build_units(spec)``, bound to ``spec`` (one per kind)."""
    kinds = [kind for _, kind, _ in _unit_list(spec)]
    bound = {kind: kind.cost_of(spec) for kind in dict.fromkeys(kinds)}
    return [bound[kind] for kind in kinds]


def _unit_list(spec: ModelSpec) -> list[UnitEntry]:
    """``spec``'s family's unit list, each kind checked to be one of the family's (a TypeError: a bug of the family)."""
    family = family_of(spec)
    entries = family.unit_list(spec)
    declared = {kind.name: kind for kind in family.kinds}
    for name, kind, _ in entries:
        if declared.get(getattr(kind, "name", None)) != kind:
            raise TypeError(f"family {family.name!r}: unit {name!r} is of kind {getattr(kind, 'name', kind)!r}, "
                            "which is not one of the family's kinds (Family.kinds)")
    return entries


def role_of_kind(kind: str) -> str:
    """The role (layout letter) of a unit kind of any registered family (profiles and cost tables written before
    units carried their role name only the kind)."""
    for family in FAMILIES.values():
        for declared in family.kinds:
            if declared.name == kind:
                return declared.role
    raise UserError(f"unit kind {kind!r} belongs to no known family ({', '.join(FAMILIES)})")


def spec_from_dict(d: dict) -> ModelSpec:
    """A ``ModelSpec`` from ``ModelSpec.to_dict()``; fields missing from older dicts take their defaults
    (a dict without ``family`` is of the default preset's family, the only one before there were several)."""
    d = {**d, "family": d.get("family") or PRESETS[default_model()].family}
    family = FAMILIES.get(d["family"])
    if family is None:
        raise UserError(f"model {d.get('name')!r}: unknown family {d['family']!r}; known: {', '.join(FAMILIES)}")
    fields = {f.name for f in dataclasses.fields(ModelSpec)} - {"vision", "language"}
    return ModelSpec(vision=family.vision_spec(**d["vision"]), language=family.language_spec(**d["language"]),
                     **{k: d[k] for k in fields if k in d})


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


def code_runs(codes) -> list[str]:
    """Layout letters grouped into runs in the layout syntax: ``["I", "v*4", "P"]``."""
    return [code if n == 1 else f"{code}*{n}" for code, n in ((c, len(list(g))) for c, g in itertools.groupby(codes))]


def role_summary(spec: ModelSpec) -> str:
    """The model's units by role, for messages: ``I v*4 P E t*4 L``."""
    runs = code_runs(u.code for u in build_units(spec))
    return " ".join(runs) + " (" + ", ".join(f"{c}={n}" for c, n in ROLES.items()) + ")"
