"""The caches of a generation: attention keys and values, and the Gated DeltaNet's convolution and recurrent states.

A generate call holds one ``DecodeCache`` per rank: a slot per sequence, and per layer of this rank's stage (found
by its module) what that layer keeps of every sequence. A step of the generation is one packed (THD) micro-batch: at
a prefill each segment is one sequence's prompt; at a decode step one segment holds one new token per sequence (plus,
under sequence parallelism, one padding segment that rounds the tokens up to a multiple of TP). The micro-batch
carries a ``DecodeStep`` (``PackingPart.decode`` -> ``SegmentParams.decode``) saying which slot each prompt or token
extends and how many tokens that slot holds already; the layers hand it their tensors:

* ``SegmentAttention`` (``attend``): a prompt's keys and values (after RoPE) are written at positions ``0 .. n`` of
  its slot and it attends causally within itself; a decode step writes each token's key and value at its slot's next
  position, and the tokens' queries, one per sequence, go through one ``scaled_dot_product_attention`` over their
  slots' keys gathered and masked to each one's length. Keys and values are kept as ``[slots, capacity, key-value
  heads of this TP rank, head dim]``, in the layer's dtype.
* ``GatedDeltaNet`` (``conv``, ``delta_rule``): the causal convolution continues from the slot's last ``kernel - 1``
  inputs, and the gated delta rule from the slot's state ``S`` [value heads of this TP rank, k_dim, v_dim] (fp32): a
  prefill runs the chunked rule from zero and keeps each segment's final state and last inputs; a decode step runs
  one recurrent step per sequence::

      S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T (q / sqrt(k_dim))

A step is a prefill (every segment starts its sequence) or a decode step (one token per sequence after its cached
ones, all in the micro-batch's first segment); the engine never mixes them. Padding segments attend among themselves
and keep nothing; at a decode step their outputs are zeros (they never reach a real token).

This is the role of megatron-core's ``StaticInferenceContext`` (a KV cache that attention reads through
``inference_context``), laid out per sequence rather than ``[s, b]``: our attention runs packed segments of different
lengths, and the recurrent layers need states beside the keys and values (docs/generation.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.vlm.layers.delta_rule import Segments, causal_conv1d
from megatron.vlm.layers.delta_rule import delta_rule as packed_delta_rule


class DecodeCache:
    """What every layer of this rank keeps of ``slots`` sequences of at most ``capacity`` tokens (module docstring).
    A layer's buffers are made at its first step, sized from its tensors."""

    def __init__(self, slots: int, capacity: int):
        if slots < 1 or capacity < 1:
            raise ValueError(f"DecodeCache: slots {slots} and capacity {capacity} must be >= 1")
        self.slots, self.capacity = slots, capacity
        self._kv: dict[torch.nn.Module, tuple[Tensor, Tensor]] = {}
        self._conv: dict[torch.nn.Module, Tensor] = {}
        self._state: dict[torch.nn.Module, Tensor] = {}

    def keys_values(self, layer: torch.nn.Module, like: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of ``layer`` [slots, capacity, groups, head dim] (made like ``like`` [t, groups, head
        dim] at the first call)."""
        if layer not in self._kv:
            shape = (self.slots, self.capacity, *like.shape[1:])
            self._kv[layer] = (like.new_zeros(shape), like.new_zeros(shape))
        return self._kv[layer]

    def conv_window(self, layer: torch.nn.Module, width: int, like: Tensor) -> Tensor:
        """The last ``width`` convolution inputs of ``layer`` per slot [slots, width, channels], oldest first."""
        if layer not in self._conv:
            self._conv[layer] = like.new_zeros(self.slots, width, like.shape[-1])
        return self._conv[layer]

    def recurrent_state(self, layer: torch.nn.Module, heads: int, k_dim: int, v_dim: int, device) -> Tensor:
        """The gated delta rule's state of ``layer`` per slot [slots, heads, k_dim, v_dim], fp32."""
        if layer not in self._state:
            self._state[layer] = torch.zeros(self.slots, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        return self._state[layer]

    def nbytes(self) -> int:
        """Bytes held by every layer's buffers."""
        tensors = [t for pair in self._kv.values() for t in pair] + list(self._conv.values()) + list(self._state.values())
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class DecodeStep:
    """One step of a generation (module docstring).

    A prefill (``prefill`` True): segment ``k`` of the micro-batch's ``cu_seqlens`` starts sequence ``slots[k]`` (any
    further segments are padding). A decode step: the micro-batch's first segment holds one new token per sequence,
    token ``k`` of sequence ``slots[k]``, which has ``past[k]`` tokens cached (a second segment, if any, is padding;
    one segment keeps megatron-core's THD RoPE to one slice, the positions being the tokens' own)."""

    cache: DecodeCache
    slots: tuple[int, ...]
    past: tuple[int, ...]
    prefill: bool

    def __post_init__(self):
        if not self.slots or len(self.slots) != len(self.past):
            raise ValueError(f"DecodeStep: {len(self.slots)} slots for {len(self.past)} cached lengths")
        if self.prefill != all(p == 0 for p in self.past) or (not self.prefill and min(self.past) < 1):
            raise ValueError("DecodeStep: a prefill starts every sequence (past 0), a decode step continues them "
                             f"(past >= 1); got prefill={self.prefill}, past {self.past}")
        if max(self.slots) >= self.cache.slots or max(p + 1 for p in self.past) > self.cache.capacity:
            raise ValueError(f"DecodeStep: slots {self.slots} / lengths beyond the cache's {self.cache.slots} slots of "
                             f"{self.cache.capacity} tokens")

    @cached_property
    def index(self) -> tuple[Tensor, Tensor]:
        """A decode step's slots and cached lengths as tensors (host), made once per step."""
        return torch.tensor(self.slots), torch.tensor(self.past)

    def _slots(self, device) -> Tensor | slice:
        first = self.slots[0]
        if self.slots == tuple(range(first, first + len(self.slots))):
            return slice(first, first + len(self.slots))
        return self.index[0].to(device)

    def _check(self, segments: Segments, rows: int) -> None:
        if self.prefill:
            if len(segments) < len(self.slots):
                raise ValueError(f"DecodeStep: {len(segments)} segments for {len(self.slots)} sequences")
            for (a, e), slot in zip(segments, self.slots):
                if e - a > self.cache.capacity:
                    raise ValueError(f"DecodeStep: a prompt of {e - a} tokens, capacity {self.cache.capacity}")
        elif segments[0] != (0, len(self.slots)) or rows < len(self.slots):
            raise ValueError(f"DecodeStep: a decode step's first segment holds its {len(self.slots)} tokens, got "
                             f"{segments[0]}")

    # attention --------------------------------------------------------------------------------------------------
    def attend(self, layer, query: Tensor, key: Tensor, value: Tensor, segments: Segments, causal: bool) -> Tensor:
        """``SegmentAttention``'s THD attention with the cache: query [t, heads, d], key/value [t, groups, d] (this
        TP rank's, RoPE applied) -> [t, heads * d]."""
        if not causal:
            raise ValueError("DecodeStep: generation caches causal (LLM) attention only")
        self._check(segments, query.shape[0])
        keys, values = self.cache.keys_values(layer, key)
        out = query.new_zeros(query.shape[0], layer.hidden_size_per_partition)
        if self.prefill:
            for k, (a, e) in enumerate(segments):
                q, kk, v = (x[a:e].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                ctx = F.scaled_dot_product_attention(q, kk, v, is_causal=True, scale=layer.softmax_scale,
                                                     enable_gqa=layer.gqa)
                out[a:e] = ctx[0].transpose(0, 1).reshape(e - a, -1)
                if k < len(self.slots):
                    keys[self.slots[k], :e - a] = key[a:e]
                    values[self.slots[k], :e - a] = value[a:e]
            return out
        # decode: write each sequence's new key and value, then its one query over its cached keys (masked to its
        # length) in one call
        n = len(self.slots)
        index, past = (t.to(query.device) for t in self.index)
        keys[index, past] = key[:n]  # pairs (slot, position), so the slots as a tensor
        values[index, past] = value[:n]
        slots = self._slots(query.device)
        longest = max(self.past) + 1
        k, v = (x[slots, :longest].transpose(1, 2) for x in (keys, values))  # [n, groups, L, d]
        mask = (torch.arange(longest, device=query.device).unsqueeze(0) <= past.unsqueeze(1))[:, None, None, :]
        ctx = F.scaled_dot_product_attention(query[:n].unsqueeze(2), k, v, attn_mask=mask, scale=layer.softmax_scale,
                                             enable_gqa=layer.gqa)
        out[:n] = ctx.reshape(n, -1).to(out.dtype)
        return out

    # the Gated DeltaNet -----------------------------------------------------------------------------------------
    def conv(self, layer, x: Tensor, weight: Tensor, segments: Segments) -> Tensor:
        """``causal_conv1d`` continuing each sequence's inputs: x [t, channels] (this TP rank's), weight [channels,
        kernel] -> [t, channels]; keeps each sequence's last ``kernel - 1`` inputs."""
        self._check(segments, x.shape[0])
        width = weight.shape[-1] - 1
        if width == 0:
            return x * weight[:, 0]
        window = self.cache.conv_window(layer, width, x)
        if self.prefill:
            out = causal_conv1d(x, weight, segments)
            for (a, e), slot in zip(segments, self.slots):  # the last inputs, zeros before the sequence's start
                take = x[max(a, e - width):e]
                window[slot].zero_()
                window[slot, width - len(take):] = take
            return out
        n = len(self.slots)
        slots = self._slots(x.device)
        full = torch.cat([window[slots], x[:n].unsqueeze(1)], dim=1)  # [n, kernel, channels], oldest first
        out = x.new_zeros(x.shape)
        out[:n] = torch.einsum("nwc,cw->nc", full, weight.to(full.dtype))
        window[slots] = full[:, 1:]
        return out

    def delta_rule(self, layer, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments,
                   cu_seqlens, chunk: int, backend: str) -> Tensor:
        """``megatron.vlm.layers.delta_rule.delta_rule`` continuing each sequence's state: q, k [t, key heads, k_dim]
        (l2-normalised), v [t, heads, v_dim], g, beta [t, heads] -> o [t, heads, v_dim] fp32."""
        self._check(segments, v.shape[0])
        heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
        state = self.cache.recurrent_state(layer, heads, k_dim, v_dim, v.device)
        if self.prefill:
            out, finals = packed_delta_rule(q, k, v, g, beta, segments, cu_seqlens, chunk, backend, final_state=True)
            for i, slot in enumerate(self.slots):
                state[slot] = finals[i]
            return out
        n, ratio = len(self.slots), heads // k.shape[1]
        slots = self._slots(v.device)
        qs, ks = (x[:n].float().repeat_interleave(ratio, dim=1) for x in (q, k))  # [n, heads, k_dim]
        vs, gs, bs = (x[:n].float() for x in (v, g, beta))
        s = state[slots] * gs.exp()[..., None, None]
        delta = bs.unsqueeze(-1) * (vs - torch.einsum("nhk,nhkv->nhv", ks, s))
        s = s + ks.unsqueeze(-1) * delta.unsqueeze(-2)
        state[slots] = s
        out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        out[:n] = torch.einsum("nhk,nhkv->nhv", qs * k_dim ** -0.5, s)
        return out
