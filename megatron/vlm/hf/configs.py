"""config.json -> ModelSpec (+ HFInfo) and back, by the model family whose reader recognizes the config
(``FamilyRuntime.hf``, an ``HFSide``, in each family's folder)."""
from __future__ import annotations

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import ModelSpec

from omnibal_ext.model.families import FAMILIES

from megatron.vlm.stage.components import runtime_family
from megatron.vlm.hf.config import HFSide

from .config import HFConfigError, HFInfo, read_config  # noqa: F401  (read_config: callers take both from here)


def config_reader(cfg: dict, where: str = "config.json") -> HFSide:
    """The HF side of the registered family whose config reader recognizes ``cfg``."""
    sides = {name: family.load_runtime().hf for name, family in FAMILIES.items() if family.runtime}
    for side in sides.values():
        if side is not None and side.recognizes(cfg):
            return side
    raise HFConfigError(f"{where}: model_type {cfg.get('model_type')!r} / architectures {cfg.get('architectures')} "
                        f"is no model family with a Hugging Face reader "
                        f"({', '.join(n for n, side in sides.items() if side is not None)})")


def hf_side(spec: ModelSpec):
    """The HF side (``HFSide``) of ``spec``'s family; a UserError where it has none."""
    side = runtime_family(spec).hf
    if side is None:
        raise UserError(f"model family {spec.family!r} has no Hugging Face side (FamilyRuntime.hf)")
    return side


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of a ``config.json``, read by the family that recognizes it."""
    return config_reader(cfg, where).spec_from_config(cfg, name, where)


def native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """The config.json an export of ``spec`` writes (its family's ``native_config``)."""
    return hf_side(spec).native_config(spec, info, source)
