"""config.json -> ModelSpec (+ HFInfo) and back, by the model family whose reader recognizes the config
(``RuntimeFamily.hf_config``, an ``HFConfigReader``; InternVL's in ``megatron.vlm.hf.config``, Qwen2.5-VL's in
``megatron.vlm.families.qwen2_5_vl.hf``)."""
from __future__ import annotations

from omnibal_ext.model.spec import ModelSpec

from megatron.vlm.families import FAMILIES, runtime_family

from .config import HFConfigError, HFInfo, read_config  # noqa: F401  (read_config: callers take both from here)


def config_family(cfg: dict, where: str = "config.json"):
    """The runtime family whose HF config reader recognizes ``cfg``."""
    for family in FAMILIES.values():
        if family.hf_config is not None and family.hf_config.recognizes(cfg):
            return family
    raise HFConfigError(f"{where}: model_type {cfg.get('model_type')!r} / architectures {cfg.get('architectures')} "
                        f"is no model family with a Hugging Face reader "
                        f"({', '.join(n for n, f in FAMILIES.items() if f.hf_config is not None)})")


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json") -> tuple[ModelSpec, HFInfo]:
    """The ModelSpec and HFInfo of a ``config.json``, read by the family that recognizes it."""
    return config_family(cfg, where).hf_config.spec_from_config(cfg, name, where)


def native_config(spec: ModelSpec, info: HFInfo, source: dict | None) -> dict:
    """The config.json an export of ``spec`` writes (its family's ``native_config``)."""
    return runtime_family(spec).hf_config.native_config(spec, info, source)
