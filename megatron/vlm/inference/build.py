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
from megatron.training.arguments import ArgumentError, parse_args, virtual_pipeline_size
from megatron.training.initialize import (choose_device, distributed_timeout, initialize_distributed, set_seeds,
                                          world_size_from_env)
from megatron.training.run_plan import plan_run
from megatron.training.tokenizer_setup import setup_tokenizer
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


def reader_config(args, spec, hf_folder: str | None) -> ReaderConfig:
    """The trainer's reader settings for the model (its family's image rule, its video rule where it declares video,
    with the image and ``--video-*`` flags of ``args``)."""
    data = runtime_family(spec).data
    videos = data.video_rule(args, spec, hf_folder) if family_of(spec).capabilities.video and data.video_rule else None
    return ReaderConfig(images=data.image_rule(args, spec, hf_folder), videos=videos)


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


def check_flags(args) -> None:
    """The trainer's flags generation refuses (module docstring), naming them."""
    if args.context_parallel_size > 1:
        raise ArgumentError(f"--context-parallel-size {args.context_parallel_size}: generation runs without context "
                            "parallelism (a decode step is one token per sequence)")
    if virtual_pipeline_size(args) > 1:
        raise ArgumentError("generation runs one stage per pipeline rank: drop --virtual-pipeline-model-parallel-size "
                            "(or give a --pipeline-layout of PP stages)")
    if args.transformer_impl == "transformer_engine":
        raise ArgumentError("--transformer-impl transformer_engine: generation keeps its KV cache in the packed-"
                            "sequence attention of megatron-core's torch layers (--transformer-impl local or auto)")
    if args.attention_backend == "unfused":
        raise ArgumentError("--attention-backend unfused: generation keeps its KV cache in the packed-sequence "
                            "attention (--attention-backend auto)")
    if args.omnibal_partition == "auto":
        raise ArgumentError("--omnibal-partition auto profiles a training run: give the layout (--pipeline-layout)")
    if not args.load and not args.hf_checkpoint:
        raise ArgumentError("generation needs weights: give --hf-checkpoint DIR or --load CKPT")


@dataclasses.dataclass(frozen=True)
class GenerationSetup:
    """What the flags give before the model is built: the checked ``args``, the run plan (model with its padded
    vocabulary, layout, MoE settings), the tokenizer and the reader's settings (requests can be read and checked
    now, before any weight is loaded), the device, the checkpoint to load (None: ``--hf-checkpoint``'s weights)."""

    args: object
    plan: object
    tokenizer: object
    reader: ReaderConfig
    device: torch.device
    resume: object = None


def prepare(argv: list[str], world_size: int | None = None) -> GenerationSetup:
    """Parse and check the trainer flags ``argv`` (module docstring), start the process groups (torchrun's world;
    inside ``cpu_compat.patched`` on CPU), make the plan, the tokenizer and the reader's settings."""
    world_size = world_size or world_size_from_env()
    args = parse_args(argv, world_size)
    check_flags(args)
    device = choose_device(args.device)
    initialize_distributed(device, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                           timeout=distributed_timeout(args))
    set_seeds(args.seed)
    plan = plan_run(args, world_size, device)
    resume = checkpointing.find_checkpoint(args.load, args.ckpt_step) if args.load else None
    if args.load and resume is None:
        raise UserError(f"--load {args.load}: no checkpoint there")
    tokenizer, plan = setup_tokenizer(args, plan)
    plan = dataclasses.replace(plan, layout=setup.choose_layout(args, plan))
    return GenerationSetup(args, plan, tokenizer, reader_config(args, plan.model_spec, args.hf_checkpoint), device,
                           resume)


def build_engine(setup: GenerationSetup) -> GenerationEngine:
    """This rank's stage of the setup's layout, its weights loaded, and its engine (module docstring)."""
    args, plan, device = setup.args, setup.plan, setup.device
    spec, tp, pp = plan.model_spec, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    sequence_parallel = args.sequence_parallel or (spec.language.moe is not None and tp > 1)
    impl = resolve_layer_impl("local", "auto", device, 1, torch_layers_only=True)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    stage = build_stage(StageBuild(spec, plan.layout.stage_range(parallel_state.get_pipeline_model_parallel_rank()),
                                   tp=tp, pp=pp, dtype=dtype, impl=impl, seed=args.seed,
                                   img_context_id=setup.tokenizer.img_context_id, on_cpu=device.type == "cpu",
                                   output="logits", initialize=False, sequence_parallel=sequence_parallel,
                                   lora=plan.lora, moe_run=plan.moe_run))
    stage.to(device=device, dtype=dtype)
    if setup.resume is not None:
        checkpointing.load_weights(setup.resume, plan, [stage])
        source = f"--load {args.load}"
    else:
        hf_source = HFSource.open(args.hf_checkpoint)
        hf_source.spec = spec  # the vocabulary may be padded further for TP
        load_hf_into_stage(stage, hf_source)
        source = f"--hf-checkpoint {args.hf_checkpoint}"
    if dist.get_rank() == 0:
        print(f"> generation: model {spec.name} from {source}, TP={tp} PP={pp} EP={args.expert_model_parallel_size}, "
              f"layout {plan.layout_flag}", flush=True)
    return engine_for_stage(stage, setup.tokenizer, setup.reader, tp if sequence_parallel else 1,
                            args.hf_checkpoint or plan.tokenizer_model)


def generator_from_args(argv: list[str], world_size: int | None = None) -> GenerationEngine:
    """This rank's ``Generator`` of the trainer flags ``argv`` (module docstring): ``build_engine(prepare(argv))``."""
    return build_engine(prepare(argv, world_size))
