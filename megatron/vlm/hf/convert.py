"""Offline conversion between an HF folder (any family with an HF side) and a trainer
checkpoint (``omnibal hf import|export``).

import: config.json -> ModelSpec; every HF tensor -> our unit-keyed global tensor (fp32, vocabulary padded)
        -> a weights-only checkpoint at iteration 0 (``SAVE/iter_0000000`` + tracker + manifest) whose common
        state holds "run" (with the model spec and, under "hf", the source config, layout, key style, dtype and
        folder) and "iteration" 0. ``pretrain_vlm.py --load SAVE`` loads it at any TP/PP/layout.
export: any checkpoint of ours (any TP/PP/DP/layout) -> config.json + safetensors in the native HF layout
        (the imported key style), vocabulary unpadded, a tied head written once (as the embedding), tokenizer
        files copied from the training's tokenizer (or the imported folder). LoRA adapters (``lora_a``/``lora_b``
        beside a weight) are merged into it, ``W + alpha / r * B @ A`` (``megatron.vlm.layers.lora.merge``), so the
        folder is a plain HF checkpoint.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories

from omnibal_ext.errors import UserError
from omnibal_ext.model.units import ModelSpec, build_units

from .config import HFInfo, read_config
from .configs import hf_side, spec_from_config
from .keys import check_names, hf_names, recipes
from .reader import HFCheckpoint
from .recipes import detect_style
from megatron.vlm.stage.build import StageBuild, build_stage

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class HFSource:
    """An HF folder opened for conversion: config, spec, info, tensors, key style."""

    folder: str
    config: dict
    spec: ModelSpec
    info: HFInfo
    reader: HFCheckpoint
    style: str

    @classmethod
    def open(cls, folder: str, check: bool = True) -> "HFSource":
        cfg = read_config(folder)
        name = "hf:" + os.path.basename(os.path.normpath(folder))
        spec, info = spec_from_config(cfg, name, os.path.join(folder, "config.json"))
        reader = HFCheckpoint(folder)

        info = hf_side(spec).checkpoint_info(info, spec, reader)
        style = detect_style(reader.names())
        src = cls(folder, cfg, spec, info, reader, style)
        if check:
            _, shapes = recipes(spec, info, style)
            check_names(shapes, reader, spec, info, style, folder, tied_equal=src._check_tied_head)
        return src

    def _check_tied_head(self, head: str) -> None:
        emb = hf_names(self.spec, self.info, self.style).embed()
        if not torch.equal(self.reader.get(head), self.reader.get(emb)):
            raise UserError(f"--hf-checkpoint {self.folder}: tie_word_embeddings is set but {head} differs from {emb}")

    def dtype_name(self) -> str:
        first = sorted(self.reader.names())[0]
        return {v: k for k, v in DTYPES.items()}.get(SAFETENSORS_DTYPES.get(self.reader.dtype(first)), "float32")

    def meta(self) -> dict:
        """What export needs to write this model back (stored in the run description under "hf")."""
        return {"info": self.info.to_dict(), "style": self.style, "config": self.config, "dtype": self.dtype_name(),
                "source": os.path.abspath(self.folder)}

    def global_tensors(self, units=None, dtype=torch.float32) -> dict[str, torch.Tensor]:
        table, _ = recipes(self.spec, self.info, self.style, units)
        return {key: r.read(self.reader, dtype=dtype) for key, r in table.items()}


def structure_twin(spec: ModelSpec) -> ModelSpec:
    """A tiny model with ``spec``'s structure (unit list, per-layer features, heads): the same checkpoint keys
    and objects, for listing the ShardedObjects (modules' extra state) a checkpoint of ``spec`` holds (the
    family's ``structure_twin``)."""

    return hf_side(spec).structure_twin(spec)


def extra_state_objects(spec: ModelSpec) -> list:
    """The ShardedObjects of a TP1 whole-model stage of ``spec`` (built as its tiny structure twin)."""


    twin = structure_twin(spec)
    stage = build_stage(StageBuild(twin, range(len(build_units(twin)))))
    sd = stage.sharded_state_dict()
    apply_factories(sd)
    return [x for x in nested_values(sd) if isinstance(x, ShardedObject)]


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


