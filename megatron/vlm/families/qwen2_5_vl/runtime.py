"""Qwen2.5-VL at run time: its ``FamilyRuntime`` (``Family.runtime`` names it): the ViT's config (``modules``), the HF
side (config reader and names: ``hf``) and the Qwen lineage's logits-check micro-batches and training data side
(``megatron.vlm.lineages.qwen``: ``batch``, ``data``). Its unit kinds name their components themselves (``kinds``)."""
from __future__ import annotations

from . import hf
from .modules import vision_config
from megatron.vlm.hf.config import HFSide
from megatron.vlm.lineages.qwen import batch
from megatron.vlm.lineages.qwen.data import QWEN_DATA
from megatron.vlm.stage.components import FamilyRuntime

RUNTIME = FamilyRuntime(
    vision_config=vision_config,
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names, logits_batch=batch.logits_batch,
              structure_twin=hf.structure_twin),
    data=QWEN_DATA)
