"""Model families, runtime side: family name -> ``RuntimeFamily`` (``megatron.vlm.components``).

Each family lives in ``megatron/vlm/families/<name>/`` and gives every unit kind of its planning side
(``omnibal_ext.model.families``) a runtime component. Shared code reaches a unit's module, inputs, checkpoint keys
and HF mapping only through them.

``register(family)`` is the only way in. The built-in families are found, not listed: every subpackage here with a
``family`` module is imported, and that module registers its family. A family defined elsewhere (a plugin module
named by ``--family-module``, a test) calls ``register`` itself.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil

from omnibal_ext.errors import UserError
from omnibal_ext.model import families as planning
from omnibal_ext.model.spec import ModelSpec, Unit

from megatron.vlm.components import RuntimeComponent, RuntimeFamily

FAMILIES: dict[str, RuntimeFamily] = {}  # name -> RuntimeFamily; filled by ``register`` only


def register(family: RuntimeFamily) -> RuntimeFamily:
    """Add (or replace) a family: its runtime side here and its planning side (``family.planning``) in
    ``omnibal_ext.model.families``. Returns ``family``."""
    if not isinstance(family, RuntimeFamily):
        raise TypeError(f"register: {family!r} is no megatron.vlm.components.RuntimeFamily")
    planning.register(family.planning)
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family registered by ``register``, both sides (tests)."""
    FAMILIES.pop(name, None)
    planning.unregister(name)


def import_family_modules(modules) -> None:
    """Import each named module (``--family-module``: a module name, or a path to a .py file imported under its file
    name): a plugin that registers its family when imported."""
    import os
    import sys

    for module in modules:
        if not module.endswith(".py"):
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise UserError(f"--family-module {module}: cannot import it ({e})") from None
            continue
        if not os.path.isfile(module):
            raise UserError(f"--family-module {module}: no such file")
        name = os.path.splitext(os.path.basename(module))[0]
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, module)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)


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


def _discover() -> None:
    """Import the ``family`` module of every subpackage: each registers its family."""
    for sub in pkgutil.iter_modules(__path__):
        if sub.ispkg and importlib.util.find_spec(f"{__name__}.{sub.name}.family") is not None:
            importlib.import_module(f"{__name__}.{sub.name}.family")


_discover()
