"""The run's flags as frozen, typed configs: what a user asked, parsed and checked once.

``flags.parse_config`` turns the command line into a :class:`RunConfig`; nothing below ``pretrain_vlm.main`` reads
the parsed flags (an ``argparse.Namespace``) again.  A section per concern:

* :class:`ModelConfig`: the model (``ModelSpec``, from the preset and the model flags or ``--hf-checkpoint``), its
  frozen units, LoRA, how its MoE layers train and how its layers run;
* :class:`ParallelConfig`: TP / PP / CP / EP sizes with the data-parallel size and model chunks they leave, the
  device, the distributed optimizer and overlap;
* :class:`DataConfig`: the records, the tokenizer, the image and video flags, the loader;
* :class:`BalanceConfig`: OmniBal's three levels (``--omnibal-*``) beside Megatron's manual choices they replace
  (``--pipeline-layout``, ``--recompute-*``);
* :class:`OptimConfig`: batch sizes, iterations, learning rates, Adam, precision, the loss;
* :class:`LogConfig`: logging, evaluation and the measurements a run reports;
* :class:`CheckpointConfig`: saving and resuming.

Field names are the flags' (``--tensor-model-parallel-size`` is ``parallel.tensor_model_parallel_size``), except in
:class:`BalanceConfig`, where ``--omnibal-X`` is ``balance.X``.  A field documented "resolved" holds the value
the run uses where the flag's default is "derived" (e.g. the data-parallel size, the global batch).  What the
launch then decides (the padded vocabulary, the ISF groups, the layout, the recompute) is the
``megatron.training.run_plan.RunPlan``.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from omnibal_ext.data.isf import ISFParams
from omnibal_ext.model.lora import Lora
from omnibal_ext.model.trainable import Trainable
from omnibal_ext.model.units import ModelSpec

from megatron.vlm.data.images import MediaOverrides
from megatron.vlm.layers.moe import MoERun


@dataclass(frozen=True)
class ModelConfig:
    """The model and how its layers are built."""

    spec: ModelSpec
    """The model the flags describe: the preset (--model) with the model flags, or --hf-checkpoint's config.json.
    Its vocabulary is not yet padded for the tokenizer: the run's model is ``RunPlan.model_spec``."""
    hf_checkpoint: str | None
    """Hugging Face folder the weights (and by default the tokenizer) come from (--hf-checkpoint); None: drawn."""
    trainable: Trainable
    """Which units train (--freeze-*, --unfreeze-*, --lora-*; ``omnibal_ext.model.trainable``)."""
    lora: Lora
    """LoRA adapters (--lora-*): rank 0 = none; with them the layers run megatron-core's torch linears."""
    moe_run: MoERun | None
    """With an MoE LLM: how its layers train (--moe-* loss coefficients, expert bias, dispatcher, EP / ETP);
    None for a dense LLM."""
    transformer_impl: str
    """Layer implementation: "auto", "local" (megatron-core's torch modules) or "transformer_engine"."""
    attention_backend: str
    """Core attention of the torch layers: "auto" (packed sequences, THD) or "unfused" (dense mask)."""
    vision_drop_path_rate: float
    """ViT stochastic depth: the rate of the last layer (0: none), rising linearly from 0 over the layers."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks split the model and the data."""

    world_size: int
    """Processes of the run (torchrun's WORLD_SIZE)."""
    tensor_model_parallel_size: int
    """TP: ranks each layer's weights are split over."""
    pipeline_model_parallel_size: int
    """PP: pipeline ranks."""
    context_parallel_size: int
    """CP: ranks each packed sample of the LLM is split over (2 x CP chunks per sample)."""
    data_parallel_size: int
    """DP (resolved): world size / (TP x PP x CP)."""
    virtual_pipeline_size: int
    """V (resolved): model chunks per pipeline rank: --virtual-pipeline-model-parallel-size, else
    --pipeline-layout's stages / PP, else 1.  V > 1: megatron-core's interleaved 1F1B schedule."""
    sequence_parallel: bool
    """Megatron sequence parallelism in the ViT and LLM layers (norms and dropout on 1/TP of the tokens)."""
    expert_model_parallel_size: int
    """EP: ranks the routed experts are divided over (num-experts / EP each)."""
    expert_tensor_parallel_size: int
    """ETP (resolved): tensor-parallel size of each expert (--expert-tensor-parallel-size, default TP)."""
    device: str
    """--device as given: "auto" (CUDA + NCCL when a GPU is visible, else CPU + gloo), "cpu" or "cuda"."""
    distributed_timeout_minutes: float
    """How long a collective or p2p transfer waits for the other ranks before it fails (minutes)."""
    use_distributed_optimizer: bool
    """Shard the optimizer state over the data-parallel ranks (megatron-core's distributed optimizer)."""
    overlap_grad_reduce: bool | None
    """Overlap DDP's gradient reduction with the backward pass; None: on for CUDA runs (``RunPlan``)."""
    overlap_param_gather: bool | None
    """Overlap the distributed optimizer's parameter all-gather with the next forward; None: on for CUDA runs
    with the distributed optimizer (``RunPlan``)."""

    @property
    def timeout(self) -> datetime.timedelta:
        """--distributed-timeout-minutes as the timeout every process group of the run is made with."""
        return datetime.timedelta(minutes=self.distributed_timeout_minutes)

    @property
    def sequence_parallel_tp(self) -> int:
        """The multiple sequence parallelism pads the LLM's rows to: TP with --sequence-parallel, else 1."""
        return self.tensor_model_parallel_size if self.sequence_parallel else 1


