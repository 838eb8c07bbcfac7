"""The Gated DeltaNet (linear attention) as a megatron-core module over packed samples (THD).

megatron-core 0.16's ``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` needs flash-linear-attention, refuses
packed sequences and ignores context parallelism; this module is ours, with the same parameter names and TP
layout (its checkpoints' names), running each packed sample from a zero state (``megatron/vlm/layers/delta_rule.py``).

Forward, per token (as transformers' hybrid decoders compute it)::

    [qkv | z | b | a] = in_proj(x)                      # one column-parallel linear, no bias
    q, k, v = split(silu(causal_conv1d(qkv)))           # depthwise, kernel linear_conv_kernel_dim, no bias
    q, k = l2_normalize(q), l2_normalize(k)             # per key head
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)   # per value head
    o = gated_delta_rule(q, k, v, g, beta)              # state reset at every segment
    y = out_proj(rms_norm(o) * weight * silu(z))        # gated RMSNorm per value head (plain weight), row-parallel

Heads: ``linear_num_key_heads`` query/key heads of ``linear_key_head_dim``, ``linear_num_value_heads`` value heads
of ``linear_value_head_dim`` (a multiple: key head ``i`` serves value heads ``i*r .. i*r + r-1``). TP splits the key
heads and their value heads: each rank's slice of ``in_proj``'s output is ``[q | k | v | z | b | a]`` of its own
heads (megatron-core's layout), as are ``conv1d.weight`` (``[q | k | v]`` channels), ``A_log`` and ``dt_bias``; the
norm weight is replicated, its gradient summed over TP in the backward (each rank's heads contribute to it).

Sequence parallelism: the linears all-gather the input and reduce-scatter the output (megatron-core's), the rest
runs on the whole row. Context parallelism is refused (the state would have to pass between CP ranks).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_cuda_rng_tracker
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default
from torch import Tensor

from omnibal_ext.errors import UserError
from omnibal_ext.model.linear_attention import LinearAttentionShape

from megatron.vlm.layers.delta_rule import BACKENDS, Segments, causal_conv1d, delta_rule, l2_normalize


def linear_attention_shape(config: TransformerConfig) -> LinearAttentionShape:
    """The layer's sizes (whole model) from megatron-core's config: hidden, heads and head dims, conv kernel."""
    return LinearAttentionShape(config.hidden_size, config.linear_num_key_heads, config.linear_key_head_dim,
                                config.linear_num_value_heads, config.linear_value_head_dim,
                                config.linear_conv_kernel_dim)


class GatedRMSNorm(torch.nn.Module):
    """``rms_norm(x) * weight * silu(gate)`` over the last dimension (a value head), fp32 inside; the weight
    (ones at start, not zero-centred) is replicated over TP, its gradient summed over ``tp_group`` in the backward.

    Its weight is marked ``grad_summed_over_tp`` so that ``mark_sequence_parallel`` leaves it alone."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, tp_group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.grad_summed_over_tp = True
        self.eps = eps
        self.tp_group = tp_group

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (weight * x.to(dtype) * F.silu(gate.float())).to(dtype)


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: ModuleSpec | type = ColumnParallelLinear
    out_norm: ModuleSpec | type = GatedRMSNorm
    out_proj: ModuleSpec | type = RowParallelLinear


def packed_segments(packed_seq_params: PackedSeqParams | None, tokens: int, batch: int) -> Segments:
    """The (start, end) token segments of a THD row (``SegmentParams.segments`` when given, else read from
    ``cu_seqlens_q``), or of ``batch`` sequences of ``tokens`` each (sbhd, no packed_seq_params)."""
    if packed_seq_params is None:
        return tuple((i * tokens, (i + 1) * tokens) for i in range(batch))
    if packed_seq_params.qkv_format != "thd" or batch != 1:
        raise ValueError("GatedDeltaNet: packed sequences are THD rows [t, 1, h]")
    segments = getattr(packed_seq_params, "segments", None)
    if not segments:
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        segments = tuple(zip(bounds[:-1], bounds[1:]))
    if segments[0][0] != 0 or segments[-1][1] != tokens:
        raise ValueError(f"GatedDeltaNet: cu_seqlens_q cover [{segments[0][0]}, {segments[-1][1]}), "
                         f"the row has {tokens} tokens")
    return tuple(segments)


