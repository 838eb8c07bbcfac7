"""Profile every unit of the model on this device: the costs the balancing planners read.

Units of one kind (all ViT layers of a kind, all LLM layers of a kind) cost the same, so one of each is built: a
stage module over the unit list of a copy of the model with the fewest leading ViT and LLM layers that hold every
layer kind (one for a ViT or a decoder of one layer kind; dense and MoE decoder layers, ``llm_layer`` and
``llm_moe_layer``: up to the first of the later kind; the MoE layers under the run's expert grid, recorded as the
meta's "ep" / "etp").  An MoE model's routing is measured apart, on the training data (``routing_profile``).  The
micro-batch is the family's (its data side's ``profile_batch``; without one, fixed-size tiles: ``synthetic_batch``).
Each unit runs on the output of the one before it, at a given micro-batch shape, through
omnibal_ext.model.profile.measure_unit (median forward/backward seconds, saved-tensor bytes).  The
layers are measured three times — without recompute, with full and with selective recompute — for
the activation bytes each keeps and the backward time selective recompute adds.

All ranks measure together (tensor-parallel units need their group); rank 0's table is broadcast,
so every rank plans from the same numbers.
"""
from __future__ import annotations

import dataclasses
import platform

import numpy as np
import torch
import torch.distributed as dist

from omnibal_ext.errors import UserError
from omnibal_ext.model.cost_model import MicroBatchShape
from omnibal_ext.model.costs import CostTable, UnitCost
from omnibal_ext.model.families import family_of
from omnibal_ext.model.profile import environment_meta, measure_unit, to_unit_cost
from omnibal_ext.model.spec import LAYER_ROLES, TEXT_LAYER, VISION_LAYER
from omnibal_ext.model.units import build_units, unit_components

from megatron.vlm.data.collate import packing
from megatron.vlm.stage.components import runtime_family
from megatron.vlm.layers.layer_impl import resolve_layer_impl
from megatron.vlm.layers.moe import MoERun
from megatron.vlm.stage.micro_batch import MicroBatch
from megatron.vlm.stage.side import StageCache
from megatron.vlm.stage.build import StageBuild, VLMStage, build_stage
from omnibal_ext.memory.recompute import StageRecompute

from megatron.core.transformer.moe import moe_utils

from omnibal_ext.model.side_bytes import with_side_bytes

from .arguments import parse_config
from .config import RunConfig
from .initialize import choose_device, initialize_distributed, set_seeds
from .moe_log import TRACKED
from .tokenizer_setup import setup_tokenizer


def _layers_of_every_kind(spec, code: str) -> int:
    layers = [u for u in build_units(spec) if u.code == code]
    firsts = {}
    for k, u in enumerate(layers):
        firsts.setdefault(u.kind, k)
    return max(firsts.values(), default=0) + 1


def vision_layers_of_every_kind(spec) -> int:
    """The fewest leading ViT layers that hold a layer of every ViT layer kind of ``spec`` (1 for a ViT of one
    layer kind; windowed and full-attention layers: up to the first full one), what the profiled copy keeps."""
    return _layers_of_every_kind(spec, VISION_LAYER)


def llm_layers_of_every_kind(spec) -> int:
    """The fewest leading LLM layers that hold a layer of every LLM layer kind of ``spec`` (1 for a decoder of one
    kind; MoE and dense layers: up to the first of the later kind), what the profiled copy keeps."""
    return _layers_of_every_kind(spec, TEXT_LAYER)


