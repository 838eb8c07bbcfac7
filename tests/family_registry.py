"""The tests' one view of the family registry (``omnibal_ext.model.families``, which ``megatron.vlm.families``
fills with the built-in families when imported): which families are registered (and the tests' plugin families), what
each declares (its ``Capabilities``: the conformance suite's skips), and a snapshot of the registry that a worker pool
puts back after every case. Re-point this module, and only it, when the registry moves.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    """The registered families, (name, Family) in registration order."""

    families: tuple


def snapshot() -> Snapshot:
    from megatron.vlm import families

    return Snapshot(tuple(families.FAMILIES.items()))


def restore(saved: Snapshot) -> None:
    """Exactly the families of ``saved`` registered again (those registered since are gone)."""
    from megatron.vlm import families

    families.FAMILIES.clear()
    families.FAMILIES.update(saved.families)


# families defined by the tests' own modules, as a user's plugin would be (name -> the module that registers it)
PLUGINS = {"toy-linear-projector": "toy_family"}


def conformance_families() -> list[str]:
    """Every family the conformance suite checks: the registered ones and the tests' plugin families."""
    from megatron.vlm import families as runtime

    return sorted(runtime.FAMILIES) + [name for name in PLUGINS if name not in runtime.FAMILIES]


@contextlib.contextmanager
def registered(name: str):
    """Inside: family ``name`` registered (a plugin family imported and registered through the public ``register``,
    taken out again after; a built-in one as it is)."""
    from megatron.vlm import families as runtime

    if name not in PLUGINS or name in runtime.FAMILIES:
        yield
        return
    runtime.register(importlib.import_module(PLUGINS[name]).FAMILY)  # its first import registers it too
    try:
        yield
    finally:
        runtime.unregister(name)


def capabilities(name: str):
    """What family ``name`` declares it implements (``Capabilities``)."""
    from megatron.vlm import families as runtime

    with registered(name):
        return runtime.FAMILIES[name].capabilities


# the checks a family may not implement: check -> (the Capabilities field that declares it, what it means)
DECLARED_BY = {
    "tp2_sp": ("sequence_parallel", "sequence parallelism"),
    "cp2": ("context_parallel", "context parallelism"),
    "lora": ("lora_targets", "LoRA targets"),
    "drop_path": ("drop_path", "ViT drop path"),
}


def undeclared(name: str, check: str) -> str | None:
    """Why family ``name`` skips ``check`` (its capabilities do not declare it), or None when it runs it."""
    if check not in DECLARED_BY:
        return None
    field, what = DECLARED_BY[check]
    if getattr(capabilities(name), field):
        return None
    return f"{name} declares no {what} (Capabilities.{field})"


def transformers_reference(folder) -> tuple[str | None, str]:
    """(the transformers class of a family's HF folder, or None, why): the architecture its config.json names (the
    family's HF side writes it), when transformers has that class."""
    import json
    from pathlib import Path

    import transformers

    arch = (json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [None])[0]
    if arch and hasattr(transformers, arch):
        return arch, f"transformers' {arch}"
    return None, f"its HF side names architecture {arch}, which transformers {transformers.__version__} does not have"
