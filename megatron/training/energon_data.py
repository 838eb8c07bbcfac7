"""``--data-path`` an Energon dataset (a folder with ``.nv-meta/`` or a ``MetadatasetV2`` YAML): what the trainer
builds instead of the JSONL path's scanned dataset, sampler and loader (``megatron/vlm/data/energon/``).

Nothing is scanned before the first step: the folders' ``.nv-meta/`` are checked (a problem is named before
training), then each pipeline stage of each data-parallel rank reads its rank's stream through Energon's savable
loader (``--num-workers`` worker processes tokenizing and reading headers; pixels decoded after the samples are
chosen, in threads, by the stages that read them).  Without ``--omnibal-isf`` a micro-batch is the stream's next
``--micro-batch-size`` samples, padded; with it, one online ISF group (``omnibal_ext.data.online_isf``) over a
look-ahead buffer of ``--omnibal-isf-buffer`` samples per rank, balanced in predicted time across the
data-parallel ranks, packed.  The training set is the ``train`` split, the validation set the ``val`` split of
``--valid-data-path``.
"""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.energon import traverse_metadataset
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

from omnibal_ext.data.isf import ISFParams
from omnibal_ext.data.online_isf import OnlineISF, OnlineISFConfig
from omnibal_ext.data.search import run_isf
from omnibal_ext.data.search_time import run_isf_in_time
from omnibal_ext.data.stats import load_stats
from omnibal_ext.model.cost_model import get_device
from omnibal_ext.model.sample_time import TIME_UNIT_S, isf_sample_times, time_coefficients
from omnibal_ext.model.units import ModelSpec, family_of

from megatron.vlm.data.energon.balancing import all_gather_exchange
from megatron.vlm.data.energon.costs import CostModel
from megatron.vlm.data.energon.dataset import EnergonSource, dataset_loader
from megatron.vlm.data.energon.encoder import ChatTaskEncoder, EncoderSettings
from megatron.vlm.data.energon.layout import EnergonDataError, check_prepared, folder_layout, is_energon_path
from megatron.vlm.data.energon.stream import LoaderSettings, SampleStream, SkipPolicy
from megatron.vlm.data.record_sample import ReaderConfig
from megatron.vlm.stage.batches import Collate, StageInputs
from megatron.vlm.stage.components import runtime_family
from megatron.vlm.stage.energon_batches import EnergonBatches, FixedGroups, OnlineGroups

from .config import DataConfig, RunConfig
from .flags import ArgumentError
from .isf import search_config

TRAIN_SPLIT, VALID_SPLIT = "train", "val"


def profiling_refused(source: EnergonSource) -> ArgumentError:
    """Why the units cannot be profiled on ``source``'s samples here (no scan gives the micro-batch shapes)."""
    return ArgumentError(f"--data-path {source.path}: an Energon dataset is not scanned before training, so the "
                         "units cannot be profiled at its micro-batch shapes here: pass an existing --omnibal-profile "
                         "FILE with --omnibal-partition/--omnibal-recompute auto (`omnibal profile` on a JSONL sample "
                         "of the data, or with --tiles/--llm-tokens)")


def is_energon(path: str | None) -> bool:
    return bool(path) and is_energon_path(path)


def leaf_folders(path: str, split: str) -> list[str]:
    """The dataset folders ``path`` reads for ``split`` (itself, or a metadataset's leaves)."""
    if not path.endswith((".yaml", ".yml")):
        return [path]
    try:
        return [str(ref.path) for ref in traverse_metadataset(path, split_part=split)]
    except KeyError:
        raise EnergonDataError(f"{path}: has no split {split!r}") from None
    except Exception as e:  # noqa: BLE001 - a YAML Energon refuses: this file's problem
        raise EnergonDataError(f"{path}: not a metadataset Energon reads ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:300]})") from None


def check_source(path: str, split: str) -> None:
    """Refuse, before training, an Energon dataset whose ``.nv-meta`` is missing or unreadable (naming the file)."""
    dataset_loader(path)  # the metadataset YAML: loads, MetadatasetV2, no join
    for folder in leaf_folders(path, split):
        folder_layout(folder)
        check_prepared(folder, split)


def reader_config(config: RunConfig, spec: ModelSpec) -> ReaderConfig:
    """The reader's settings of this run of ``spec``: the family's image and video rules, the text settings (as the
    JSONL path's ``setup.build_dataset``)."""
    data, hf = config.data, config.model.hf_checkpoint
    side = runtime_family(spec).data
    videos = side.video_rule(data.media, spec, hf) if family_of(spec).capabilities.video else None
    return ReaderConfig(images=side.image_rule(data.media, spec, hf), max_seq_length=data.seq_length,
                        truncate=data.truncate_long_samples, seed=config.optim.seed, skip_bad=data.skip_bad_samples,
                        videos=videos)


