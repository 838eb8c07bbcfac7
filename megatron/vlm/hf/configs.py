"""config.json -> ModelSpec (+ HFInfo) and back, by the model family whose reader recognizes the config
(``RuntimeFamily.hf``, an ``HFSide``, in each family's folder)."""
from __future__ import annotations

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import ModelSpec

from megatron.vlm.families import FAMILIES, runtime_family

from .config import HFConfigError, HFInfo, read_config  # noqa: F401  (read_config: callers take both from here)


def config_family(cfg: dict, where: str = "config.json"):
    """The runtime family whose HF config reader recognizes ``cfg``."""
    for family in FAMILIES.values():
        if family.hf is not None and family.hf.recognizes(cfg):
            return family
    raise HFConfigError(f"{where}: model_type {cfg.get('model_type')!r} / architectures {cfg.get('architectures')} "
                        f"is no model family with a Hugging Face reader "
                        f"({', '.join(n for n, f in FAMILIES.items() if f.hf is not None)})")


def hf_side(spec: ModelSpec):
    """The HF side (``HFSide``) of ``spec``'s family; a UserError where it has none."""
    family = runtime_family(spec)
    if family.hf is None:
        raise UserError(f"model family {family.name!r} has no Hugging Face side (RuntimeFamily.hf)")
    return family.hf


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of a ``config.json``, read by the family that recognizes it."""
    return config_family(cfg, where).hf.spec_from_config(cfg, name, where)


def native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """The config.json an export of ``spec`` writes (its family's ``native_config``)."""
    return hf_side(spec).native_config(spec, info, source)