def synthetic_batch(spec, shape: MicroBatchShape, img_context_id: int, device,
                    pad_to_multiple: int = 1) -> MicroBatch:
    """One packed row of ``shape.llm_tokens`` tokens holding ``shape.vision_items`` tiles' image tokens.

    The row is cut into samples of equal length ``L = attn_tokens_sq / llm_tokens`` (the last one
    shorter), so that the sum of squared sample lengths the attention pays is ``shape``'s; then padded
    (a padding segment, labels ignored) to a multiple of ``pad_to_multiple`` (sequence parallelism: TP),
    as the collate pads; on ``device`` (``MicroBatch.to``: the packing boundaries stay on the host).
    """
    n_img = shape.vision_items * spec.tokens_per_tile
    if shape.llm_tokens < n_img + 2:
        raise UserError(f"profile shape: {shape.llm_tokens} LLM tokens cannot hold {shape.vision_items} tiles "
                        f"x {spec.tokens_per_tile} image tokens (--llm-tokens, --tiles)")
    g = torch.Generator().manual_seed(0)
    s = shape.llm_tokens
    sample_len = max(1, round(shape.attn_tokens_sq / s))
    tokens = torch.randint(0, 256, (1, s), generator=g)
    tokens[0, 1:1 + n_img] = img_context_id
    v = spec.vision
    lengths = [sample_len] * (s // sample_len) + ([s % sample_len] if s % sample_len else [])
    width = -(-s // pad_to_multiple) * pad_to_multiple
    cu_seqlens, max_seqlen = packing([lengths], width)
    pad = width - s
    if pad:
        tokens = torch.cat([tokens, torch.zeros(1, pad, dtype=tokens.dtype)], 1)
    labels = torch.cat([torch.randint(0, 256, (1, s), generator=g), torch.full((1, pad), -100)], 1)
    return MicroBatch.of({
        "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
        "image_tile_index": torch.arange(shape.vision_items),
        "tokens": tokens, "labels": labels,
        "position_ids": torch.cat([torch.arange(s) % sample_len, torch.zeros(pad, dtype=torch.long)])[None],
        "segment_ids": torch.cat([torch.arange(s) // sample_len, torch.full((pad,), -1)])[None],
        "pixel_values": torch.randn(shape.vision_items, v.in_channels, v.image_size, v.image_size, generator=g),
        "image_flags": torch.ones(shape.vision_items, dtype=torch.long),
    }).to(device)


def _param_count(module: torch.nn.Module, tp: int) -> int:
    """Parameters of the whole (unsplit) unit: tensor-parallel shards count tp times."""
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in module.parameters())


def _detached(x):
    return x.detach().requires_grad_(x.is_floating_point())


def profile_units(config: RunConfig, spec, shape: MicroBatchShape, img_context_id: int, device: torch.device,
                  warmup: int = 2, repeats: int = 5) -> CostTable:
    """Measured costs of every unit of the model ``spec`` at ``shape`` (one micro-batch, this TP)."""
    parallel = config.parallel
    tp = parallel.tensor_model_parallel_size
    mini = family_of(spec).few_layers(spec, vision_layers_of_every_kind(spec), llm_layers_of_every_kind(spec))
    dtype = torch.bfloat16 if config.optim.bf16 else torch.float32
    on_cpu = device.type == "cpu"
    mini_units = build_units(mini)
    sp = parallel.sequence_parallel and tp > 1
    impl = resolve_layer_impl(config.model.transformer_impl, config.model.attention_backend, device,
                              torch_layers_only=sp)
    moe_run = None
    if mini.language.moe is not None:  # the run's (the flags' defaults for a spec given apart from its flags)
        moe_run = config.model.moe_run or MoERun(ep=parallel.expert_model_parallel_size,
                                                 etp=parallel.expert_tensor_parallel_size)

    def stage(recompute):
        m = build_stage(StageBuild(mini, range(len(mini_units)), tp=tp, dtype=dtype, impl=impl, seed=config.optim.seed,
                                   recompute=recompute, img_context_id=img_context_id, on_cpu=on_cpu,
                                   sequence_parallel=sp, moe_run=moe_run))
        return m.to(device=device, dtype=dtype).train()

    plain = stage(StageRecompute())
    full = stage(StageRecompute(mini.vision.num_layers, False, mini.language.num_layers, False))  # every layer
    selective = stage(StageRecompute(0, True, 0, True))
    family_batch = runtime_family(mini).data.profile_batch or synthetic_batch
    batch = family_batch(mini, shape, img_context_id, device, pad_to_multiple=tp if sp else 1)
    batch = batch.with_vision(pixel_values=batch.vision.pixel_values.to(dtype))
    cache = StageCache()  # per micro-batch inputs (the LLM layers' context), built once, outside the timings
    for part in plain.parts:
        part.component.prepare(plain.module_of(part), batch, cache)

    def parts_of(m: VLMStage) -> dict:
        """unit index -> (runtime component, module of its part)"""
        return {u.index: (p.component, m.module_of(p)) for p in m.parts for u in p.units}

    plain_parts, full_parts, selective_parts = parts_of(plain), parts_of(full), parts_of(selective)

    def run(parts: dict, unit, x):
        component, module = parts[unit.index]
        return component.profile_forward(module, x, batch, cache)

    def module_of(parts: dict, unit) -> torch.nn.Module:
        component, module = parts[unit.index]
        return component.profile_module(module)

    costs = unit_components(mini)
    if mini.language.moe is not None:
        _track_aux_losses(mini.language.num_layers, device)
    per_kind: dict[str, UnitCost] = {}
    x = None
    for unit in mini_units:
        inp = None if x is None else x.detach()

        def make_inputs(inp=inp):
            return () if inp is None else (_detached(inp),)

        def measure(parts, unit=unit):
            mod = module_of(parts, unit)
            return measure_unit(lambda *a: run(parts, unit, a[0] if a else None), make_inputs, warmup, repeats,
                                exclude=list(mod.parameters()))

        base = measure(plain_parts)
        extra = {}
        if unit.code in LAYER_ROLES:
            m_full, m_sel = measure(full_parts), measure(selective_parts)
            # Selective recompute re-runs the core attention in backward.  The measured difference
            # of two noisy medians can come out at or below zero on a CPU; it is never less than
            # the core attention's share of the layer's forward FLOPs.
            floor = _core_attention_share(costs[unit.index], shape, tp) * base.fwd_s
            extra = {"act_bytes_full": m_full.act_bytes, "act_bytes_selective": m_sel.act_bytes,
                     "selective_recompute_s": max(floor, m_sel.bwd_s - base.bwd_s)}
        per_kind[unit.kind] = to_unit_cost(unit.name, unit.kind, base, _param_count(module_of(plain_parts, unit), tp),
                                           **extra)
        with torch.no_grad():
            x = run(plain_parts, unit, inp)
    if mini.language.moe is not None:
        _forget_aux_losses()
    units = [dataclasses.replace(per_kind[u.kind], name=u.name) for u in build_units(spec)]
    meta = {**environment_meta(), "device": _device_name(device), "dtype": str(dtype).replace("torch.", ""),
            "shape": shape.to_dict(), "spec": spec.to_dict(), "tp": tp, "sequence_parallel": sp,
            "warmup": warmup, "repeats": repeats,
            # SegmentAttention keeps no scores, as FlashAttention; "unfused" keeps megatron-core's
            "attention": "unfused" if impl.dense_mask else "flash"}
    if spec.language.moe is not None:  # the expert grid the MoE units ran under (cost_model.profile_expert_run)
        meta.update(ep=parallel.expert_model_parallel_size, etp=parallel.expert_tensor_parallel_size)
    # the side tensors' bytes at each boundary (DeepStack features: the few-layer model runs none) from the spec
    table = with_side_bytes(CostTable(tuple(units), source="profile", meta=meta), spec, shape)
    return broadcast_table(table)


def _track_aux_losses(num_layers: int, device) -> None:
    """megatron-core's aux-loss tracker made for the copy's ``num_layers`` decoder layers (it would size its
    tensors by the first router's block, which may hold fewer layers than the router's layer number), as the
    trainer's ``MoELog`` makes it."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in TRACKED:
        tracker.setdefault(name, {"values": torch.zeros(num_layers, device=device), "reduce_group": None,
                                  "avg_group": None, "reduce_group_has_dp": False})


def _forget_aux_losses() -> None:
    """megatron-core's process-wide aux-loss state left by the copy's routers: their logged losses (by the copy's
    layers, none training's) and the aux-loss gradient scale (a scalar where training's schedule sets a [1] tensor),
    so training starts from none."""
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _core_attention_share(component, shape: MicroBatchShape, tp: int) -> float:
    """Fraction of a layer's forward FLOPs spent in core attention (scores and context), as the cost
    model counts them (the unit's cost component at ``shape``)."""
    total, core = component.flops(shape, tp)
    return core / total if total else 0.0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def broadcast_table(table: CostTable) -> CostTable:
    """Rank 0's table on every rank, so that every rank makes the same plan."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return table
    box = [table.to_dict()]
    dist.broadcast_object_list(box, src=0)
    return CostTable.from_dict(box[0])


def profile_shapes(config: RunConfig, groups, dataset) -> tuple[MicroBatchShape, MicroBatchShape]:
    """(timing shape, memory shape) of the micro-batches training will run (``groups``: ``setup.build_groups``'
    ``SampleGroups`` of the training set ``dataset``).

    ISF: the mean group (what a micro-batch costs on average) and the caps Qv/Qt (the most any
    micro-batch holds, which memory must fit).  Random batching: K samples padded to the longest,
    on average and at the 99th percentile of micro-batches.
    """
    dtype_bytes = 2 if config.optim.bf16 else 4
    if config.balance.isf:
        mean, caps = groups.mean_group, groups.isf_params
        tokens = max(2, round(mean.tokens))
        return (MicroBatchShape(max(1, round(mean.tiles)), tokens, dtype_bytes,
                                llm_attn_tokens_sq=min(float(tokens) ** 2, mean.attn_tokens_sq)),
                MicroBatchShape(int(caps.qv), int(caps.qt), dtype_bytes))
    tokens, tiles = dataset.sample_lengths()
    k = config.optim.micro_batch_size
    n = len(tokens) // k * k
    longest = tokens[:n].reshape(-1, k).max(axis=1).astype(float)
    padded = longest * k
    mb_tiles = tiles[:n].reshape(-1, k).sum(axis=1)
    timing_tokens = round(padded.mean())
    return (MicroBatchShape(max(1, round(mb_tiles.mean())), timing_tokens, dtype_bytes,
                            llm_attn_tokens_sq=min(float(timing_tokens) ** 2, float((k * longest**2).mean()))),
            MicroBatchShape(int(np.percentile(mb_tiles, 99)), int(np.percentile(padded, 99)), dtype_bytes))


def profile_for_training(config: RunConfig, spec, groups, dataset, img_context_id: int,
                         device: torch.device) -> CostTable:
    """Times at the mean micro-batch, activation and send bytes at the largest one (``spec``: the run's model,
    ``groups``: ``setup.build_groups``' of the training set ``dataset``)."""
    timing, memory = profile_shapes(config, groups, dataset)
    times = profile_units(config, spec, timing, img_context_id, device)
    if memory == timing:
        return times
    sizes = profile_units(config, spec, memory, img_context_id, device, warmup=0, repeats=1)
    byte_fields = ("act_bytes", "act_bytes_full", "act_bytes_selective", "send_bytes", "side_send_bytes")
    units = tuple(dataclasses.replace(t, **{f: getattr(m, f) for f in byte_fields})
                  for t, m in zip(times.units, sizes.units))
    meta = {**times.meta, "shape": timing.to_dict(), "memory_shape": memory.to_dict()}
    return CostTable(units, source="profile", meta=meta)


def profile_at_shape(argv: list[str], shape: MicroBatchShape, path: str | None = None) -> CostTable:
    """Profile the model the trainer flags ``argv`` describe at an explicit micro-batch ``shape``.

    No data is read: this is how a model too large to train here (a published preset, one layer of
    each kind) is measured at the group shape a plan will use. Runs as a world of one; writes the
    profile JSON to ``path`` when given.
    """
    config = parse_config(argv, 1)
    device = choose_device(config.parallel.device)
    initialize_distributed(device, config.parallel.tensor_model_parallel_size, 1)
    set_seeds(config.optim.seed)
    tokenizer, spec = setup_tokenizer(config)
    table = profile_units(config, spec, dataclasses.replace(shape, dtype_bytes=2 if config.optim.bf16 else 4),
                          tokenizer.img_context_id, device)
    if path:
        table.save(path)
    return table
