"""Run megatron-core 0.16.x on CPU with gloo.

megatron-core assumes CUDA in a handful of places.  :func:`apply` redirects exactly those, and
only when training runs on CPU (it is never called on the GPU path).  Each patch names the
megatron-core code that needs it; all of them were needed on torch 2.13 (removing any one fails
with "Torch not compiled with CUDA enabled", or silently misbehaves where noted).

Why factory wrappers and not a global ``TorchFunctionMode``: autograd runs backward (and so
activation recompute) with function modes switched off, so a mode that rewrites ``device="cuda"``
misses the tensors created during recompute.  Wrapping the factory functions covers both.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED = False

# torch factory functions that megatron-core calls with device="cuda" or
# device=torch.cuda.current_device(): schedules (total token count), optimizer (loss scale),
# clip_grads (norm buffers), tensor_parallel.mappings/layers (gather buffers), attention masks.
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "as_tensor")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__omnibal_cpu__ = True
    return wrapper


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Scale gradients by max_norm / total_norm when that is below 1.

    Replaces megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32, which asserts
    ``grad.type() == 'torch.cuda.FloatTensor'`` and scales through a CUDA multi-tensor kernel.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in parameters:
            g = getattr(p, attr, None)
            if g is not None:
                g.detach().mul_(clip_coeff)


@contextlib.contextmanager
def _cuda_type_names():
    """``Tensor.type()`` (no arguments) names CPU tensors as their CUDA kind, e.g. 'torch.cuda.FloatTensor'.

    Scoped to megatron-core's DistributedOptimizer construction, which sorts parameters into fp16/bf16
    and fp32 groups by those names and raises TypeError for any other.
    """
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def apply() -> None:
    """Patch torch/megatron-core for CPU training.  Idempotent."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True

    # device=torch.cuda.current_device() in tensor_parallel (gather buffers), DDP grad buffers
    # (distributed/param_and_grad_buffer.py), p2p receive buffers, RoPE.
    torch.cuda.current_device = lambda: "cpu"
    # torch.cuda.synchronize() in pipeline_parallel/p2p_communication.py and DDP.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # Tensor.cuda() in LanguageModule.setup_embeddings_and_output_layer (tied embeddings, PP>1)
    # and optimizer state loading.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "__omnibal_cpu__", False):
            setattr(torch, name, _wrap_factory(fn))

    # The model-parallel ("CUDA") RNG tracker of tensor_parallel/random.py keeps CUDA generator
    # states for dropout inside TP regions and for activation recompute.  On CPU the CPU
    # generator plays that role: get/set/seed are routed to it, which keeps recompute's
    # save/restore of RNG states consistent.
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed  # tracker.add() seeds, reads, then restores

    # optimizer/clip_grads.py asserts CUDA grads; optimizer.py imported the function by name.
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    # optimizer/distrib_optimizer.py: DistributedOptimizer.__init__ (and the
    # _build_model_and_main_param_groups it calls) accept only parameters whose type() is a
    # torch.cuda.*Tensor name.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.__init__ = _with_cuda_type_names(DistributedOptimizer.__init__)
