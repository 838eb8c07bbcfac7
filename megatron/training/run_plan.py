"""The run the flags describe, once the world, the device, the tokenizer, the data and the profile are known.

``parse_args`` only checks the flags: the parsed ``args`` are never written to.  What follows from them —
parallel and batch sizes, the model with its padded vocabulary, the tokenizer source, the ISF caps, the
pipeline layout and the recompute plan, the overlap settings, the Hugging Face source — is a
:class:`RunPlan`, made by :func:`plan_run` at launch and completed with ``dataclasses.replace`` as each part
becomes known (pretrain_vlm.py: tokenizer -> data -> layout -> recompute), then passed to the functions
that need it (setup, training, checkpointing).
"""
from __future__ import annotations

from dataclasses import dataclass

from omnibal_ext.memory.recompute import RecomputePlan
from omnibal_ext.memory.stage_recompute import StageRecompute
from omnibal_ext.model.cp_split import cp_multiple
from omnibal_ext.model.layout import PipelineLayout
from omnibal_ext.model.lora import Lora
from omnibal_ext.model.trainable import Trainable, trainable_of
from omnibal_ext.model.units import ModelSpec, build_units

from .arguments import batch_sizes, data_parallel_size, model_spec_of, moe_run_of, virtual_pipeline_size


@dataclass(frozen=True)
class RunPlan:
    """What a run trains and how, derived from its flags (see the module docstring)."""

    model_spec: ModelSpec
    """The model: the preset with the model flags, or --hf-checkpoint's config.json.  Once the tokenizer is
    set up (``tokenizer_setup.setup_tokenizer``) its vocabulary is padded (rows: a multiple of 128 that TP
    divides) and ``language.real_vocab_size`` is the tokenizer's."""
    data_parallel_size: int
    """Data-parallel ranks: world size / (TP x PP)."""
    global_batch_size: int
    """Samples per iteration, all data-parallel ranks together (--global-batch-size; default 4 micro-batches
    per data-parallel rank)."""
    num_microbatches: int
    """Micro-batches per iteration on each data-parallel rank: global batch / (micro-batch size x DP)."""
    overlap_grad_reduce: bool
    """Overlap DDP's gradient reduction with the backward pass (--overlap-grad-reduce; default: on CUDA)."""
    overlap_param_gather: bool
    """Overlap the distributed optimizer's parameter all-gather with the next forward
    (--overlap-param-gather; default: on CUDA with --use-distributed-optimizer)."""
    log_activation_memory: bool
    """Measure saved-activation bytes per stage (--log-activation-memory, or --omnibal-recompute auto)."""
    context_parallel_size: int = 1
    """Ranks each packed sample of the LLM is split over (--context-parallel-size); DP excludes them."""
    tokenizer_model: str | None = None
    """Folder of the Hugging Face tokenizer (--tokenizer-model, else --hf-checkpoint's folder when it holds a
    tokenizer); None: the built-in byte-level one."""
    hf_meta: dict | None = None
    """With --hf-checkpoint: its config, layout, key style and dtype (``HFSource.meta()``), kept in
    checkpoints for ``omnibal hf export``; else None."""
    isf_params: dict | None = None
    """With --omnibal-isf: the caps of a group {"qv", "qv_min": ViT tiles; "qt", "qt_min": LLM tokens}
    (given or searched); else None."""
    isf_mean_group: dict | None = None
    """With --omnibal-isf: the mean group {"tiles", "tokens", "attn_tokens_sq": sum of squared sample
    lengths, tokens^2} (what a micro-batch costs on average; counted tokens); else None."""
    isf_token_multiple: int = 1
    """ISF counts each sample's tokens rounded up to a multiple of this (--omnibal-isf-token-multiple, default what
    context parallelism pads a sample to: 2 x CP, x TP with --sequence-parallel; 1 without CP)."""
    layout: PipelineLayout | None = None
    """Units per pipeline stage (--pipeline-layout, Megatron's default, or searched by --omnibal-partition
    auto); None until chosen."""
    recompute: tuple[StageRecompute, ...] | None = None
    """Recompute settings per pipeline stage (--recompute-granularity/--recompute-plan, or planned by
    --omnibal-recompute auto); None until chosen."""
    trainable: Trainable | None = None
    """Which units train (--freeze-*, --unfreeze-*; omnibal_ext.model.trainable); None: all of them."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline rank (V; --virtual-pipeline-model-parallel-size or --pipeline-layout's stages
    / PP): the layout has V x PP stages, stage i runs on pipeline rank i mod PP as its chunk i div PP, under
    megatron-core's interleaved 1F1B schedule when V > 1."""
    lora: Lora = Lora()
    """LoRA adapters (--lora-*; omnibal_ext.model.lora): rank 0 = none; with them the layers run megatron-core's
    torch linears (--transformer-impl local)."""
    moe_run: object = None
    """With --num-experts: how the MoE layers train (``megatron.vlm.layers.moe.MoERun``: loss coefficients, expert bias,
    dispatcher, EP / ETP); else None."""
    recompute_plan: RecomputePlan | None = None
    """With --omnibal-recompute auto: the planner's answer, with its predicted peak and static bytes and the
    budget per stage (reported beside the measured memory); else None."""

    def rank_stages(self, rank: int, pp: int) -> list[int]:
        """The layout stages (one per model chunk, in chunk order) pipeline rank ``rank`` of ``pp`` runs."""
        return self.layout.rank_stages(rank, pp)

    @property
    def layout_flag(self) -> str | None:
        """The layout in --pipeline-layout syntax (e.g. ``Iv*4PEt*2|t*2L``); None before it is chosen."""
        return None if self.layout is None else self.layout.to_flag(build_units(self.model_spec))


def resolve_overlap(args, device) -> tuple[bool, bool]:
    """(overlap_grad_reduce, overlap_param_gather) of this run: each flag as given, else on for CUDA
    (param gather only with the distributed optimizer), off on CPU."""
    on_cuda = device.type == "cuda"
    grad = on_cuda if args.overlap_grad_reduce is None else bool(args.overlap_grad_reduce)
    param = bool(args.overlap_param_gather) if args.overlap_param_gather is not None else \
        on_cuda and args.use_distributed_optimizer
    return grad, param


def plan_run(args, world_size: int, device) -> RunPlan:
    """The plan of checked flags ``args`` for ``world_size`` processes on ``device`` (a torch.device): sizes,
    model (vocabulary not yet padded), overlap; the parts known later are filled in by the caller."""
    dp = data_parallel_size(args, world_size)
    global_batch, microbatches = batch_sizes(args, dp)
    overlap_grad, overlap_param = resolve_overlap(args, device)
    spec = model_spec_of(args)
    return RunPlan(model_spec=spec, data_parallel_size=dp, global_batch_size=global_batch,
                   num_microbatches=microbatches, overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param,
                   log_activation_memory=args.log_activation_memory or args.omnibal_recompute == "auto",
                   tokenizer_model=args.tokenizer_model, trainable=trainable_of(args, spec),
                   context_parallel_size=args.context_parallel_size,
                   isf_token_multiple=isf_token_multiple(args), lora=Lora.from_args(args),
                   virtual_pipeline_size=virtual_pipeline_size(args), moe_run=moe_run_of(args, spec))


def isf_token_multiple(args) -> int:
    """--omnibal-isf-token-multiple, else the multiple context parallelism pads every sample to (1 without CP)."""
    if args.omnibal_isf_token_multiple is not None:
        return args.omnibal_isf_token_multiple
    sp_tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return cp_multiple(args.context_parallel_size, sp_tp)
