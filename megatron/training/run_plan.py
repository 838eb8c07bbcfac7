"""What a run trains and how, once the launch has decided it: the model with its padded vocabulary, the tokenizer's
source, the pipeline layout and the recompute per stage, the overlap settings, the Hugging Face source.

The flags are the :class:`~megatron.training.config.RunConfig` (``arguments.parse_config``); what follows from them
once the world, the device, the tokenizer, the data and the profile are known is a :class:`RunPlan`, made whole
by one function, ``setup.build_run_plan`` (no field waits to be chosen), and passed to what builds and trains the
model (training, checkpointing).
"""
from __future__ import annotations

from dataclasses import dataclass

from omnibal_ext.memory.recompute import RecomputePlan
from omnibal_ext.memory.stage_recompute import StageRecompute
from omnibal_ext.model.layout import PipelineLayout
from omnibal_ext.model.units import ModelSpec, build_units

from .config import ParallelConfig, RunConfig


@dataclass(frozen=True)
class RunPlan:
    """What a run trains and how (see the module docstring)."""

    config: RunConfig
    """The run's flags, typed."""
    model_spec: ModelSpec
    """The model (``config.model.spec``) with its vocabulary padded for the tokenizer (rows: a multiple of 128 that
    TP divides; ``language.real_vocab_size`` is the tokenizer's)."""
    tokenizer_model: str | None
    """Folder of the Hugging Face tokenizer (--tokenizer-model, else --hf-checkpoint's folder when it holds a
    tokenizer); None: the built-in byte-level one."""
    layout: PipelineLayout
    """Units per pipeline stage (--pipeline-layout, Megatron's default, or searched by --omnibal-partition auto)."""
    recompute: tuple[StageRecompute, ...]
    """Recompute settings per layout stage (--recompute-granularity/--recompute-plan, or planned by
    --omnibal-recompute auto)."""
    overlap_grad_reduce: bool
    """Overlap DDP's gradient reduction with the backward pass (--overlap-grad-reduce; default: on CUDA)."""
    overlap_param_gather: bool
    """Overlap the distributed optimizer's parameter all-gather with the next forward
    (--overlap-param-gather; default: on CUDA with --use-distributed-optimizer)."""
    hf_meta: dict | None = None
    """With --hf-checkpoint: its config, layout, key style and dtype (``HFSource.meta()``), kept in
    checkpoints for ``omnibal hf export``; else None."""
    adaptive_recompute: RecomputePlan | None = None
    """With --omnibal-recompute auto: the planner's answer, with its predicted peak and static bytes and the
    budget per stage (reported beside the measured memory); else None."""

    def rank_stages(self, rank: int, pp: int) -> list[int]:
        """The layout stages (one per model chunk, in chunk order) pipeline rank ``rank`` of ``pp`` runs."""
        return self.layout.rank_stages(rank, pp)

    @property
    def layout_flag(self) -> str:
        """The layout in --pipeline-layout syntax (e.g. ``Iv*4PEt*2|t*2L``)."""
        return self.layout.to_flag(build_units(self.model_spec))


def resolve_overlap(parallel: ParallelConfig, device) -> tuple[bool, bool]:
    """(overlap_grad_reduce, overlap_param_gather) of this run on ``device`` (a torch.device): each flag as given,
    else on for CUDA (param gather only with the distributed optimizer), off on CPU."""
    on_cuda = device.type == "cuda"
    grad = on_cuda if parallel.overlap_grad_reduce is None else bool(parallel.overlap_grad_reduce)
    param = bool(parallel.overlap_param_gather) if parallel.overlap_param_gather is not None else \
        on_cuda and parallel.use_distributed_optimizer
    return grad, param
