"""Gated DeltaNet cases shared by tests/test_gated_delta_net.py (TP 1, in process) and its TP-2 worker: a tiny
transformers ``Qwen3_5GatedDeltaNet`` (the oracle) and ours built from its weights at any TP."""
from __future__ import annotations

import torch

HIDDEN = 24
LENGTHS = (7, 1, 12, 6)  # a packed row of four samples (26 tokens: TP 2 divides it for sequence parallelism)
KEY_HEADS, KEY_DIM, VALUE_HEADS, VALUE_DIM, KERNEL = 2, 8, 4, 6, 4


def hf_config(**overrides):
    from transformers import Qwen3_5TextConfig

    fields = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=32, vocab_size=64, linear_num_key_heads=KEY_HEADS, linear_key_head_dim=KEY_DIM,
                  linear_num_value_heads=VALUE_HEADS, linear_value_head_dim=VALUE_DIM,
                  linear_conv_kernel_dim=KERNEL, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    fields.update(overrides)
    return Qwen3_5TextConfig(**fields)


def hf_layer(seed: int = 0, **overrides):
    """transformers' layer in fp32 with every weight drawn away from its constant start (norm weight, dt_bias)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    layer = Qwen3_5GatedDeltaNet(hf_config(**overrides), layer_idx=0).float()
    with torch.no_grad():
        layer.norm.weight.add_(0.3 * torch.randn_like(layer.norm.weight))
        layer.dt_bias.add_(0.5 * torch.randn_like(layer.dt_bias))
        for p in (layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_b.weight, layer.in_proj_a.weight):
            p.mul_(2.0)  # larger gates and keys: the delta rule's state matters
    return layer


def hf_tensors(layer) -> dict:
    return {name: p.detach().clone() for name, p in layer.named_parameters()}


def our_config(tp: int = 1, sequence_parallel: bool = False, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, linear_num_key_heads=KEY_HEADS,
                  linear_key_head_dim=KEY_DIM, linear_num_value_heads=VALUE_HEADS, linear_value_head_dim=VALUE_DIM,
                  linear_conv_kernel_dim=KERNEL, layernorm_epsilon=1e-6, tensor_model_parallel_size=tp,
                  sequence_parallel=sequence_parallel, use_cpu_initialization=True, params_dtype=torch.float32,
                  gradient_accumulation_fusion=False)
    fields.update(overrides)
    return TransformerConfig(**fields)


def our_layer(hf: dict, tp: int = 1, rank: int = 0, chunk_size: int = 4, sequence_parallel: bool = False):
    """Ours at TP ``tp`` (this process's rank ``rank``) holding the HF layer's weights ``hf`` (hf_tensors)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron.vlm.layers.gated_delta_net import gated_delta_net_spec, linear_attention_shape
    from megatron.vlm.families.qwen3_5.gated_delta_net_hf import hf_to_ours

    cfg = our_config(tp, sequence_parallel)
    layer = build_module(gated_delta_net_spec(chunk_size=chunk_size, backend="torch"), config=cfg, layer_number=1)
    layer.load_state_dict(hf_to_ours(hf, linear_attention_shape(cfg), rank, tp))
    return layer


def packed_input(lengths=LENGTHS, seed: int = 1):
    """(x [t, 1, hidden], cu_seqlens int32, output-gradient weights [t, 1, hidden])."""
    t = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 1, HIDDEN, generator=gen)
    seed_w = torch.randn(t, 1, HIDDEN, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu, seed_w


def thd_params(cu):
    from megatron.vlm.layers.attention import segment_params

    return segment_params(cu, int((cu[1:] - cu[:-1]).max()))


def checkpoint_pieces(layer) -> list:
    """(key, global shape, global offset, data) of every tensor the layer's sharded state dict saves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = layer.sharded_state_dict(prefix="gdn.")
    apply_factories(sd)
    return [(t.key, tuple(t.global_shape), tuple(t.global_offset), t.data.detach().clone())
            for t in nested_values(sd) if isinstance(t, ShardedTensor)]  # not the linears' extra state


def assemble(pieces: list) -> dict:
    """The global tensors of checkpoint pieces (those of every rank)."""
    out = {}
    for key, shape, offset, data in pieces:
        whole = out.setdefault(key, torch.full(shape, float("nan")))
        whole[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))] = data
    return out
