"""A ``Generator`` on this rank's stage, from the trainer's flags (``omnibal generate``, ``omnibal serve``) or from
a stage already built (``--eval-generate``: the training model).

``generator_from_args(argv)`` parses the trainer's flags with the trainer's checks (a layout the model cannot run is
refused before any work, naming the flag), starts the process groups at the flags' TP / PP / EP / ETP, builds this
rank's stage of the layout (``--pipeline-layout``, else Megatron's default) in eval mode with megatron-core's torch
layers and our packed-sequence attention (the one that keeps a KV cache), and loads its weights: ``--load`` (any
TP / PP / layout it was saved with, resharded as training resumes; its newest iteration or ``--ckpt-step``) or
``--hf-checkpoint`` (each rank reads its units' TP slices). MoE layers at TP > 1 run sequence parallel (megatron-core's
MoELayer needs it), so every step pads its tokens to a multiple of TP.

Refused, naming the flag: context parallelism, an interleaved pipeline, ``--transformer-impl transformer_engine`` and
``--attention-backend unfused`` (their attention keeps no cache), ``--omnibal-partition auto`` (a profile run; give
the layout), and a run without weights (neither ``--load`` nor ``--hf-checkpoint``).
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from omnibal_ext.errors import UserError
from omnibal_ext.model.units import family_of

from megatron.training import checkpointing, setup
from megatron.training.arguments import parse_config
from megatron.training.checkpointing import Checkpoint
from megatron.training.config import RunConfig
from megatron.training.flags import ArgumentError
from megatron.training.initialize import choose_device, initialize_distributed, set_seeds, world_size_from_env
from megatron.training.run_plan import RunPlan
from megatron.training.tokenizer_setup import setup_tokenizer, tokenizer_folder
from megatron.vlm.data.images import MediaOverrides
from megatron.vlm.data.records import ReaderConfig
from megatron.vlm.hf.convert import HFSource
from megatron.vlm.hf.load import load_hf_into_stage
from megatron.vlm.layers.attention import SegmentAttention
from megatron.vlm.layers.layer_impl import resolve_layer_impl
from megatron.vlm.stage.build import StageBuild, build_stage
from megatron.vlm.stage.components import runtime_family

from .engine import EngineConfig, GenerationEngine
from .stopping import default_stop_ids


def generation_config_eos(folder: str | None) -> tuple[int, ...]:
    """The ``eos_token_id`` (one or a list) of ``folder/generation_config.json``, where there is one."""
    if not folder:
        return ()
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))


def reader_config(media: MediaOverrides, spec, hf_folder: str | None) -> ReaderConfig:
    """The trainer's reader settings for the model (its family's image rule, its video rule where it declares video,
    with the image and ``--video-*`` flags ``media``)."""
    data = runtime_family(spec).data
    videos = data.video_rule(media, spec, hf_folder) if family_of(spec).capabilities.video and data.video_rule else None
    return ReaderConfig(images=data.image_rule(media, spec, hf_folder), videos=videos)


def engine_for_stage(stage, tokenizer, config: ReaderConfig, pad_to_multiple: int, hf_folder: str | None = None,
                     groups: int | None = None) -> GenerationEngine:
    """The engine of ``stage`` (this rank's ``VLMStage``, weights loaded; put in eval mode here) reading requests with
    ``tokenizer`` and ``config``; ``pad_to_multiple``: TP under sequence parallelism, else 1."""
    spec = stage.spec
    batcher = runtime_family(spec).data.batcher(spec, tokenizer.img_context_id, config.images)
    ends = default_stop_ids(tokenizer, generation_config_eos(hf_folder))
    engine_config = EngineConfig(pad_to_multiple=pad_to_multiple, pad_id=tokenizer.pad_id,
                                 real_vocab=spec.language.vocab_real, end_ids=ends, groups=groups)
    check_stage(stage)
    return GenerationEngine(stage, tokenizer, config, batcher, engine_config)


def check_stage(stage) -> None:
    """The stage's LLM attention must be ``SegmentAttention`` (the one with the decode cache)."""
    blocks = getattr(stage, "llm_blocks", None)
    if blocks is None:
        return
    for module in blocks.modules():
        core = getattr(module, "core_attention", None)
        if core is not None and not isinstance(core, SegmentAttention):
            raise UserError(f"generation keeps its KV cache in the packed-sequence attention (--transformer-impl "
                            f"local, --attention-backend auto); this model's LLM attention is {type(core).__name__}")


def check_config(config: RunConfig) -> None:
    """The trainer's flags generation refuses (module docstring), naming them."""
    parallel, model = config.parallel, config.model
    if parallel.context_parallel_size > 1:
        raise ArgumentError(f"--context-parallel-size {parallel.context_parallel_size}: generation runs without "
                            "context parallelism (a decode step is one token per sequence)")
    if parallel.virtual_pipeline_size > 1:
        raise ArgumentError("generation runs one stage per pipeline rank: drop --virtual-pipeline-model-parallel-size "
                            "(or give a --pipeline-layout of PP stages)")
    if model.transformer_impl == "transformer_engine":
        raise ArgumentError("--transformer-impl transformer_engine: generation keeps its KV cache in the packed-"
                            "sequence attention of megatron-core's torch layers (--transformer-impl local or auto)")
    if model.attention_backend == "unfused":
        raise ArgumentError("--attention-backend unfused: generation keeps its KV cache in the packed-sequence "
                            "attention (--attention-backend auto)")
    if config.balance.partition == "auto":
        raise ArgumentError("--omnibal-partition auto profiles a training run: give the layout (--pipeline-layout)")
    if not config.checkpoint.load and not model.hf_checkpoint:
        raise ArgumentError("generation needs weights: give --hf-checkpoint DIR or --load CKPT")


@dataclasses.dataclass(frozen=True)
class GenerationSetup:
    """What the flags give before the model is built: the run plan (the checked flags typed, the model with its
    padded vocabulary, the layout), the tokenizer and the reader's settings (requests can be read and checked now,
    before any weight is loaded), the device, the checkpoint to load (None: ``--hf-checkpoint``'s weights)."""

    plan: RunPlan
    tokenizer: object
    reader: ReaderConfig
    device: torch.device
    resume: Checkpoint | None = None


def prepare(argv: list[str], world_size: int | None = None) -> GenerationSetup:
    """Parse and check the trainer flags ``argv`` (module docstring), start the process groups (torchrun's world;
    inside ``cpu_compat.patched`` on CPU), make the plan, the tokenizer and the reader's settings."""
    world_size = world_size or world_size_from_env()
    config = parse_config(argv, world_size)
    check_config(config)
    parallel, ckpt = config.parallel, config.checkpoint
    device = choose_device(parallel.device)
    initialize_distributed(device, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                           ep=parallel.expert_model_parallel_size, etp=parallel.expert_tensor_parallel_size,
                           timeout=parallel.timeout)
    set_seeds(config.optim.seed)
    resume = checkpointing.find_checkpoint(ckpt.load, ckpt.ckpt_step) if ckpt.load else None
    if ckpt.load and resume is None:
        raise UserError(f"--load {ckpt.load}: no checkpoint there")
    tokenizer, spec = setup_tokenizer(config)
    plan = setup.build_run_plan(config, spec, device, tokenizer_model=tokenizer_folder(config))
    return GenerationSetup(plan, tokenizer, reader_config(config.data.media, spec, config.model.hf_checkpoint), device,
                           resume)


def build_engine(setup: GenerationSetup) -> GenerationEngine:
    """This rank's stage of the setup's layout, its weights loaded, and its engine (module docstring)."""
    plan, device = setup.plan, setup.device
    config = plan.config
    parallel, model = config.parallel, config.model
    spec, tp, pp = plan.model_spec, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    sequence_parallel = parallel.sequence_parallel or (spec.language.moe is not None and tp > 1)
    impl = resolve_layer_impl("local", "auto", device, 1, torch_layers_only=True)
    dtype = config.optim.params_dtype
    stage = build_stage(StageBuild(spec, plan.layout.stage_range(parallel_state.get_pipeline_model_parallel_rank()),
                                   tp=tp, pp=pp, dtype=dtype, impl=impl, seed=config.optim.seed,
                                   img_context_id=setup.tokenizer.img_context_id, on_cpu=device.type == "cpu",
                                   output="logits", initialize=False, sequence_parallel=sequence_parallel,
                                   lora=model.lora, moe_run=model.moe_run))
    stage.to(device=device, dtype=dtype)
    if setup.resume is not None:
        checkpointing.load_weights(setup.resume, plan, [stage])
        source = f"--load {config.checkpoint.load}"
    else:
        hf_source = HFSource.open(model.hf_checkpoint)
        hf_source.spec = spec  # the vocabulary may be padded further for TP
        load_hf_into_stage(stage, hf_source)
        source = f"--hf-checkpoint {model.hf_checkpoint}"
    if dist.get_rank() == 0:
        print(f"> generation: model {spec.name} from {source}, TP={tp} PP={pp} "
              f"EP={parallel.expert_model_parallel_size}, layout {plan.layout_flag}", flush=True)
    return engine_for_stage(stage, setup.tokenizer, setup.reader, tp if sequence_parallel else 1,
                            model.hf_checkpoint or plan.tokenizer_model)


def generator_from_args(argv: list[str], world_size: int | None = None) -> GenerationEngine:
    """This rank's ``Generator`` of the trainer flags ``argv`` (module docstring): ``build_engine(prepare(argv))``."""
    return build_engine(prepare(argv, world_size))
