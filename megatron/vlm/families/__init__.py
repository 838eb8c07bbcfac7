"""The built-in model families, one folder each: ``megatron/vlm/families/<name>/`` holds everything a family is (its
spec, presets, costs, capabilities, runtime, data and Hugging Face sides).

Importing this package registers every built-in family in the one registry (``omnibal_ext.model.families``): the
families are found, not listed; each subpackage's ``__init__`` registers its ``Family``. This package and those
``__init__``s are tensor-free (the planner path imports them without torch, megatron-core or transformers); a
family's run-time side is imported only through ``Family.runtime``
(``megatron.vlm.stage.components.runtime_family``). A family defined elsewhere
(a plugin module named by ``--family-module``, a test) calls ``register`` itself.

Code a lineage of families shares (the Qwen ViTs, patch images, multimodal RoPE ids, video, the batcher) lives in
``megatron/vlm/lineages/``; no family folder imports another.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys

from omnibal_ext.errors import UserError
from omnibal_ext.model.families import FAMILIES, PRESETS, Family, family_of, register, unregister  # noqa: F401


def import_family_modules(modules) -> None:
    """Import each named module (``--family-module``: a module name, or a path to a .py file imported under its file
    name): a plugin that registers its family when imported. A module imported already is not run again."""
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


def _discover() -> None:
    """Import every subpackage: each registers its family."""
    for sub in pkgutil.iter_modules(__path__):
        if sub.ispkg:
            importlib.import_module(f"{__name__}.{sub.name}")


_discover()
