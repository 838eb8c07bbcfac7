"""The caches of a generation: attention keys and values, and the Gated DeltaNet's convolution and recurrent states.

A generate call holds one ``DecodeCache`` per rank: a slot per sequence, and per layer of this rank's stage (found
by its module) what that layer keeps of every sequence. A step of the generation is one packed (THD) micro-batch:
each segment is one sequence's new tokens, the whole prompt at its prefill or one token at a decode step (plus, under
sequence parallelism, one padding segment that rounds the tokens up to a multiple of TP). The micro-batch carries a
``DecodeStep`` (``PackingPart.decode`` -> ``SegmentParams.decode``) saying which slot each segment extends and how
many of its tokens are cached already; the layers hand it their tensors:

* ``SegmentAttention`` (``attend``): the segment's keys and values (after RoPE) are written at positions
  ``past .. past + n`` of its slot, and its queries attend to the slot's ``past + n`` keys (query ``i`` to keys
  ``0 .. past + i``). A decode step's sequences, one query each, go through one ``scaled_dot_product_attention`` over
  their caches gathered and masked to each one's length. Keys and values are kept as ``[slots, capacity, key-value
  heads of this TP rank, head dim]``, in the layer's dtype.
* ``GatedDeltaNet`` (``conv``, ``delta_rule``): the causal convolution continues from the slot's last ``kernel - 1``
  inputs, and the gated delta rule from the slot's state ``S`` [value heads of this TP rank, k_dim, v_dim] (fp32): a
  prefill runs the chunked rule from zero and keeps each segment's final state and last inputs; a decode step runs
  one recurrent step per sequence::

      S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T (q / sqrt(k_dim))

A step is a prefill (every segment starts its sequence) or a decode step (every real segment is one token after its
cached ones); the engine never mixes them. Padding segments (slot None) attend among themselves and keep nothing; at
a decode step their outputs are zeros (they never reach a real token).

This is the role of megatron-core's ``StaticInferenceContext`` (a KV cache that attention reads through
``inference_context``), laid out per sequence rather than ``[s, b]``: our attention runs packed segments of different
lengths, and the recurrent layers need states beside the keys and values (docs/generation.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.vlm.delta_rule import Segments, causal_conv1d
from megatron.vlm.delta_rule import delta_rule as packed_delta_rule


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
    """One step of a generation (module docstring): per segment of the micro-batch's ``cu_seqlens`` the slot it extends
    (None: padding) and the tokens of that slot cached before it (``past``). ``prefill``: every segment starts its
    sequence (``past`` 0), else every real segment is one token."""

    cache: DecodeCache
    slots: tuple[int | None, ...]
    past: tuple[int, ...]

    def __post_init__(self):
        if len(self.slots) != len(self.past):
            raise ValueError(f"DecodeStep: {len(self.slots)} slots for {len(self.past)} segments")
        real = [p for s, p in zip(self.slots, self.past) if s is not None]
        if not real:
            raise ValueError("DecodeStep: no sequence in the step")
        if any(p for p in real) and not all(p > 0 for p in real):
            raise ValueError("DecodeStep: a step is a prefill (every past 0) or a decode step (every past > 0)")

    @property
    def prefill(self) -> bool:
        return all(p == 0 for s, p in zip(self.slots, self.past) if s is not None)

    def _check(self, segments: Segments) -> None:
        if len(segments) != len(self.slots):
            raise ValueError(f"DecodeStep: {len(segments)} segments in the layer, {len(self.slots)} in the step")
        if not self.prefill:
            for (a, e), slot in zip(segments, self.slots):
                if slot is not None and e - a != 1:
                    raise ValueError(f"DecodeStep: a decode step's sequence has {e - a} new tokens, not 1")
        for (a, e), slot, past in zip(segments, self.slots, self.past):
            if slot is not None and past + e - a > self.cache.capacity:
                raise ValueError(f"DecodeStep: slot {slot} would hold {past + e - a} tokens, capacity "
                                 f"{self.cache.capacity}")

    def _real(self, segments: Segments) -> list[tuple[int, int, int, int]]:
        """(start, end, slot, past) of each real segment."""
        return [(a, e, s, p) for (a, e), s, p in zip(segments, self.slots, self.past) if s is not None]

    # attention --------------------------------------------------------------------------------------------------
    def attend(self, layer, query: Tensor, key: Tensor, value: Tensor, segments: Segments, causal: bool) -> Tensor:
        """``SegmentAttention``'s THD attention with the cache: query [t, heads, d], key/value [t, groups, d] (this
        TP rank's, RoPE applied) -> [t, heads * d]."""
        if not causal:
            raise ValueError("DecodeStep: generation caches causal (LLM) attention only")
        self._check(segments)
        keys, values = self.cache.keys_values(layer, key)
        t = query.shape[0]
        out = query.new_zeros(t, layer.hidden_size_per_partition)
        real = self._real(segments)
        for a, e, slot, past in real:  # write this step's keys and values
            keys[slot, past:past + e - a] = key[a:e]
            values[slot, past:past + e - a] = value[a:e]

        def sdpa(q, k, v, mask=None, is_causal=False):  # [t, n, d] each -> [t, n * d]; one sequence
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                 scale=layer.softmax_scale, enable_gqa=layer.gqa)
            return ctx[0].transpose(0, 1).reshape(q.shape[2], -1)

        if self.prefill:
            for a, e, slot, past in real:
                out[a:e] = sdpa(query[a:e], key[a:e], value[a:e], is_causal=True)
            for (a, e), slot in zip(segments, self.slots):
                if slot is None:
                    out[a:e] = sdpa(query[a:e], key[a:e], value[a:e], is_causal=True)
            return out
        # decode: every sequence's one query over its cached keys, gathered and masked to its length
        rows = torch.tensor([a for a, _, _, _ in real], device=query.device)
        slots = torch.tensor([s for _, _, s, _ in real], device=query.device)
        lengths = torch.tensor([p + 1 for _, _, _, p in real], device=query.device)
        longest = int(max(p for _, _, _, p in real)) + 1
        k = keys[slots, :longest].transpose(1, 2)  # [n, groups, L, d]
        v = values[slots, :longest].transpose(1, 2)
        q = query.index_select(0, rows).unsqueeze(2)  # [n, heads, 1, d]
        mask = (torch.arange(longest, device=query.device).unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.softmax_scale, enable_gqa=layer.gqa)
        out[rows] = ctx.reshape(len(real), -1).to(out.dtype)
        return out

    # the Gated DeltaNet -----------------------------------------------------------------------------------------
    def conv(self, layer, x: Tensor, weight: Tensor, segments: Segments) -> Tensor:
        """``causal_conv1d`` continuing each sequence's inputs: x [t, channels] (this TP rank's), weight [channels,
        kernel] -> [t, channels]; keeps each sequence's last ``kernel - 1`` inputs."""
        self._check(segments)
        width = weight.shape[-1] - 1
        real = self._real(segments)
        if width == 0:
            return x * weight[:, 0]
        window = self.cache.conv_window(layer, width, x)
        if self.prefill:
            out = causal_conv1d(x, weight, segments)
            for a, e, slot, _ in real:  # the last inputs, zeros before the sequence's start
                take = x[max(a, e - width):e]
                window[slot].zero_()
                window[slot, width - len(take):] = take
            return out
        rows = torch.tensor([a for a, _, _, _ in real], device=x.device)
        slots = torch.tensor([s for _, _, s, _ in real], device=x.device)
        full = torch.cat([window[slots], x.index_select(0, rows).unsqueeze(1)], dim=1)  # [n, kernel, channels]
        out = x.new_zeros(x.shape)
        out[rows] = torch.einsum("nwc,cw->nc", full, weight.to(full.dtype))
        window[slots] = full[:, 1:]
        return out

    def delta_rule(self, layer, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments,
                   cu_seqlens, chunk: int, backend: str) -> Tensor:
        """``megatron.vlm.delta_rule.delta_rule`` continuing each sequence's state: q, k [t, key heads, k_dim]
        (l2-normalised), v [t, heads, v_dim], g, beta [t, heads] -> o [t, heads, v_dim] fp32."""
        self._check(segments)
        heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
        state = self.cache.recurrent_state(layer, heads, k_dim, v_dim, v.device)
        real = self._real(segments)
        if self.prefill:
            out, finals = packed_delta_rule(q, k, v, g, beta, segments, cu_seqlens, chunk, backend, final_state=True)
            for i, ((a, e), slot) in enumerate(zip(segments, self.slots)):
                if slot is not None:
                    state[slot] = finals[i]
            return out
        ratio = heads // k.shape[1]
        rows = torch.tensor([a for a, _, _, _ in real], device=v.device)
        slots = torch.tensor([s for _, _, s, _ in real], device=v.device)
        qs, ks = (x.index_select(0, rows).float().repeat_interleave(ratio, dim=1) for x in (q, k))  # [n, heads, k]
        vs, gs, bs = (x.index_select(0, rows).float() for x in (v, g, beta))
        s = state[slots] * gs.exp()[..., None, None]
        delta = bs.unsqueeze(-1) * (vs - torch.einsum("nhk,nhkv->nhv", ks, s))
        s = s + ks.unsqueeze(-1) * delta.unsqueeze(-2)
        state[slots] = s
        out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        out[rows] = torch.einsum("nhk,nhkv->nhv", qs * k_dim ** -0.5, s)
        return out
