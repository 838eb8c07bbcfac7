"""Logits of our model on an HF folder (the check against transformers: scripts/hf_logits.py).

Inputs are transformers' own, turned into a micro-batch by the model family (``HFSide.logits_batch``):
``input_ids [1, s]`` with the image tokens already expanded, ``pixel_values`` (tiles ``[tiles, 3, H, W]`` or
patch rows ``[patches, C*T*P*P]``) and the family's own fields (``image_grid_thw [n, 3]``, ``mm_token_type_ids
[1, s]``, ...). Output: float32 logits ``[s, real vocab]``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, parallel_state as ps

from omnibal_ext.errors import UserError
from omnibal_ext.model.lora import Lora
from omnibal_ext.model.units import build_units

from .load import load_hf_into_stage
from megatron.vlm.hf.configs import hf_side
from megatron.vlm.layers.moe import MoERun
from megatron.vlm.stage.build import StageBuild, build_stage


def make_batch(src, inputs: dict) -> dict:
    """A micro-batch of one sample from transformers' inputs (the family's ``logits_batch``)."""

    return hf_side(src.spec).logits_batch(inputs, src.spec, src.info)


def logits_stage(spec, unit_range, img_context_id: int, tp: int = 1, pp: int = 1, lora=None, ep: int = 1,
                 etp: int | None = None):
    """A stage of ``spec`` in logits mode (the last stage returns this TP rank's logits), fp32, eval; ``lora``: its
    LoRA adapters (``omnibal_ext.model.lora.Lora``; None: none); ``ep`` / ``etp``: the experts' EP / ETP sizes (ETP
    None: TP). MoE layers under TP > 1 run with sequence parallelism, as megatron-core's MoELayer needs (the
    trainer's --sequence-parallel)."""


    moe = spec.language.moe is not None
    run = MoERun(ep=ep, etp=etp or tp) if moe else None
    return build_stage(StageBuild(spec, unit_range, tp=tp, pp=pp, img_context_id=img_context_id, seed=0,
                                  output="logits", lora=lora or Lora(), moe_run=run,
                                  sequence_parallel=moe and tp > 1)).eval()


def image_token_id(src, given: int | None = None) -> int:
    tid = given if given is not None else src.info.image_token_id
    if tid is None:
        raise UserError(f"--hf-checkpoint {src.folder}: config.json has no image_token_id; give --image-token-id")
    return int(tid)


def gather_vocab(logits: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """This TP rank's [t, 1, V/tp] logits -> all of them [t, real vocab] (fp32)."""

    logits = logits.float().squeeze(1)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(logits) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[:, :real_vocab]


def chained_logits(src, inputs: dict, cuts: list[int] = (), img_context_id: int | None = None) -> torch.Tensor:
    """In one process (TP1): the model split into stages at unit indices ``cuts``, each stage built and loaded
    on its own, each stage's output handed to the next as the pipeline's P2P hands it (the hidden states with the
    side tensors live at that cut packed in by the stage: ``megatron.vlm.stage.side.pack``, unpacked by the next stage
    with the rows of its ``DataSide.side_rows``); [s, real vocab]."""

    spec = src.spec
    n = len(build_units(spec))
    bounds = [0, *cuts, n]
    batch = make_batch(src, inputs)
    x = None
    with torch.no_grad():
        for a, b in zip(bounds[:-1], bounds[1:]):
            stage = logits_stage(spec, range(a, b), image_token_id(src, img_context_id), pp=len(bounds) - 1)
            load_hf_into_stage(stage, src)
            stage.set_input_tensor(x)
            x = stage(batch)
    return gather_vocab(x, spec.language.vocab_real)


def pad_token_id(src, img_context_id: int | None = None) -> int:
    """A text token to pad an input with: the smallest id that is neither the image nor the video token."""
    special = {image_token_id(src, img_context_id), src.info.video_token_id}
    return next(t for t in range(len(special) + 1) if t not in special)


def padded_inputs(inputs: dict, tokens: int, pad_id: int) -> dict:
    """transformers' one-sample ``inputs`` with ``pad_id`` text tokens appended up to ``tokens`` (``input_ids``, and
    ``mm_token_type_ids`` / ``attention_mask`` where given: 0 / 1). Attention is causal, so the logits of the real
    tokens do not change: the caller drops the padding's rows."""
    ids = inputs["input_ids"]
    extra = tokens - ids.shape[-1]
    if extra <= 0:
        return inputs
    fill = {"input_ids": pad_id, "mm_token_type_ids": 0, "attention_mask": 1}
    return {k: torch.cat([v, torch.full((*v.shape[:-1], extra), fill[k], dtype=v.dtype)], dim=-1) if k in fill else v
            for k, v in inputs.items()}


def pipeline_logits(src, inputs: dict, layout, img_context_id: int | None = None) -> torch.Tensor | None:
    """Under torchrun (megatron's groups started at TP/PP and EP/ETP): this rank's stage of ``layout``, forward
    only, hidden states passed point to point along the pipeline. Returns the logits on the last stage, else None.
    MoE layers at TP > 1 run sequence parallel: the input is padded to a multiple of TP (``padded_inputs``) and the
    padding's logits dropped."""


    spec = src.spec
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    rank = ps.get_pipeline_model_parallel_rank()
    real = int(inputs["input_ids"].shape[-1])
    if spec.language.moe is not None and tp > 1:  # the MoE layers run sequence parallel: tokens a multiple of TP
        inputs = padded_inputs(inputs, -(-real // tp) * tp, pad_token_id(src, img_context_id))
    batch = make_batch(src, inputs)
    stage = logits_stage(spec, layout.stage_range(rank), image_token_id(src, img_context_id), tp, pp, ep=ep, etp=etp)
    load_hf_into_stage(stage, src)
    with torch.no_grad():
        x = None
        if rank > 0:
            shape = torch.empty(3, dtype=torch.int64)
            dist.recv(shape, src=ps.get_pipeline_model_parallel_prev_rank())
            x = torch.empty(tuple(shape.tolist()), dtype=torch.float32)
            dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
        stage.set_input_tensor(x)
        y = stage(batch)
        if rank < pp - 1:
            dist.send(torch.tensor(y.shape, dtype=torch.int64), dst=ps.get_pipeline_model_parallel_next_rank())
            dist.send(y.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    return gather_vocab(y, spec.language.vocab_real)[:real]
