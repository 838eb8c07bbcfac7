"""Qwen2.5-VL at run time: its ``FamilyRuntime`` (``Family.runtime`` names it). Modules: ``modules``; components:
``components``; HF config, names and tensor recipes: ``hf``; the logits-check micro-batches and the training data
side are the Qwen lineage's (``megatron.vlm.lineages.qwen``: ``batch``, ``data``)."""
from __future__ import annotations

from . import hf
from .components import FullLayer, Merger, VisionEmbed, WindowLayer
from .modules import vision_config
from megatron.vlm.hf.config import HFSide
from megatron.vlm.lineages.qwen import batch
from megatron.vlm.lineages.qwen.data import QWEN_DATA
from megatron.vlm.lineages.qwen.text import ImageTextEmbed, MRopeTextLayer
from megatron.vlm.stage.components import FamilyRuntime, Head

RUNTIME = FamilyRuntime(
    components=(VisionEmbed, WindowLayer, FullLayer, Merger, ImageTextEmbed, MRopeTextLayer, Head),
    vision_config=vision_config,
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names, logits_batch=batch.logits_batch,
              structure_twin=hf.structure_twin),
    data=QWEN_DATA)
