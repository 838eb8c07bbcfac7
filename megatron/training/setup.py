"""From parsed arguments to what the loop needs: tokenizer, data, layout, recompute plan."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state

from omnibal_ext.data.sampler import GroupBatchSampler, random_groups
from omnibal_ext.model.layout import default_layout, parse_layout
from omnibal_ext.model.units import build_units

from megatron.vlm.batches import MicroBatches
from megatron.vlm.data.digits import build_digits_dataset, digits_meta_paths
from megatron.vlm.data.internvl import InternVLDataset
from megatron.vlm.data.tokenizer import build_tokenizer, padded_vocab_size
from megatron.vlm.model import StageRecomputeSettings

from .arguments import ArgumentError

DEFAULT_DATASET_SAMPLES = 3000


def setup_tokenizer(args):
    """Build the tokenizer and size the model's vocabulary from it."""
    tokenizer = build_tokenizer(args.tokenizer_model)
    # Pad to a multiple of 128 that TP divides, not to 128 x TP as Megatron does: the vocabulary
    # (and so the drawn weights) then stays the same across TP sizes 1, 2, 4, 8, and parallel runs
    # reproduce the serial run.
    vocab = padded_vocab_size(tokenizer.vocab_size, 1)
    if vocab % args.tensor_model_parallel_size:
        vocab = padded_vocab_size(tokenizer.vocab_size, args.tensor_model_parallel_size)
    spec = args.model_spec
    args.model_spec = spec.replace(language=dataclasses.replace(spec.language, vocab_size=vocab))
    return tokenizer


def data_paths(args) -> tuple[str, str | None]:
    """(train meta, validation meta or None); builds the default digits data on first use."""
    if args.data_path:
        if not os.path.exists(args.data_path):
            raise ArgumentError(f"--data-path {args.data_path}: no such file")
        return args.data_path, None
    folder = os.path.join(args.data_cache_dir, f"digits_{args.model_spec.vision.image_size}px")
    if dist.get_rank() == 0:
        build_digits_dataset(folder, num_samples=DEFAULT_DATASET_SAMPLES, seed=0,
                             tile_size=args.model_spec.vision.image_size)
    dist.barrier()
    return digits_meta_paths(folder)


def build_dataset(args, tokenizer, meta_path: str) -> InternVLDataset:
    spec = args.model_spec
    return InternVLDataset(meta_path, tokenizer, image_size=spec.vision.image_size,
                           tokens_per_tile=spec.tokens_per_tile, max_num_tiles=args.max_num_tiles,
                           max_seq_length=args.seq_length, seed=args.seed)


def build_groups(args, dataset) -> tuple[list[np.ndarray], object | None]:
    """Sample groups of the training set (one group = one micro-batch) and their step order."""
    if args.omnibal_isf:
        from .isf import isf_groups

        return isf_groups(args, dataset)
    return random_groups(len(dataset), args.micro_batch_size, seed=args.seed), None


def build_data(args, tokenizer):
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    train_meta, valid_meta = data_paths(args)
    train_set = build_dataset(args, tokenizer, train_meta)
    groups, order = build_groups(args, train_set)
    train = MicroBatches(train_set, GroupBatchSampler(groups, dp, dp_rank, seed=args.seed, order=order),
                         tokenizer.pad_id, packed=args.omnibal_isf)
    valid = None
    if valid_meta and args.eval_interval:
        valid_set = build_dataset(args, tokenizer, valid_meta)
        valid = MicroBatches(valid_set, GroupBatchSampler(random_groups(len(valid_set), args.micro_batch_size, seed=0),
                                                          dp, dp_rank, seed=0), tokenizer.pad_id, packed=False)
    return train, valid


def choose_layout(args):
    spec, pp = args.model_spec, args.pipeline_model_parallel_size
    if args.pipeline_layout:
        return parse_layout(args.pipeline_layout, spec, pp)
    return default_layout(spec, pp)


def recompute_settings(args, layout) -> list[StageRecomputeSettings]:
    """Per-stage recompute from --recompute-granularity (every stage alike) or --recompute-plan."""
    units = build_units(args.model_spec)
    counts = []
    for rng in layout.stage_slices():
        kinds = [units[i].kind for i in rng]
        counts.append((kinds.count("vit_layer"), kinds.count("llm_layer")))
    if args.recompute_plan:
        from omnibal_ext.memory.recompute import parse_recompute_plan

        plan = parse_recompute_plan(args.recompute_plan, layout.num_stages)
        out = []
        for s, (stage, (nv, nl)) in enumerate(zip(plan, counts)):
            if stage.vit_full_layers > nv or stage.llm_full_layers > nl:
                raise ArgumentError(
                    f"--recompute-plan: stage {s} asks {stage.vit_full_layers} ViT / {stage.llm_full_layers} LLM "
                    f"full layers but holds {nv} / {nl}")
            out.append(StageRecomputeSettings(stage.vit_full_layers, stage.vit_selective,
                                              stage.llm_full_layers, stage.llm_selective))
        return out
    if args.recompute_granularity == "full":
        return [StageRecomputeSettings(nv, False, nl, False) for nv, nl in counts]
    if args.recompute_granularity == "selective":
        return [StageRecomputeSettings(0, True, 0, True) for _ in counts]
    return [StageRecomputeSettings() for _ in counts]
