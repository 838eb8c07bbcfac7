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


def _leaf_optimizers(optimizer) -> list:
    """The optimizers holding state: megatron-core's ChainedOptimizer is walked down to its members."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [leaf for member in chained for leaf in _leaf_optimizers(member)]
    return [optimizer]


def static_bytes(model_chunks, optimizer, breakdown: bool = False):
    """Parameters, gradient buffers and optimizer state held by this rank, bytes.

    Counted as megatron-core allocates them, each storage once:

    * parameters: DDP's contiguous ``param_data`` buffers (distributed optimizer) or each parameter;
    * gradients: DDP's ``grad_data`` buffers (fp32 with ``grad_reduce_in_fp32``; ``main_grad`` is a
      view into them), padding included;
    * fp32 master weights of bf16 parameters: ``fp32_from_float16_groups``
      (Float16OptimizerWithFloat16Params, whole) or ``shard_fp32_from_float16_groups``
      (DistributedOptimizer, this rank's shard), for every member of a ChainedOptimizer;
    * Adam moments: the inner optimizer's state tensors; before the first step (torch creates
      ``exp_avg`` and ``exp_avg_sq`` lazily) two tensors like each parameter the inner optimizer
      updates (the fp32 masters or shards), as that step will allocate them.

    With ``breakdown`` returns ``{"params", "grads", "master", "moments", "total"}`` instead.
    """
    seen: set = set()
    parts = {"params": 0, "grads": 0, "master": 0, "moments": 0}

    def count(kind: str, t) -> None:
        if t is None or not torch.is_tensor(t) or t.dim() == 0 or t.numel() == 0:
            return
        s = t.untyped_storage()
        key = (t.device.type, s.data_ptr(), s.nbytes())
        if key not in seen:
            seen.add(key)
            parts[kind] += s.nbytes()

    for chunk in model_chunks:
        for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            count("params", getattr(buf, "param_data", None))
            count("grads", getattr(buf, "grad_data", None))
        for p in chunk.parameters():
            count("params", p.data)
            count("grads", getattr(p, "main_grad", None))
    for opt in _leaf_optimizers(optimizer):
        masters = getattr(opt, "shard_fp32_from_float16_groups", None)
        if masters is None:
            masters = getattr(opt, "fp32_from_float16_groups", [])
        for group in masters:
            for p in group:
                count("master", p)
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        adam = "adam" in type(inner).__name__.lower()
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state.get(p, {})
                tensors = [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
                if tensors:
                    for v in tensors:
                        count("moments", v)
                elif adam and p.numel():
                    parts["moments"] += 2 * p.numel() * p.element_size()  # exp_avg, exp_avg_sq to come
    total = sum(parts.values())
    return {**parts, "total": total} if breakdown else total
