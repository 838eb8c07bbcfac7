"""Measure pipeline units on a device (the one torch user in omnibal_ext).

``measure_unit`` times any callable's forward and backward and counts the bytes autograd keeps
for backward (via ``torch.autograd.graph.saved_tensors_hooks``, de-duplicated by storage, with
parameters' storages left out); ``to_unit_cost`` turns a measurement into a unit's ``UnitCost``, and
``environment_meta`` names the versions and host a profile's ``CostTable`` records (the trainer's profiler,
megatron/training/profiling.py, writes the profile JSON that ``cost_model.calibrated_costs`` reads).
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .costs import UnitCost


@dataclass(frozen=True)
class UnitMeasurement:
    """fwd_s, bwd_s: median seconds over the repeats; act_bytes: bytes of the distinct storages
    autograd saved for backward (parameters excluded); output_bytes: bytes of the output tensor."""

    fwd_s: float
    bwd_s: float
    act_bytes: int
    output_bytes: int


def _sync(tensors) -> None:
    if torch.cuda.is_available() and any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def _storage_key(t: torch.Tensor) -> tuple:
    st = t.untyped_storage()
    return (t.device.type, t.device.index, st.data_ptr(), st.nbytes())


def measure_unit(
    forward: Callable[..., torch.Tensor],
    make_inputs: Callable[[], tuple],
    warmup: int = 2,
    repeats: int = 5,
    *,
    exclude: Iterable[torch.Tensor] = (),
) -> UnitMeasurement:
    """Time ``forward(*make_inputs())`` and its backward; count its saved activations.

    make_inputs: returns fresh inputs each call; tensors that need gradients must have
        ``requires_grad`` set (the backward runs from ``output.backward(ones)``).
    exclude: tensors whose storages are not activations (parameters). When ``forward`` is a
        ``torch.nn.Module`` its parameters and buffers are excluded automatically.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"measure_unit: repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    skip = {_storage_key(t) for t in exclude}
    if isinstance(forward, torch.nn.Module):
        skip |= {_storage_key(p) for p in forward.parameters()}
        skip |= {_storage_key(b) for b in forward.buffers()}
    fwd_times, bwd_times = [], []
    act_bytes = output_bytes = 0
    for it in range(warmup + repeats):
        inputs = make_inputs()
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        saved: dict[tuple, int] = {}

        def pack(t: torch.Tensor):
            key = _storage_key(t)
            if key not in skip:
                saved[key] = key[3]
            return t

        _sync(inputs)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(*inputs)
        _sync((out,))
        t1 = time.perf_counter()
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"measure_unit: forward must return one tensor, got {type(out).__name__}")
        grad = torch.ones_like(out)
        _sync((grad,))
        t2 = time.perf_counter()
        if out.requires_grad:
            out.backward(grad)
        _sync((out,))
        t3 = time.perf_counter()
        if it >= warmup:
            fwd_times.append(t1 - t0)
            bwd_times.append(t3 - t2)
            act_bytes = sum(saved.values())
            output_bytes = out.numel() * out.element_size()
    return UnitMeasurement(statistics.median(fwd_times), statistics.median(bwd_times), int(act_bytes), int(output_bytes))


def to_unit_cost(
    name: str, kind: str, m: UnitMeasurement, param_count: int, *, act_bytes_full: float | None = None,
    act_bytes_selective: float | None = None, selective_recompute_s: float = 0.0,
) -> UnitCost:
    """A ``UnitCost`` from a measurement (full-recompute bytes default to the output bytes, the size
    of the unit's input for a transformer layer; selective defaults to no saving)."""
    return UnitCost(
        name=name, kind=kind, fwd_s=m.fwd_s, bwd_s=m.bwd_s, act_bytes=float(m.act_bytes),
        act_bytes_full=float(m.output_bytes if act_bytes_full is None else act_bytes_full),
        act_bytes_selective=float(m.act_bytes if act_bytes_selective is None else act_bytes_selective),
        selective_recompute_s=float(selective_recompute_s), send_bytes=float(m.output_bytes),
        param_count=int(param_count),
    )


def environment_meta() -> dict:
    """Versions and host of this process (torch, megatron-core, python, CUDA device name)."""
    meta = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    try:  # read the installed distribution's version (importing megatron.core is slow)
        from importlib.metadata import PackageNotFoundError, version

        meta["megatron_core"] = version("megatron-core")
    except PackageNotFoundError:
        meta["megatron_core"] = None
    meta["cuda_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return meta

