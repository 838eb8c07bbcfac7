"""Sequence parallelism (``--sequence-parallel``) through megatron-core's mappings and its layers' support.

With ``TransformerConfig.sequence_parallel`` megatron-core's tensor-parallel linears all-gather their input
along the first (sequence) dimension and reduce-scatter their output, so between them (norms, residuals,
bias-dropout-add, layer scale) a TP rank holds 1/TP of the tokens.  The runtime components put the hidden
states into that region where a run of layers starts and take them out where it ends, with megatron-core's
``scatter_to_sequence_parallel_region`` / ``gather_from_sequence_parallel_region``; two runs of the same
kind that meet at a stage boundary stay split, so pipeline stages inside the ViT or the LLM send 1/TP of
the tokens.  The head reads the split hidden states: its norm runs on them and its column-parallel output
layer (sequence-parallel config) all-gathers them.

Token counts TP must divide.  The LLM: the collate pads every row to a multiple of TP (the pads are a
padding segment of their own, labels ignored).  The ViT runs ``[tokens per tile, tiles, hidden]`` and TP
need not divide the tokens per tile (1025 for 448 px tiles of 14 px patches, 17 tiny): each tile is padded with
zero tokens up to a multiple of TP, the pad keys masked out of attention (``vit_pad_mask``), the pads cut
off after the last ViT layer.  Pads never reach a real token, so values and gradients are the unpadded
model's.  The cost: ``ceil(T/TP)*TP - T`` tokens per tile (1025 at TP 2: 1 of 1025, 0.1%; tiny:
1 of 17, 6%) in every ViT layer's compute and activations, which the cost model counts.  A packed (THD) ViT
(native-resolution patches: all images' patches in one row, segments per window or image) pads the row once, the pads a
segment of their own (``with_pad_segment``), so segments stay whole.

Parameters that every TP rank holds whole but that see only the rank's tokens (norms, layer scale, the
row-parallel linears' biases) carry ``sequence_parallel = True``, so megatron-core's ``finalize_model_grads``
sums their gradients over TP (``mark_sequence_parallel``).  Parameters split over TP (the ViT's full-width
qk-norm weight, split with its heads and fed by the all-gathered q/k) are left alone, and so are those whose
module sums their gradient over TP itself or gives every TP rank the whole gradient (``mark_sequence_parallel``).
"""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel


def padded_tokens(tokens: int, tp: int) -> int:
    """``tokens`` rounded up to a multiple of ``tp``."""
    return -(-tokens // tp) * tp


def mark_sequence_parallel(module: torch.nn.Module) -> None:
    """Mark every parameter of ``module`` that is not split over TP as ``sequence_parallel``, except one whose
    gradient its module sums over TP itself (``grad_summed_over_tp``: the Gated DeltaNet's norm weight, the per-head
    q/k RMSNorm) and one that says ``sequence_parallel = False`` already (whole gradient on every TP rank: a DeepStack
    merger inside a ViT layer, which sees every patch)."""
    for p in module.parameters():
        if (not getattr(p, "tensor_model_parallel", False) and not getattr(p, "grad_summed_over_tp", False)
                and getattr(p, "sequence_parallel", None) is not False):
            p.sequence_parallel = True


def enter(x: torch.Tensor) -> torch.Tensor:
    """Full hidden states [s, b, h] -> this TP rank's [s / TP, b, h] (backward: all-gather).

    megatron-core's scatter returns a view of the full tensor, which would keep all of it alive as long as
    the first layer keeps its input: the slice is copied, so that only 1/TP of the tokens stays."""
    return tensor_parallel.scatter_to_sequence_parallel_region(x).clone()


def leave(x: torch.Tensor) -> torch.Tensor:
    """This TP rank's [s / TP, b, h] -> the full [s, b, h], for replicated consumers (the projector, a
    stage's full output); backward: this rank's slice of the (identical) full gradient."""
    return tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)


def vit_pad_mask(tokens: int, padded: int, device=None) -> torch.Tensor | None:
    """Boolean attention mask [1, 1, 1, padded] (True = masked) hiding the pad keys of a padded tile."""
    if padded == tokens:
        return None
    mask = torch.zeros(1, 1, 1, padded, dtype=torch.bool, device=device)
    mask[..., tokens:] = True
    return mask


def with_pad_segment(cu_seqlens: torch.Tensor, max_seqlen: int, padded: int) -> tuple[torch.Tensor, int]:
    """Packed-segment bounds (int32, host) of ``cu_seqlens[-1]`` tokens padded to ``padded``: the pads one
    more segment (attending to themselves only), and the longest segment then."""
    tokens = int(cu_seqlens[-1])
    if padded == tokens:
        return cu_seqlens, int(max_seqlen)
    bound = torch.tensor([padded], dtype=cu_seqlens.dtype)
    return torch.cat([cu_seqlens, bound]), max(int(max_seqlen), padded - tokens)
