"""What every family's HF ``config.json`` reader shares: ``read_config``, ``HFInfo``, ``HFConfigError``, ``HFSide``
(a family's HF side), the padded vocabulary and the field checks (``require``, ``refuse``, ``square``). Which
family reads a config is decided in ``megatron.vlm.hf.configs`` (``spec_from_config``, ``native_config``); each
family's reader lives in its folder (``megatron/vlm/families/<name>/hf.py``), the text decoders' in
``megatron.vlm.hf.text_configs``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import ModelSpec

VOCAB_MULTIPLE = 128  # padded vocabulary rows: the real size rounded up to this (Megatron's default)


class HFConfigError(UserError):
    """A config.json this converter cannot read or whose model it does not implement."""


@dataclasses.dataclass(frozen=True)
class HFInfo:
    """What the ModelSpec does not say about an HF checkpoint."""

    layout: str  # the family's checkpoint layout: "native" (what transformers writes) or the family's other one
    text_family: str  # the LLM's text model_type (a reader of ``megatron.vlm.hf.text_configs``)
    vit_layers_in_checkpoint: int  # HF ViT layers (the spec may build fewer: a feature layer before the last)
    image_token_id: int | None  # None: not in the config (the tokenizer's image context token)
    image_seq_length: int | None = None
    video_token_id: int | None = None  # None: not in the config (or a family without video tokens)
    # the stacked (3-D) tensors the files hold transposed, by name within a layer (fused experts as some
    # published files hold them): only the shapes say it (``HFSide.checkpoint_info``)
    transposed: tuple[str, ...] = ()
    # the experts stored stacked (``mlp.experts.gate_up_proj`` / ``down_proj``) rather than one tensor per expert,
    # for a family whose files hold either (its ``HFSide.checkpoint_info`` says which was read)
    fused_experts: bool = False

    def __post_init__(self):
        object.__setattr__(self, "transposed", tuple(self.transposed or ()))
        object.__setattr__(self, "fused_experts", bool(self.fused_experts))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HFInfo":
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise HFConfigError(f"--hf-checkpoint {folder}: no config.json there (a Hugging Face model folder has "
                            "config.json and *.safetensors)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}: not valid JSON ({e})") from None


def require(cfg: dict, key: str, where: str):
    """``cfg[key]``; an HFConfigError naming ``where`` and the key when it is missing (or null)."""
    if key not in cfg or cfg[key] is None:
        raise HFConfigError(f"{where}: the key {key!r} is missing")
    return cfg[key]


def refuse(cfg: dict, key: str, where: str, ok, what: str) -> None:
    """An HFConfigError naming the key when ``cfg`` sets ``key`` (not null) to a value ``ok`` refuses; ``what``
    says what is implemented."""
    if key in cfg and cfg[key] is not None and not ok(cfg[key]):
        raise HFConfigError(f"{where}: {key} = {cfg[key]!r} is not implemented ({what})")


def square(v, key: str, where: str) -> int:
    """A side in px or patches written as one int or a list of equal ones (``[14, 14]``); unequal ones are refused."""
    if isinstance(v, (list, tuple)):
        if not v or len(set(v)) != 1:
            raise HFConfigError(f"{where}: {key} {v} is not square; only square tiles and patches are implemented")
        v = v[0]
    return int(v)


def padded_vocab(real: int) -> int:
    return -(-real // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _none_skipped(info: "HFInfo", spec: ModelSpec, names: set[str], style: str) -> set[str]:
    return set()


def _info_as_config_says(info: "HFInfo", spec: ModelSpec, reader) -> "HFInfo":
    return info


@dataclasses.dataclass(frozen=True)
class HFSide:
    """A family's Hugging Face side (``FamilyRuntime.hf``).

    recognizes(cfg): whether a config.json is the family's; spec_from_config(cfg, name, where) -> (ModelSpec,
    HFInfo); native_config(spec, info, source) -> the config.json an export writes; names(info, style): its HF
    tensor names (the GPT decoder's: ``embed()``, ``llm_layer(i)``, ``final_norm()``, ``head``; style "legacy"
    as checkpoints hold them, "modern" the in-memory names); logits_batch(inputs, spec, info): the micro-batch of
    one sample from transformers' own inputs (``megatron.vlm.hf.logits``); structure_twin(spec): a tiny model of
    ``spec``'s structure (same units, per-layer features and checkpoint objects: ``megatron.vlm.hf.convert``);
    skipped_names(info, spec, names, style): HF tensors it leaves out on purpose (default: none);
    checkpoint_info(info, spec, reader): ``info`` with what only the files' tensor headers say (a layout of
    some tensors: ``HFInfo.transposed``; default: ``info`` as the config gave it)."""

    recognizes: Callable[[dict], bool]
    spec_from_config: Callable[..., "tuple[ModelSpec, HFInfo]"]
    native_config: Callable[[ModelSpec, "HFInfo", "dict | None"], dict]
    names: Callable[["HFInfo", str], object]
    logits_batch: Callable[[dict, ModelSpec, "HFInfo"], "MicroBatch"]
    structure_twin: Callable[[ModelSpec], ModelSpec]
    skipped_names: Callable[["HFInfo", ModelSpec, set, str], set] = _none_skipped
    checkpoint_info: Callable[["HFInfo", ModelSpec, object], "HFInfo"] = _info_as_config_says
