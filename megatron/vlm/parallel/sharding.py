"""Checkpoint keys of a pipeline stage: megatron-core sharded state dicts named by the global units.

A stage's ``sharded_state_dict`` keys every tensor by the unit it belongs to
(``omnibal_ext.model.units``: ``vit.embed.``, ``vit.layer.7.``, ``projector.``, ``llm.embed.``,
``llm.layer.31.``, ``llm.head.``), never by the stage, the block segmentation a recompute plan makes or
the layout. Each tensor's tensor-parallel split is the one its megatron-core module declares (the layers'
own ``sharded_state_dict``: fused QKV cut by query groups, gated MLP as per-rank ``cat(gate, up)``,
vocabulary-parallel embedding and head), so ``megatron.core.dist_checkpointing`` can load a checkpoint
at any TP/PP/DP and layout.

ViT heads padded for tensor parallelism (25 heads become 28 at TP 4) are saved as the
real heads only: the attention tensors are stored head by head along a leading axis of the real head
count (``[heads, 3 * head_dim, hidden]`` for QKV, ``[heads, hidden, head_dim]`` for the output
projection's columns, ``[heads, head_dim]`` for the qk-norm weights), so their global shape does not depend on TP; padded heads are dropped on save and
come back as zeros on load.
"""
from __future__ import annotations

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.utils import sharded_state_dict_default

import torch


def unit_sharded_state_dict(module: torch.nn.Module, module_prefix: str, unit_prefix: str,
                            metadata: dict | None) -> dict:
    """``module``'s sharded state dict: dict keys under ``module_prefix`` (where the module sits in the
    stage, as ``state_dict`` names it), checkpoint keys under ``unit_prefix`` (the unit's global name)."""
    sd = sharded_state_dict_default(module, module_prefix, (), metadata)
    replace_prefix_for_sharding(sd, module_prefix, unit_prefix)
    return sd


# ViT attention tensors whose rows (axis 0) or columns (axis 1) run over the heads, with the rows or
# columns one head holds in units of head_dim.
_PER_HEAD = {
    "self_attention.linear_qkv.weight": (0, 3),
    "self_attention.linear_qkv.bias": (0, 3),
    "self_attention.linear_proj.weight": (1, 1),
    # qk-norm weights (FullWidthQKNorm): head_dim entries per head, stored as [heads, head_dim]
    "self_attention.q_layernorm.weight": (0, 1),
    "self_attention.k_layernorm.weight": (0, 1),
    # LoRA adapters split with the heads (megatron/vlm/layers/lora.py): QKV's B rows, the out-projection's A columns
    "self_attention.linear_qkv.lora_b": (0, 3),
    "self_attention.linear_proj.lora_a": (1, 1),
}


def drop_padded_heads(sd: dict, module_prefix: str, real_heads: int, heads_per_rank: int, tp_rank: int,
                      head_dim: int) -> None:
    """Replace the per-head ViT attention tensors of one layer's sharded state dict (in place) by
    factories that store real heads only, head by head. ``heads_per_rank``: this TP rank's heads,
    padded ones included; this rank holds heads ``tp_rank * heads_per_rank ...``."""
    for name, (axis, rows_per_head) in _PER_HEAD.items():
        key = module_prefix + name
        if key in sd:
            sd[key] = _per_head_factory(sd[key], axis, rows_per_head * head_dim, real_heads,
                                        heads_per_rank * tp_rank)


def _per_head_factory(sh: ShardedTensor, axis: int, width: int, real_heads: int,
                      first_head: int) -> ShardedTensorFactory:
    """A factory saving a tensor whose ``axis`` holds consecutive heads of ``width`` entries each as
    ShardedTensors of one head each, under a leading axis of ``real_heads``."""

    def head_slices(data: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        local_heads = data.shape[axis] // width
        return [(first_head + j, data.narrow(axis, j * width, width))
                for j in range(local_heads) if first_head + j < real_heads]

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError(f"{key}: flattened (distributed-optimizer bucket) views are not "
                                      "supported for per-head ViT tensors")
        heads = head_slices(data)
        if not heads:  # only padded heads here: stand in as a copy of head 0, never saved, ignored on load
            heads, replica_id = [(0, data.narrow(axis, 0, width))], _not_main(replica_id)
        return {f"head_{h}": ShardedTensor.from_rank_offsets(
                    key, part if axis == 0 else part.contiguous(), (0, h, real_heads),
                    replica_id=replica_id, prepend_axis_num=1)
                for h, part in heads}

    def merge(loaded: dict) -> torch.Tensor:
        dtype = next(iter(loaded.values())).dtype if loaded else sh.data.dtype  # fp32 Adam state of bf16 weights
        out = torch.zeros(sh.data.shape, dtype=dtype, device=sh.data.device)
        for h, part in head_slices(out):
            part.copy_(loaded[f"head_{h}"])
        return out

    factory = ShardedTensorFactory(sh.key, sh.data, build, merge, sh.replica_id)
    # for loaders that write each piece in place (megatron/vlm/hf/load.py): where ``merge`` puts each
    # built piece in ``data`` (views; zeros elsewhere)
    factory.load_views = lambda data: {f"head_{h}": part for h, part in head_slices(data)}
    return factory


def _not_main(replica_id):
    """A replica id that is not the main replica (megatron-core saves main replicas only)."""
    if isinstance(replica_id, int):
        return replica_id + 1
    return (replica_id[0] + 1, *replica_id[1:])
