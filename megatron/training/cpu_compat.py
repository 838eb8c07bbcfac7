"""Run megatron-core 0.16.x on CPU with gloo.

megatron-core assumes CUDA in a handful of places.  ``with patched():`` redirects exactly those for
the duration of a CPU run and restores every patched attribute on exit (it is never entered on the
GPU path; nested entries share one set of patches, undone when the outermost exits).  The trainer
(``pretrain_vlm.cli``) and ``omnibal profile`` enter it around the whole run, process-group teardown
included.  Each patch names the megatron-core code that needs it; all of them were needed on torch
2.13 (removing any one fails with "Torch not compiled with CUDA enabled", or silently misbehaves
where noted).

Why factory wrappers and not a global ``TorchFunctionMode``: autograd runs backward (and so
activation recompute) with function modes switched off, so a mode that rewrites ``device="cuda"``
misses the tensors created during recompute.  Wrapping the factory functions covers both.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from megatron.core.optimizer import clip_grads, optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

_MISSING = object()  # an attribute the owner inherited rather than held: deleted again on restore
_depth = 0  # how many patched() contexts are open
_saved: list[tuple[object, str, object]] = []  # (owner, attribute, its own value or _MISSING) per patch

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

    Scoped to megatron-core's DistributedOptimizer and Float16OptimizerWithFloat16Params construction, which sort parameters into fp16/bf16
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


class _HostEvent:
    """Stands for a CUDA event on the host: work on the CPU is done when it is issued."""

    def synchronize(self) -> None:
        pass


class _HostStream:
    """Stands for a CUDA stream on the host (one in-order stream: waiting on it is a no-op)."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()


_HOST_STREAM = _HostStream()


def _host_tensor_as_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for host tensors: the split sizes it copies off the GPU come back as
    numpy arrays there (what ``all_to_all_single`` takes as its split lists); a host tensor is returned unconverted,
    and gloo's ``all_to_all_single`` refuses a tensor of split sizes (TypeError)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _uneven_gather_along_first_dim(original):
    """``tensor_parallel.mappings._gather_along_first_dim`` whose uneven form (``output_split_sizes``) runs on gloo:
    megatron-core all-gathers into a list of differently sized views, and gloo's allgather requires equal sizes
    ("invalid tensor size"). Each rank's part is padded to the largest, gathered, and cut back."""

    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)

    return gather


def _uneven_reduce_scatter_along_first_dim(original):
    """``tensor_parallel.mappings._reduce_scatter_along_first_dim`` whose uneven form (``input_split_sizes``) runs on
    gloo, which has no list ``reduce_scatter``: the whole input is all-reduced and this rank keeps its split."""

    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        sizes = [int(n) for n in input_split_sizes]
        start = sum(sizes[:group.rank()])
        return total[start:start + sizes[group.rank()]].clone()

    return reduce_scatter


def _moe_patches() -> list[tuple[object, str, object]]:
    """megatron-core's MoE layer without TransformerEngine, on the host.

    * ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` only when TransformerEngine imports, yet the
      router's GEMM (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``: NameError without TE.
      Defined as None, it takes its torch.mm branch.
    * ``MoEAlltoAllTokenDispatcher`` makes a class-wide ``torch.cuda.Stream()`` in its constructor (when its
      ``cuda_dtoh_stream`` is None) and in its forward compares ``torch.cuda.current_stream()`` with it, enters
      ``torch.cuda.stream(...)`` and synchronises on its ``record_event()``: the host stand-ins above, one stream
      that is also the current one, so no copy is treated as on a side stream.
    * The same dispatcher turns its split sizes into numpy arrays with ``maybe_move_tensor_to_cpu``, which converts
      CUDA tensors only: ``_host_tensor_as_numpy`` converts host ones too.
    * Under expert tensor parallelism (ETP > 1) it all-gathers and reduce-scatters tokens of uneven counts over the
      ETP group (``tensor_parallel.mappings``), which gloo cannot: ``_uneven_gather_along_first_dim`` and
      ``_uneven_reduce_scatter_along_first_dim``.
    """
    patches = [
        (mappings, "_gather_along_first_dim", _uneven_gather_along_first_dim(mappings._gather_along_first_dim)),
        (mappings, "_reduce_scatter_along_first_dim",
         _uneven_reduce_scatter_along_first_dim(mappings._reduce_scatter_along_first_dim)),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_tensor_as_numpy),
        (MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _HOST_STREAM),
        (torch.cuda, "current_stream", lambda *args, **kwargs: _HOST_STREAM),
        (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
    ]
    if "te_general_gemm" not in vars(moe_utils):
        patches.append((moe_utils, "te_general_gemm", None))
    return patches