def check_energon_flags(flags) -> None:
    """With an Energon --data-path (the parsed ``flags``), the flags its path does not implement are refused by name
    (never ignored); without one, online ISF's flags are (``validation.validate_flags``)."""
    if not is_energon(flags.data_path):
        for flag, value in (("--omnibal-isf-buffer", flags.omnibal_isf_buffer),
                            ("--omnibal-isf-stats", flags.omnibal_isf_stats)):
            if value is not None:
                raise ArgumentError(f"{flag} is online ISF's, with an Energon --data-path; ISF over a meta JSON/JSONL "
                                    "groups the whole dataset offline from its own scan: drop it")
        return
    if flags.omnibal_isf_iters is not None or flags.omnibal_isf_qv_min is not None or \
            flags.omnibal_isf_qt_min is not None or flags.omnibal_isf_vit_time_min is not None or \
            flags.omnibal_isf_llm_time_min is not None:
        raise ArgumentError("--omnibal-isf-iters and the lower bounds --omnibal-isf-*-min are offline ISF's (passes "
                            "over the whole dataset); online ISF with an Energon --data-path takes the caps "
                            "--omnibal-isf-qv/-qt and the time targets --omnibal-isf-vit-time/-llm-time")
    if flags.valid_data_path and not is_energon(flags.valid_data_path):
        raise ArgumentError(f"--valid-data-path {flags.valid_data_path}: with an Energon --data-path give an Energon "
                            f"dataset (its {VALID_SPLIT!r} split) too")
    if flags.omnibal_isf_stats and (flags.omnibal_isf_qv is not None or flags.omnibal_isf_vit_time is not None):
        raise ArgumentError("--omnibal-isf-stats gives the caps and time targets: drop --omnibal-isf-qv/-qt and "
                            "--omnibal-isf-vit-time/-llm-time, or the stats file")


def energon_sources(config: RunConfig, spec: ModelSpec) -> tuple[EnergonSource, EnergonSource | None]:
    """(train, valid or None) Energon sources of the run of ``spec``, checked before training."""
    data = config.data
    reader = reader_config(config, spec)
    check_source(data.data_path, TRAIN_SPLIT)
    valid = None
    if data.valid_data_path and config.log.eval_interval:
        check_source(data.valid_data_path, VALID_SPLIT)
        valid = EnergonSource(data.valid_data_path, VALID_SPLIT, reader)
    return EnergonSource(data.data_path, TRAIN_SPLIT, reader), valid


def skipped_report(data: DataConfig, path: str) -> str:
    """Where --skip-bad-samples lists the samples it left out of ``path``."""
    name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    return os.path.join(data.data_cache_dir, "skipped", f"{name}.txt")


def cost_model(config: RunConfig, spec: ModelSpec) -> CostModel:
    """Each sample's cost as online ISF and the log's DistRatio in time count it."""
    coefficients = time_coefficients(spec, get_device(config.balance.isf_time_device),
                                     config.parallel.tensor_model_parallel_size)
    return CostModel(spec, coefficients, config.balance.isf_token_multiple)


def stats_params(config: RunConfig, spec: ModelSpec) -> ISFParams:
    """The caps (and, grouped in time, the time thresholds) offline ISF finds on ``--omnibal-isf-stats`` for this run
    (its search, as over a scanned JSONL: ``isf.search_isf``'s); rank 0 searches and broadcasts."""
    box = [None]
    if dist.get_rank() == 0:
        stats = load_stats([config.balance.isf_stats])
        cfg = search_config(config)
        tokens = cfg.counted_tokens(stats.tokens)
        timed = isf_sample_times(dataclasses.replace(stats, tokens=tokens), spec,
                                 get_device(config.balance.isf_time_device),
                                 tp=config.parallel.tensor_model_parallel_size)
        found = run_isf(stats.vit, tokens, cfg) if timed is None else run_isf_in_time(timed[0], tokens, timed[1], cfg)
        box = [found.params.to_dict()]
    dist.broadcast_object_list(box, src=0)
    return ISFParams(**box[0])


def online_config(config: RunConfig, spec: ModelSpec):
    """The online ISF's settings: the hard count caps ``--omnibal-isf-qv/-qt`` (else set from what the ranks have
    seen), the nominal group time ``--omnibal-isf-vit-time/-llm-time`` (ns; else ``--micro-batch-size`` mean
    samples), or both from ``--omnibal-isf-stats``."""
    balance, optim = config.balance, config.optim
    common = dict(ranks=config.parallel.data_parallel_size, groups_per_step=optim.num_microbatches,
                  buffer_size=balance.isf_buffer, samples_per_group=float(optim.micro_batch_size),
                  cp=config.parallel.context_parallel_size)
    if balance.isf_stats:  # with neither caps nor time targets (validation.validate_flags)
        return OnlineISFConfig.from_isf_params(stats_params(config, spec), TIME_UNIT_S, **common)
    ns = 1e-9
    caps = balance.isf_fixed_params  # None: no cap given
    vit_time = None if caps is None else caps.vit_time
    llm_time = None if caps is None else caps.llm_time
    return OnlineISFConfig(
        max_vit_items=None if caps is None else caps.qv, max_tokens=None if caps is None else caps.qt,
        vit_time_s=None if vit_time is None else vit_time * ns,
        llm_time_s=None if llm_time is None else llm_time * ns, **common)