@dataclass(frozen=True)
class DataConfig:
    """The records, how they are read, and the loader."""

    data_path: str | None
    """Meta JSON or annotation JSONL for training; None: the built-in digits dataset (made on first run)."""
    valid_data_path: str | None
    """Meta JSON or annotation JSONL for evaluation; None: the built-in dataset's held-out split (or none)."""
    data_cache_dir: str
    """Folder of the built-in dataset, the validation scans (scans/) and the skipped-record lists (skipped/)."""
    tokenizer_model: str | None
    """Hugging Face tokenizer folder as given (--tokenizer-model); None: --hf-checkpoint's when it has one, else
    the built-in byte-level one (resolved in ``RunPlan.tokenizer_model``)."""
    media: MediaOverrides
    """The image flags (tiles per image, pixel budget) and the video flags (--video-*) the family's rules read."""
    seq_length: int
    """Longest sample, tokens."""
    skip_bad_samples: bool
    """Leave out records that fail the scan (listed in DATA_CACHE_DIR/skipped/) instead of stopping."""
    max_skipped_fraction: float
    """With ``skip_bad_samples``: stop before training when more than this fraction (0..1) of a data file's records
    fail the scan."""
    truncate_long_samples: bool
    """Cut a sample longer than ``seq_length`` instead of stopping."""
    num_workers: int
    """Data-loader worker processes of each rank that decodes images (0: in the training process)."""
    prefetch_factor: int
    """Micro-batches each loader worker prepares ahead."""


@dataclass(frozen=True)
class BalanceConfig:
    """OmniBal's three levels and the manual choices they replace: data (random batches or ISF groups), model
    (a pipeline layout given, Megatron's default or searched) and memory (recompute given or planned)."""

    isf: bool
    """--omnibal-isf: ISF data balancing, one packed group per micro-batch (else random batches)."""
    isf_fixed_params: ISFParams | None
    """Fixed ISF thresholds (--omnibal-isf-qv/-qt[-min], -iters, -vit-time/-llm-time[-min]; lower bounds 90% of
    their caps by default); None: searched."""
    isf_buffer: int
    """Online ISF (an Energon --data-path): look-ahead samples per data-parallel rank the groups are chosen from
    (resolved: --omnibal-isf-buffer, else ``flags.DEFAULT_ISF_BUFFER``)."""
    isf_stats: str | None
    """Online ISF: per-sample stats file whose offline ISF search gives the caps and time targets; None: none."""
    isf_time_device: str
    """Cost-model device of the samples' predicted times (ISF in time, the logged Dist ratios in time)."""
    isf_token_multiple: int
    """ISF counts each sample's tokens rounded up to this multiple (resolved: --omnibal-isf-token-multiple, else
    what context parallelism pads a sample to, 2 x CP, x TP with --sequence-parallel; 1 without CP)."""
    pipeline_layout: str | None
    """Units per stage (--pipeline-layout syntax, e.g. ``Iv*3|vPEt*4L``); None: Megatron's default or searched."""
    partition: str
    """--omnibal-partition: "auto" searches a balanced layout from the profile, "none" does not."""
    profile: str | None
    """Profile JSON read (or written) for the searches (--omnibal-profile)."""
    recompute_granularity: str | None
    """The same recompute on every stage: "full" (every layer), "selective" or None (none)."""
    recompute_plan: str | None
    """Per-stage recompute (--recompute-plan syntax, e.g. ``v2s,t3|t0s``); None: --recompute-granularity's."""
    recompute: str
    """--omnibal-recompute: "auto" plans the least recompute per stage that fits the memory budget."""
    memory_budget_gib: float | None
    """--omnibal-memory-budget, GiB per device; None: the device's memory less 10% (CPU: RAM per local rank)."""

    @property
    def profiles(self) -> bool:
        """Whether the run needs the units' costs: a search, or a profile to write."""
        return self.partition == "auto" or self.recompute == "auto" or bool(self.profile)

    @property
    def profile_only(self) -> bool:
        """--omnibal-profile without a search: profile the units, write the file and exit."""
        return self.partition == "none" and self.recompute == "none"


