"""Tied input/output embeddings across pipeline stages.

On a stage holding the text embedding (E) and the head (L) the output layer uses the embedding's Parameter
itself; on a last stage without E the head holds a copy drawn exactly as the embedding is (E's unit seed),
kept equal by summing the two copies' gradients over the group of the two ranks holding E and L
(``build_tied_embedding_group``; ``megatron.training.interleaved.sum_tied_grads``, before the data-parallel
reduction), and marked ``shared`` so the gradient norm counts the weight once.  megatron-core's own
embedding group assumes E on the first stage, which our layouts do not promise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def build_tied_embedding_group(embed_stage: int, head_stage: int, timeout=None):
    """The process group of the ranks holding the tied embedding (pipeline stage ``embed_stage``) and the
    output layer (``head_stage``) in this rank's pipeline; None if this rank holds neither. Every rank
    must call it (it creates one group per pipeline group, in the same order everywhere).  ``timeout``: the
    group's (a ``datetime.timedelta``; None: torch.distributed's default)."""

    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(pp_ranks))
    mine = None
    for ranks in sorted({tuple(g) for g in gathered}):
        pair = [ranks[embed_stage], ranks[head_stage]]
        group = dist.new_group(pair, timeout=timeout)
        if dist.get_rank() in pair:
            mine = group
    return mine


def allreduce_tied_grad(weight: torch.Tensor, group) -> None:
    """Sum ``weight``'s accumulated gradient (``main_grad`` under megatron's DDP, else ``grad``) over ``group``."""
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        grad = weight.grad
    torch.distributed.all_reduce(grad, group=group)
