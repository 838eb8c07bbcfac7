"""LoRA adapters on megatron-core's tensor-parallel linears, put into a layer spec's submodules.

``with_lora(spec, lora, names)`` replaces the ``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2``
submodules of a layer spec by subclasses of their classes that add ``scaling * B A dropout(x)`` to the base
output (``omnibal_ext.model.lora``: ``lora_a [r, in]``, ``lora_b [out, r]``, scaling alpha / r).  Each adapter is
split over tensor parallelism like its base:

* column-parallel base (output split; qkv, fc1): A replicated, B split by rows.  ``h = A x`` is the same on
  every TP rank, and ``B_rank h`` is the rank's slice of the output; the gradient of ``h`` is the sum of the
  ranks' parts: all-reduced over TP (with sequence parallelism ``h`` is all-gathered from the ranks' tokens
  and its gradient reduce-scattered), so A's gradient is whole on every rank;
* row-parallel base (input split; proj, fc2): A split by columns, B replicated.  ``A_rank x_rank`` are partial
  sums of ``h``, all-reduced over TP (with sequence parallelism reduce-scattered to the rank's tokens) before
  B, as the base reduces its own partial outputs.

B starts at zero; A is drawn from a generator seeded by (seed, unit, linear) (``megatron.vlm.layers.seeding``) over its
full width, and a TP rank keeps its slice, so every TP size starts from the same adapters.  Adapter parameters
split over TP carry megatron-core's tensor-parallel attributes; the replicated ones see only the rank's tokens
under sequence parallelism and are marked ``sequence_parallel`` with the other replicated parameters
(``layers.build_blocks``), so their gradients are summed over TP.

Dropout on the adapter's input (``--lora-dropout``): the keep mask of the full input (all tokens, all
features) is drawn from the adapter's own state in megatron-core's RNG tracker, seeded by (seed, unit,
linear) alike on every TP rank, and a rank keeps its slice (its tokens under sequence parallelism, its
features for a row-parallel base): every TP size draws the serial run's masks.  megatron-core's activation
recompute saves and restores the tracker's states, so a recomputed layer replays the same masks, and
checkpoints keep them with the RNG states (a resume at the same TP/PP/DP continues the streams).

Checkpoints: ``lora_a`` / ``lora_b`` beside the base's ``weight``, split along the same axis as the base
(a gated fc1's ``lora_b`` as its ``weight``: gate and up halves), so they reshard across TP sizes.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from omnibal_ext.model.lora import LINEARS, Lora

from megatron.vlm.layers.drop_path import hash_key
from megatron.vlm.layers.seeding import unit_seed
from megatron.vlm.parallel.padded_heads import tp_rank

# short name -> where the linear sits in a TransformerLayer spec
_PLACES = {"qkv": ("self_attention", "linear_qkv"), "proj": ("self_attention", "linear_proj"),
           "fc1": ("mlp", "linear_fc1"), "fc2": ("mlp", "linear_fc2")}
_LORA_CLASSES: dict = {}


def with_lora(spec: ModuleSpec, lora: Lora, names: tuple[str, ...]) -> ModuleSpec:
    """A copy of the layer ``spec`` whose linears ``names`` (``LINEARS`` short names) carry adapters."""
    if not names:
        return spec
    spec = copy.deepcopy(spec)
    for name in names:
        block, attr = _PLACES[name]
        holder = getattr(spec.submodules, block).submodules
        base = getattr(holder, attr)
        base_cls, params = (base.module, dict(base.params)) if isinstance(base, ModuleSpec) else (base, {})
        setattr(holder, attr, ModuleSpec(module=lora_linear(base_cls, LINEARS[name]),
                                         params={**params, "lora": lora, "lora_name": name}))
    return spec


def lora_linear(base_cls: type, parallel: str) -> type:
    """``base_cls`` (a column- or row-parallel linear of megatron-core) with an adapter."""
    if (base_cls, parallel) not in _LORA_CLASSES:
        _LORA_CLASSES[base_cls, parallel] = type(f"Lora{base_cls.__name__}", (LoraMixin, base_cls),
                                                 {"parallel": parallel})
    return _LORA_CLASSES[base_cls, parallel]


class LoraMixin:
    """The adapter of a megatron-core linear (placed before the linear's class: ``lora_linear``).

    Built by the layer spec with ``lora`` (the flags) and ``lora_name`` (qkv, proj, fc1, fc2); the layer
    draws A and sets up the dropout stream once it knows its unit (``SeededTransformerLayer`` calls
    ``draw_adapter``)."""

    parallel = "column"

    def __init__(self, *args, lora: Lora, lora_name: str, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        self.lora_name, self.lora_rank, self.lora_scaling = lora_name, lora.rank, lora.scaling
        self.lora_dropout = lora.dropout
        self.lora_gated = lora_name == "fc1" and config.gated_linear_unit
        self.tp, self.rank_in_tp = config.tensor_model_parallel_size, tp_rank(config)
        out_local, in_local = self.weight.shape
        self.full_in = in_local * (self.tp if self.parallel == "row" else 1)
        dtype = config.params_dtype
        self.lora_a = torch.nn.Parameter(torch.zeros(lora.rank, in_local, dtype=dtype))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, lora.rank, dtype=dtype))
        if self.parallel == "column":
            set_tensor_model_parallel_attributes(self.lora_b, True, 0, 1)
        else:
            set_tensor_model_parallel_attributes(self.lora_a, True, 1, 1)
        self.lora_stream = None  # name of this adapter's RNG tracker state (dropout), set by draw_adapter

    def draw_adapter(self, seed: int, unit: int) -> None:
        """A from (seed, unit, linear) over its full width, this rank's slice kept (PEFT's default init
        range: uniform in +-1/sqrt(in)); B zero; the dropout stream registered with megatron-core's tracker."""
        key = hash_key(unit_seed(seed, unit), sorted(LINEARS).index(self.lora_name))
        gen = torch.Generator().manual_seed(key)
        bound = 1.0 / math.sqrt(self.full_in)
        full = torch.empty(self.lora_rank, self.full_in).uniform_(-bound, bound, generator=gen)
        width = self.lora_a.shape[1]
        mine = full[:, self.rank_in_tp * width:(self.rank_in_tp + 1) * width] if self.parallel == "row" else full
        with torch.no_grad():
            self.lora_a.copy_(mine.to(self.lora_a.dtype))
            self.lora_b.zero_()
        if self.lora_dropout > 0:
            self.lora_stream = f"lora-dropout-{unit}-{self.lora_name}"
            tracker = tensor_parallel.get_cuda_rng_tracker()
            if self.lora_stream not in tracker.get_states():
                tracker.add(self.lora_stream, hash_key(key, 0x10A) % (2**31 - 1))

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        return out + self.lora_delta(input_).to(out.dtype), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * B A dropout(x): this rank's part of the output (after the base's TP reduction)."""
        sp = self.config.sequence_parallel and self.tp > 1
        if self.lora_dropout > 0 and self.training:
            x = x * self._keep_mask(x, sp)
        h = F.linear(x, self.lora_a)
        if self.tp > 1:
            if self.parallel == "column":
                h = (tensor_parallel.gather_from_sequence_parallel_region(h) if sp
                     else tensor_parallel.copy_to_tensor_model_parallel_region(h))
            else:
                h = (tensor_parallel.reduce_scatter_to_sequence_parallel_region(h) if sp
                     else tensor_parallel.reduce_from_tensor_model_parallel_region(h))
        return F.linear(h, self.lora_b) * self.lora_scaling

    def _keep_mask(self, x: torch.Tensor, sp: bool) -> torch.Tensor:
        """0 or 1/keep per element of ``x``: this rank's slice of the full input's mask (module docstring)."""
        seq_split = sp and self.parallel == "column"  # column-parallel input under SP: the rank's tokens
        shape = list(x.shape)
        if seq_split:
            shape[0] *= self.tp
        if self.parallel == "row":
            shape[-1] *= self.tp
        keep = 1.0 - self.lora_dropout
        mask = (self._uniform(shape, x.device) < keep).to(x.dtype) / keep
        r = self.rank_in_tp
        if seq_split:
            mask = mask.narrow(0, r * x.shape[0], x.shape[0])
        if self.parallel == "row":
            mask = mask.narrow(-1, r * x.shape[-1], x.shape[-1])
        return mask

    def _uniform(self, shape: list[int], device) -> torch.Tensor:
        """Uniform [0, 1) numbers of ``shape`` from this adapter's stream, whose state lives in megatron-core's RNG
        tracker (saved and restored by its recompute), drawn by a generator of its own (the tracker's ``fork``
        would swap the device's default generator, which on CPU is the CPU generator it warns about)."""
        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = tracker.get_states()
        gen = torch.Generator(device=device)
        gen.set_state(states[self.lora_stream])
        u = torch.rand(shape, generator=gen, device=device)
        states[self.lora_stream] = gen.get_state()
        tracker.set_states(states)
        return u

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = {"lora_b": 0} if self.parallel == "column" else {"lora_a": 1}
        adapters = {"lora_a": self.lora_a, "lora_b": self.lora_b}
        sd.update(make_sharded_tensors_for_checkpoint(adapters, prefix, axis, sharded_offsets))
        if self.lora_gated:  # per rank [gate | up] rows, as the base weight (megatron-core's MLP does that for it)

            sd[prefix + "lora_b"] = apply_swiglu_sharded_factory(sd[prefix + "lora_b"], sharded_offsets)
        return sd


def is_adapter(name: str) -> bool:
    """A parameter name of a LoRA adapter (``...linear_qkv.lora_a``)."""
    return name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * B @ A`` of global (checkpoint) tensors, in fp32, returned in ``weight``'s dtype.

    weight ``[out, in]``, A ``[r, in]``, B ``[out, r]``; the ViT's per-head layouts (``sharding.drop_padded_heads``):
    QKV weight ``[heads, 3 d, in]`` with B ``[heads, 3 d, r]``; out-projection weight ``[heads, out, d]`` with A
    ``[heads, r, d]``."""
    a, b = lora_a.float(), lora_b.float()
    if a.dim() == 3:  # out-projection per head: delta[h] = B @ A[h]
        delta = torch.einsum("or,hrd->hod", b, a)
    elif b.dim() == 3:  # QKV per head: delta[h] = B[h] @ A
        delta = torch.einsum("hkr,ri->hki", b, a)
    else:
        delta = b @ a
    if delta.shape != weight.shape:
        raise ValueError(f"LoRA merge: B @ A has shape {tuple(delta.shape)}, the weight {tuple(weight.shape)}")
    return (weight.float() + scaling * delta).to(weight.dtype)