@dataclass(frozen=True)
class OptimConfig:
    """Batches, iterations, the optimizer and its schedule, precision and the loss."""

    micro_batch_size: int
    """Samples per micro-batch (with ISF: the target samples per packed group)."""
    global_batch_size: int
    """Samples per iteration, all data-parallel ranks together (resolved: default 4 micro-batches per DP rank)."""
    num_microbatches: int
    """Micro-batches per iteration on each data-parallel rank: global batch / (micro-batch size x DP)."""
    train_iters: int
    """Iterations to train."""
    exit_interval: int | None
    """Stop (after saving) at this iteration; None or 0: run all ``train_iters``."""
    seed: int
    """Seed of the weights, the data order and dropout."""
    lr: float
    """Peak learning rate."""
    min_lr: float
    """Learning rate at the end of the decay."""
    vision_lr: float | None
    """Peak learning rate of the ViT (None: ``lr``); its minimum scaled by the same ratio."""
    projector_lr: float | None
    """Peak learning rate of the projector (None: ``lr``)."""
    lr_decay_style: str
    """"constant", "linear" or "cosine"."""
    lr_decay_iters: int | None
    """Iterations the LR decays over, from ``lr`` to ``min_lr``; None: ``train_iters``."""
    lr_warmup_iters: int
    """Iterations of linear warm-up from 0."""
    override_opt_param_scheduler: bool
    """On resume: this run's schedule flags replace the checkpoint's (--override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool
    """On resume: keep the checkpoint's schedule whatever the flags say (--use-checkpoint-opt_param-scheduler);
    with neither, a resume whose schedule flags differ from the checkpoint's is refused."""
    check_for_nan_in_loss_and_grad: bool
    """Stop the run when the loss or a gradient is NaN or Inf (checked on every rank before each optimizer step)."""
    weight_decay: float
    """AdamW's decoupled weight decay (not on biases and norms)."""
    clip_grad: float
    """Gradient-norm clip (L2 over all parameters)."""
    adam_beta1: float
    adam_beta2: float
    bf16: bool
    """bf16 parameters and activations with fp32 main weights (CUDA only); else fp32."""
    loss_reduction: str
    """Weight of a sample's answer tokens in a global batch's loss: "token", "sample" or "square"."""

    @property
    def params_dtype(self) -> torch.dtype:
        """The parameters' and activations' dtype: bf16 with --bf16, else fp32."""
        return torch.bfloat16 if self.bf16 else torch.float32


@dataclass(frozen=True)
class LogConfig:
    """What a run logs and measures."""

    log_interval: int
    """Log every N iterations (and the last)."""
    tensorboard_dir: str | None
    """TensorBoard folder; None: none."""
    json_log: str | None
    """Per-iteration metrics as JSON lines here; None: none."""
    eval_interval: int
    """Evaluate every N iterations (and at the end); 0: never."""
    eval_iters: int | None
    """Iterations (global batches) per evaluation; None: one pass over the validation set."""
    log_sample_ids: bool
    """Each iteration's sample ids, per data-parallel rank and micro-batch, in the JSON lines of ``json_log``."""
    log_activation_memory: bool
    """Measure saved-activation bytes per stage (resolved: --log-activation-memory, or --omnibal-recompute auto)."""
    log_expert_load: str | None
    """Each iteration's tokens per expert per MoE layer as JSON lines here; None: none."""
    eval_generate: bool
    """At each evaluation also generate the evaluated samples' answers (greedy) and log the accuracy by generation."""
    eval_generate_samples: int | None
    """With ``eval_generate``: the first N evaluated samples only; None: all."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None
    """Checkpoint folder written at ``save_interval`` and at the end; None: no checkpoint."""
    save_interval: int | None
    """Save every N iterations (and at the end); None or 0: only at the end."""
    keep_checkpoints: int | None
    """Keep the newest N checkpoints; None: all."""
    load: str | None
    """Resume from the newest complete checkpoint in this folder (none there: start from scratch)."""
    ckpt_step: int | None
    """With ``load``: that iteration's checkpoint; None: the newest."""
    force_save_lock: bool
    """Take over the ``save`` folder's lock even when another host holds it."""


@dataclass(frozen=True)
class RunConfig:
    """Every flag of a run, parsed and checked (``flags.parse_config``)."""

    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    balance: BalanceConfig
    optim: OptimConfig
    log: LogConfig
    checkpoint: CheckpointConfig