class GatedDeltaNet(MegatronModule):
    """A gated DeltaNet linear-attention layer (module docstring): hidden states [s, b, h] (THD: [t, 1, h] with
    ``packed_seq_params``; under sequence parallelism this rank's 1/TP of them) -> (output like the input, None).

    chunk_size: the torch delta rule's chunk (tokens); backend: ``auto`` (fla's kernel on a GPU where it imports,
    else torch), ``torch`` or ``fla``."""

    def __init__(self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules, layer_number: int = 1,
                 chunk_size: int = 64, backend: str = "auto", pg_collection=None, **_unused):
        super().__init__(config)
        tp_group = pg_collection.tp if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_group()
        tp = tp_group.size()
        self.dims = dims = linear_attention_shape(config)
        dims.check_tp(tp)
        if config.context_parallel_size > 1:
            raise UserError(f"GatedDeltaNet (linear attention) does not implement context parallelism "
                            f"(context_parallel_size {config.context_parallel_size}): its recurrent state would pass "
                            f"between CP ranks; use --context-parallel-size 1")
        if backend not in BACKENDS:
            raise UserError(f"GatedDeltaNet backend must be one of {BACKENDS}, got {backend!r}")
        if chunk_size < 1:
            raise UserError(f"GatedDeltaNet chunk_size must be >= 1, got {chunk_size}")
        self.layer_number, self.chunk_size, self.backend = layer_number, chunk_size, backend
        self.tp, self.tp_group = tp, tp_group
        self.sections = dims.in_proj_sections(tp)
        self.in_proj = build_module(submodules.in_proj, dims.hidden, sum(self.sections) * tp, config=config,
                                    init_method=config.init_method, gather_output=False, bias=False,
                                    skip_bias_add=False, is_expert=False, tp_group=tp_group)
        conv_local = dims.conv_dim // tp
        self.conv1d = torch.nn.Conv1d(conv_local, conv_local, dims.conv_kernel, groups=conv_local, bias=False,
                                      dtype=config.params_dtype)  # its weight [c, 1, w]; the forward is ours
        heads_local = dims.value_heads // tp
        self.A_log = torch.nn.Parameter(torch.empty(heads_local, dtype=config.params_dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(heads_local, dtype=config.params_dtype))
        for p in (self.conv1d.weight, self.A_log, self.dt_bias):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        tracker = get_cuda_rng_tracker()  # per-rank heads: the model-parallel stream, where one is seeded (a
        # logits check or an import builds the layer without seeds; its weights are loaded next)
        with tracker.fork() if tracker.is_initialized() else contextlib.nullcontext():
            torch.nn.init.kaiming_uniform_(self.conv1d.weight, a=5 ** 0.5)
            self.A_log.data.copy_(torch.empty(heads_local).uniform_(1, 16).log())
        self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=dims.value_head_dim,
                                     eps=config.layernorm_epsilon, tp_group=tp_group)
        self.out_proj = build_module(submodules.out_proj, dims.value_dim, dims.hidden, config=config,
                                     init_method=config.output_layer_init_method, bias=False,
                                     input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=tp_group)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None, inference_context=None, **_unused):
        """_unused: the attention arguments megatron-core's TransformerLayer passes (rotary embeddings, ...)."""
        if inference_context is not None:
            raise UserError("GatedDeltaNet: megatron-core's inference_context is not implemented; generation passes "
                            "its decode step in the packed parameters (megatron/vlm/inference)")
        # generation: each segment continues its sequence's convolution and recurrent states (SegmentParams.decode)
        decode = getattr(packed_seq_params, "decode", None)
        dims, tp = self.dims, self.tp
        projected, _ = self.in_proj(hidden_states)  # [s, b, in_proj / tp] (sequence parallel: gathered)
        s, b = projected.shape[:2]
        segments = packed_segments(packed_seq_params, s, b)
        projected = projected.transpose(0, 1).reshape(b * s, -1)  # segments are consecutive tokens
        qkv, z, beta, a = torch.split(projected, [sum(self.sections[:3]), *self.sections[3:]], dim=-1)
        conv = causal_conv1d if decode is None else partial(decode.conv, self)
        qkv = F.silu(conv(qkv, self.conv1d.weight[:, 0], segments))
        q, k, v = torch.split(qkv, self.sections[:3], dim=-1)
        heads = dims.value_heads // tp
        q = l2_normalize(q.reshape(b * s, -1, dims.key_head_dim))
        k = l2_normalize(k.reshape(b * s, -1, dims.key_head_dim))
        v = v.reshape(b * s, heads, dims.value_head_dim)
        beta = beta.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        cu_seqlens = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
        rule = delta_rule if decode is None else partial(decode.delta_rule, self)
        o = rule(q, k, v, g, beta, segments, cu_seqlens, self.chunk_size, self.backend).to(hidden_states.dtype)
        o = self.out_norm(o, z.reshape(b * s, heads, dims.value_head_dim).contiguous())  # not in_proj's output
        o = o.reshape(b, s, -1).transpose(0, 1)  # [s, b, value_dim / tp]
        return self.out_proj(o)


    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Checkpoint tensors whose global shapes do not depend on TP: ``in_proj.weight`` stored as its parts
        ``.q .k .v .z .b .a``, ``conv1d.weight`` as ``.q .k .v``, each split over TP along its rows; ``A_log``,
        ``dt_bias`` split, the norm weight replicated, ``out_proj.weight`` split along its columns."""

        own = {"A_log": self.A_log, "dt_bias": self.dt_bias, "conv1d.weight": self.conv1d.weight}
        sd = make_sharded_tensors_for_checkpoint(own, prefix, {name: 0 for name in own}, sharded_offsets)
        for name in ("in_proj", "out_norm", "out_proj"):  # the TP group: each TP rank's replica of the norm weight
            sd.update(sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets, metadata,
                                                 tp_group=self.tp_group))
        sd[f"{prefix}in_proj.weight"] = _split_rows(sd[f"{prefix}in_proj.weight"], self.sections, "qkvzba")
        sd[f"{prefix}conv1d.weight"] = _split_rows(sd[f"{prefix}conv1d.weight"], self.sections[:3], "qkv")
        return sd


def _split_rows(sh, sections: list[int], names: str):
    """A factory storing a TP-split tensor (rows: this rank's ``sections``, one per name) as one tensor per name,
    ``key.<name>``, each split over TP (megatron-core's ShardedTensor.narrow on every rank alike)."""

    base = sh.without_data()

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError(f"{key}: flattened (distributed-optimizer bucket) views are not supported")
        whole = dataclasses.replace(base, key=key, data=data, dtype=data.dtype, replica_id=replica_id)
        parts, start = {}, 0
        for name, width in zip(names, sections):
            (piece,) = whole.narrow(0, start, width)
            piece.key = f"{key}.{name}"
            parts[name] = piece
            start += width
        return parts

    def merge(loaded: dict):
        return torch.cat([loaded[name] for name in names])

    return ShardedTensorFactory(sh.key, sh.data, build, merge, sh.replica_id)


def gated_delta_net_spec(chunk_size: int = 64, backend: str = "auto") -> ModuleSpec:
    """The layer's spec: megatron-core's TP linears and our gated norm."""
    return ModuleSpec(module=GatedDeltaNet, params={"chunk_size": chunk_size, "backend": backend},
                      submodules=GatedDeltaNetSubmodules())