def online_grouping(config: RunConfig, spec: ModelSpec) -> OnlineGroups:
    """Online ISF over this rank's buffer (``online_config``), exchanging over the data-parallel group (gloo)."""
    isf = online_config(config, spec)
    buffer = isf.buffer_size

    hint = (f" (the caps: ViT items {isf.max_vit_items}, tokens {isf.max_tokens}; raise --omnibal-isf-qv/-qt, or "
            f"leave the sample out)")
    return OnlineGroups(OnlineISF(isf), all_gather_exchange(parallel_state.get_data_parallel_group_gloo()),
                        buffer, config.optim.num_microbatches, samples_per_group=config.optim.micro_batch_size,
                        oversize_hint=hint)


def build_energon_data(config: RunConfig, spec: ModelSpec, tokenizer, sources, inputs: StageInputs,
                       device_type: str):
    """(train, valid or None) ``EnergonBatches`` of this rank's stage and data-parallel rank (see the module
    docstring); the same role as ``setup.build_data``'s ``MicroBatches``."""
    data, optim = config.data, config.optim
    train_source, valid_source = sources
    ps = parallel_state
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    tp = config.parallel.tensor_model_parallel_size
    loads = tp == 1 or not inputs.pixels or ps.get_tensor_model_parallel_rank() == 0
    main_copy = ps.get_pipeline_model_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0 and cp_rank == 0
    reader = train_source.config
    data_side = runtime_family(spec).data
    per_item = reader.images.tokens_per_item
    image_tokens = None if per_item is None else (tokenizer.img_context_id, per_item)
    batcher = data_side.batcher(spec, tokenizer.img_context_id, reader.images)
    costs = cost_model(config, spec)
    settings = EncoderSettings(reader, tokenizer, costs, keep_media=inputs.pixels, verify=data.skip_bad_samples)
    tp_kw = {}
    if inputs.pixels and tp > 1:
        tp_kw = dict(tp_group=ps.get_tensor_model_parallel_group(), tp_src=ps.get_tensor_model_parallel_src_rank())

    def collate(packed: bool) -> Collate:
        return Collate(tokenizer.pad_id, packed, inputs, image_tokens, config.parallel.sequence_parallel_tp, cp,
                       cp_rank, batcher)

    def make_stream(source: EnergonSource, training: bool):
        loader = LoaderSettings(source.path, source.split, training, dp_rank, dp,
                                data.num_workers, optim.seed, data.prefetch_factor)
        policy = SkipPolicy(data.skip_bad_samples, skipped_report(data, source.path) if main_copy else None,
                            announce=main_copy)
        return lambda: SampleStream(loader, ChatTaskEncoder(settings), policy)

    new_train = make_stream(train_source, True)
    stream = new_train() if loads else None
    if config.balance.isf:
        grouping = online_grouping(config, spec)
    else:
        grouping = FixedGroups(optim.micro_batch_size, optim.num_microbatches)
    common = dict(microbatches=optim.num_microbatches, decode_threads=max(1, data.num_workers), dp_rank=dp_rank,
                  dp_size=dp, main_copy=main_copy, **tp_kw)
    train = EnergonBatches(stream, grouping, reader, collate(grouping.packed), **common)
    valid = None
    if valid_source is not None:
        new_valid = make_stream(valid_source, False)
        valid = EnergonBatches(new_valid() if loads else None, FixedGroups(optim.micro_batch_size,
                                                                           optim.num_microbatches),
                               reader, collate(False), make_stream=new_valid,
                               samples_per_pass=_samples_per_rank(valid_source, dp), **common)
    if dist.get_rank() == 0:
        how = (f"online ISF (buffer {config.balance.isf_buffer} samples per rank)" if config.balance.isf
               else f"{optim.micro_batch_size} samples per micro-batch in stream order")
        print(f"> data: Energon {train_source.path} (split {train_source.split!r}), one savable loader per "
              f"data-parallel rank ({dp}) with {data.num_workers} worker(s); {how}", flush=True)
    return train, valid


def _samples_per_rank(source: EnergonSource, dp: int) -> int:
    """Samples of ``source`` one data-parallel rank reads in a pass (the shards' counts over the ranks)."""
    total = sum(s.count for folder in leaf_folders(source.path, source.split)
                for s in WebdatasetMeta.from_config(EPath(folder), split_part=source.split).shards)
    return total // dp
