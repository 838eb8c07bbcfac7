"""Measured memory of a pipeline stage: saved-activation bytes per micro-batch and static bytes.

Activations are what autograd saves for backward (parameters excluded), counted per micro-batch
with ``saved_tensors_hooks`` (each storage once).  Their peak on a stage is the largest sum over
the micro-batches alive at once, replayed in megatron's 1F1B order for this stage (forwards of
the warm-up, then one forward / one backward): saved tensors live from a micro-batch's forward
to its backward.
"""
from __future__ import annotations

import contextlib

import torch


class ActivationMeter:
    """Counts the bytes autograd saves during each forward it wraps."""

    def __init__(self, module: torch.nn.Module):
        self.skip = {self._key(p) for p in module.parameters()}
        self.per_microbatch: list[int] = []

    @staticmethod
    def _key(t: torch.Tensor):
        s = t.untyped_storage()
        return (t.device.type, s.data_ptr(), s.nbytes())

    @contextlib.contextmanager
    def measure(self):
        seen: dict = {}

        def pack(t):
            key = self._key(t)
            if key not in self.skip:
                seen[key] = key[2]
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.per_microbatch.append(sum(seen.values()))

    def reset(self):
        self.per_microbatch = []


def one_f_one_b_peak(bytes_per_mb: list[int], stage: int, num_stages: int) -> int:
    """Peak of live saved bytes on ``stage`` under 1F1B (warm-up of num_stages - stage - 1 forwards)."""
    m = len(bytes_per_mb)
    warmup = min(num_stages - stage - 1, m)
    live, peak, next_fwd, next_bwd = 0, 0, 0, 0
    for _ in range(warmup):
        live += bytes_per_mb[next_fwd]
        next_fwd += 1
        peak = max(peak, live)
    while next_bwd < m:
        if next_fwd < m:
            live += bytes_per_mb[next_fwd]
            next_fwd += 1
            peak = max(peak, live)
        live -= bytes_per_mb[next_bwd]
        next_bwd += 1
    return peak


def static_bytes(model_chunks, optimizer) -> int:
    """Parameters, gradient buffers and optimizer state held by this rank, bytes."""
    total = 0
    for chunk in model_chunks:
        for p in chunk.parameters():
            total += p.numel() * p.element_size()
            g = getattr(p, "main_grad", None)
            if g is not None:
                total += g.numel() * g.element_size()
    inner = getattr(optimizer, "optimizer", None)
    seen = set()
    for state in (inner.state.values() if inner is not None else []):
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0 and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    for group in getattr(optimizer, "fp32_from_float16_groups", []):  # fp32 master copies (bf16 runs)
        for p in group:
            total += p.numel() * p.element_size()
    return total