def _eager_fused_functions() -> list[tuple[object, str, object]]:
    """megatron-core's ``jit_fuser`` functions (``torch.compile`` in megatron/core/jit.py) that our CPU runs reach,
    run eagerly: ``Attention._apply_output_gate`` (gated attention: ``attention_output_gate``).

    A first ``torch.compile`` inside these patches (the factories and ``torch.cuda`` stand-ins above) leaves the
    process's later eager code wrong: a transformers model built afterwards, outside the patches, gives other logits
    (rows past the first off by ~4; tests/test_lora.py's export test after the gated-attention model tests). On the
    host the fusion gains nothing, and compiling costs seconds.
    """
    patches = []
    for owner, name in ((Attention, "_apply_output_gate"),):
        compiled = vars(owner)[name]
        plain = getattr(compiled, "_torchdynamo_orig_callable", None)
        if plain is not None:
            patches.append((owner, name, plain))
    return patches


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) of every CPU patch."""
    return [*_moe_patches(), *_eager_fused_functions(),
        # device=torch.cuda.current_device() in tensor_parallel (gather buffers), DDP grad buffers
        # (distributed/param_and_grad_buffer.py), p2p receive buffers, RoPE.
        (torch.cuda, "current_device", lambda: "cpu"),
        # torch.cuda.synchronize() in pipeline_parallel/p2p_communication.py and DDP.
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        # Tensor.cuda() in LanguageModule.setup_embeddings_and_output_layer (tied embeddings, PP>1)
        # and optimizer state loading.
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
        *[(torch, name, _wrap_factory(getattr(torch, name))) for name in _FACTORIES],
        # The model-parallel ("CUDA") RNG tracker of tensor_parallel/random.py keeps CUDA generator
        # states for dropout inside TP regions and for activation recompute.  On CPU the CPU
        # generator plays that role: get/set/seed are routed to it, which keeps recompute's
        # save/restore of RNG states consistent.
        (tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (torch.cuda, "manual_seed", torch.manual_seed),  # tracker.add() seeds, reads, then restores
        # optimizer/clip_grads.py asserts CUDA grads; optimizer.py imported the function by name.
        (clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32),
        (optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32),
        # optimizer/distrib_optimizer.py: DistributedOptimizer.__init__ (and the
        # _build_model_and_main_param_groups it calls) accept only parameters whose type() is a
        # torch.cuda.*Tensor name.
        (DistributedOptimizer, "__init__", _with_cuda_type_names(DistributedOptimizer.__init__)),
        # optimizer/optimizer.py: Float16OptimizerWithFloat16Params.__init__ sorts parameters the same
        # way (bf16 parameters on CPU: tests build the bf16 optimizer without training in bf16).
        (Float16OptimizerWithFloat16Params, "__init__",
         _with_cuda_type_names(Float16OptimizerWithFloat16Params.__init__)),
    ]


def _install() -> None:
    for owner, name, replacement in _patches():
        _saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, replacement)


def _restore() -> None:
    while _saved:
        owner, name, original = _saved.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def active() -> bool:
    """Whether a patched() context is open."""
    return _depth > 0


@contextlib.contextmanager
def patched():
    """Patch torch/megatron-core for CPU training while the context is open; restore on exit."""
    global _depth
    if _depth == 0:
        _install()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _restore()


def patched_for(device: torch.device):
    """:func:`patched` for a CPU ``device``, a context that does nothing for any other."""
    return patched() if device.type == "cpu" else contextlib.nullcontext()
