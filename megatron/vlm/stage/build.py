"""Pipeline stages of a VLM, built from megatron-core parts through the model family's runtime components.

A stage holds a contiguous slice of the unit list (omnibal_ext.model.units): any run of the family's units
(e.g. ViT patch embedding, ViT layers, projector, LLM embedding, LLM layers, output head).  Layers are
placed like any other unit, so a stage may end the ViT and start the LLM.  The stage builds each run of
consecutive units of one kind through its runtime component (``megatron.vlm.stage.components``) and runs them in
order; it never names a kind.

Stage I/O.  Every stage reads the micro-batch (tokens, tiles, ...) it needs; between stages one tensor
travels, in megatron's [sequence, batch, hidden] order (a tiled family):
  inside the ViT           [tokens per tile, tiles, vision hidden]
  after the projector      [image tokens of all tiles, 1, LLM hidden]
  inside the LLM           [rows x sequence, 1, LLM hidden]  (THD: the micro-batch's rows flattened)
  out of the last stage    loss mode: ``HeadOutput(loss [rows, sequence] fp32, correct [rows, sequence])``;
                           logits mode: this TP rank's logits [rows x sequence, 1, vocabulary / TP]
The shapes change along the pipeline, so the config sets ``variable_seq_lengths``.  Side tensors (DeepStack
features: ``megatron.vlm.stage.side``) live at a boundary travel packed with the hidden states in that one tensor.

No host sync.  Nothing in a micro-batch's forward or backward reads a device tensor on the host: the
segment boundaries, ``max_seqlen`` and the real tiles' indices come from the collate (the host).

Initialisation is seeded per unit (seed, unit index: ``megatron.vlm.layers.seeding``), so a unit has the same
weights whichever stage builds it and whatever the tensor-parallel size.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import make_viewless_tensor

from omnibal_ext.memory.recompute import StageRecompute
from omnibal_ext.model.lora import Lora
from omnibal_ext.model.spec import HEAD, PROJECTOR, TEXT_EMBED, ModelSpec, Unit
from omnibal_ext.model.units import build_units, family_of

from megatron.vlm.layers.config import language_config
from megatron.vlm.layers.head import OUTPUTS
from megatron.vlm.layers.layer_impl import LOCAL, LayerImpl
from megatron.vlm.layers.lora import is_adapter
from megatron.vlm.layers.moe import MoERun
from megatron.vlm.layers.seeding import seeded
from megatron.vlm.stage.components import RuntimeComponent, StageContext, component_of, runtime_family
from megatron.vlm.stage.micro_batch import MicroBatch
from megatron.vlm.stage.side import StageCache, live_at, pack, unpack


@dataclasses.dataclass(frozen=True)
class StageBuild:
    """Everything a stage is built from.

    unit_range: the stage's slice of ``build_units(spec)``; tp, pp: tensor- and pipeline-parallel sizes;
    recompute: this stage's plan (None: none); img_context_id: the tokenizer's image-context id;
    on_cpu: CPU kernels (no fusions that need CUDA); output: "loss" (training: the last stage returns
    ``HeadOutput``) or "logits" (this TP rank's logits).
    """

    spec: ModelSpec
    unit_range: range
    tp: int = 1
    pp: int = 1
    dtype: torch.dtype = torch.float32
    impl: LayerImpl = LOCAL  # the run's layers (``layer_impl.resolve_layer_impl``)
    seed: int = 0
    recompute: StageRecompute | None = None
    img_context_id: int = 0
    on_cpu: bool = True
    output: str = "loss"
    initialize: bool = True  # False: megatron-core's weight initialisation skipped (weights loaded next)
    # per unit of the WHOLE unit list: trains (True) or frozen (omnibal_ext.model.trainable.Trainable.trains);
    # None: every unit trains
    trainable: tuple[bool, ...] | None = None
    sequence_parallel: bool = False  # --sequence-parallel: the ViT and LLM layers' (megatron/vlm/parallel/sequence_parallel.py)
    cp: int = 1  # context-parallel size of the LLM (megatron/vlm/parallel/context_parallel.py); the ViT has none
    vision_drop_path_rate: float = 0.0  # ViT stochastic depth, rising linearly to this at the last layer
    lora: Lora = Lora()  # LoRA adapters on the layers its targets name (megatron/vlm/layers/lora.py); rank 0: none
    moe_run: MoERun | None = None  # how MoE layers train; None: its defaults


@dataclasses.dataclass
class _Part:
    """A run of consecutive units of one kind on the stage, and the component that built it."""

    component: RuntimeComponent
    units: list[Unit]
    blocks: range = range(0)  # layer kinds: its blocks in the stage's ModuleList


def build_stage(build: StageBuild) -> "VLMStage":
    """The stage ``build`` describes (its three TransformerConfigs made here: megatron/vlm/layers/config.py)."""
    spec, tp = build.spec, build.tp
    family = runtime_family(spec)

    def made(config):
        if build.sequence_parallel:
            config = dataclasses.replace(config, sequence_parallel=True)
        return config if build.initialize else dataclasses.replace(config, perform_initialization=False)

    def with_cp(config):
        return config if build.cp == 1 else dataclasses.replace(config, context_parallel_size=build.cp)

    moe = build.moe_run
    return VLMStage(build, family,
                    stage_config=made(with_cp(language_config(spec, tp, build.on_cpu, build.dtype, pp=build.pp,
                                                              moe_run=moe))),
                    vision_config=made(family.vision_config(spec, tp, build.on_cpu, build.dtype)),
                    llm_config=made(with_cp(language_config(spec, tp, build.on_cpu, build.dtype, moe_run=moe))))


class VLMStage(MegatronModule):
    """One pipeline stage: the units ``build.unit_range`` of the model's unit list (use ``build_stage``)."""

    def __init__(self, build: StageBuild, family, stage_config, vision_config, llm_config):
        super().__init__(config=stage_config)
        impl = build.impl
        if build.output not in OUTPUTS:
            raise ValueError(f"stage output must be one of {OUTPUTS}, got {build.output!r}")
        if not impl.segment_attention and build.sequence_parallel:
            raise ValueError("sequence parallelism runs megatron-core's torch layers with SegmentAttention "
                             "(--transformer-impl local, --attention-backend auto)")
        if impl.transformer_engine:  # TE's fused THD RoPE reads cu_seqlens on the device;
            llm_config = dataclasses.replace(llm_config, apply_rope_fusion=True)  # megatron's unfused one
            # would read them on the host (.tolist()) in every layer
        spec = build.spec
        units = build_units(spec)
        unit_range = build.unit_range
        self.stage_build = build
        self.spec = spec
        self.model_type = ModelType.encoder_or_decoder
        # Read by megatron's finalize_model_grads: its embedding group (first and last stage) cannot say
        # where E sits in our layouts, so tied embeddings are kept in sync by this module itself.
        self.pre_process = unit_range.start == 0
        self.post_process = unit_range.stop == len(units)
        self.share_embeddings_and_output_weights = False
        self.units = [units[i] for i in unit_range]
        # side tensors received with the input and sent with the output (megatron/vlm/stage/side.py)
        sides = family_of(spec).side_tensors(spec)
        for side in sides:
            if not 0 <= side.producer < min(side.consumers) or side.last_consumer >= len(units):
                raise ValueError(f"side tensor {side.name!r}: producer unit {side.producer} must come before its "
                                 f"consumers {list(side.consumers)}, all within the {len(units)} units")
        self.sides_in = live_at(sides, unit_range.start)
        self.sides_out = live_at(sides, unit_range.stop)
        self.side_rows = family.data.side_rows
        self.input_tensor = None
        self.recompute = build.recompute or StageRecompute()
        self.ctx = StageContext(spec=spec, units=tuple(units), vision_config=vision_config, language_config=llm_config,
                                seed=build.seed, recompute=self.recompute, img_context_id=build.img_context_id,
                                impl=impl, output=build.output,
                                vision_drop_path_rate=build.vision_drop_path_rate, stage_start=unit_range.start,
                                lora=build.lora,
                                moe_dispatcher=build.moe_run.dispatcher if build.moe_run else "alltoall")
        self.parts: list[_Part] = []
        for run in _runs(self.units):  # each component's modules registered under its name (``attr``: the
            component = component_of(spec, run[0])(self.ctx, run)  # checkpoint keys' first part)
            part = _Part(component, run)
            held = self._modules.get(component.attr)
            if component.layers:
                blocks = component.build()
                if held is None:
                    self.add_module(component.attr, blocks)
                    part.blocks = range(len(blocks))
                else:  # another run of layers in the same place (a family with several layer kinds)
                    part.blocks = range(len(held), len(held) + len(blocks))
                    held.extend(blocks)
            else:
                if held is not None:
                    raise ValueError(f"stage holds two {component.kind()} units")
                with seeded(build.seed, run[0].index):
                    self.add_module(component.attr, component.build())
            for name, module in component.extra_modules().items():
                self.add_module(name, module)
            self.parts.append(part)
        self.tied_group = None  # set by megatron.training.training.build_model when E and L are apart
        self._tie_embeddings()
        self.no_grad_parts, self.detach_input, self.zero_grad_after = self._freeze(build.trainable)
        self.recomputed_trained_parts = frozenset(
            k for k, part in enumerate(self.parts)
            if part.component.layers and self.ctx.layer_recompute(part.component.code())[0] > 0
            and any(p.requires_grad for p in self.module_of(part).parameters()))

    # freezing (omnibal_ext.model.trainable) --------------------------------------------------------
    def _freeze(self, trains: tuple[bool, ...] | None) -> tuple[int, bool, int]:
        """Tag every parameter with its role (``vlm_role``, its unit's unless the component says otherwise:
        ``RuntimeComponent.parameter_role``; the per-module learning rates of
        megatron.training.training.build_optimizer match it), switch off ``requires_grad`` of frozen units'
        parameters (megatron-core's DDP then gives them no gradient buffer and its optimizer no state) except
        their LoRA adapters, which train (a unit with adapters counts as trainable below).

        Returns (parts, detach, after): how many leading parts of the stage run without autograd (those whose
        units and everything upstream are frozen); whether the stage input is used detached (nothing upstream
        of the stage trains, so no gradient of it is needed); the part after which the input's zero gradient
        is attached (``_zero_input_grad``)."""
        role_trains = {}  # a role's first unit's (a parameter of another role than its unit's: DeepStack mergers)
        for u in self.ctx.units:
            role_trains.setdefault(u.code, True if trains is None else trains[u.index])
        for part in self.parts:
            c = part.component
            for unit, module, _ in c.unit_modules(self.get_submodule(c.attr), part.units, part.blocks):
                for name, p in module.named_parameters():
                    role = c.parameter_role(unit, name)
                    p.vlm_role = role
                    trained = trains is None or (trains[unit.index] if role == unit.code else role_trains[role])
                    if not trained and not is_adapter(name):
                        p.requires_grad_(False)
        if trains is None:
            return 0, False, -1
        lora = self.stage_build.lora
        first_trained = next((u.index for u in self.ctx.units if trains[u.index] or lora.linears(u.code)),
                             len(trains))
        if role_trains.get(PROJECTOR, False):  # a side tensor's producer holds a merger of the projector's role
            first_trained = min([first_trained, *(s.producer for s in family_of(self.spec).side_tensors(self.spec))])
        parts = sum(1 for _ in itertools.takewhile(lambda p: p.units[-1].index < first_trained, self.parts))
        detach = self.units[0].index > 0 and first_trained >= self.units[0].index
        return parts, detach, min(parts, len(self.parts) - 1)

    @property
    def thd(self) -> bool:
        """The LLM layers take packed sequences (THD); False: the dense mask of --attention-backend unfused."""
        return self.ctx.impl.thd

    # parts by role ---------------------------------------------------------------------------------
    def part(self, role: str) -> _Part | None:
        """This stage's (first) run of units of ``role`` (a layout letter), or None."""
        return next((p for p in self.parts if p.component.code() == role), None)

    def module_of(self, part: _Part) -> torch.nn.Module:
        """The module holding ``part`` (for a layer kind: its blocks)."""
        module = self.get_submodule(part.component.attr)
        if part.component.layers and len(part.blocks) != len(module):
            return module[part.blocks.start:part.blocks.stop]
        return module

    # tied embeddings (megatron/vlm/parallel/tied.py) --------------------------------------------------------
    def _tie_embeddings(self) -> None:
        head = self.part(HEAD)
        if not self.spec.language.tie_word_embeddings or head is None:
            return
        embed = self.part(TEXT_EMBED)
        embed_weight = embed.component.tied_weight(self.module_of(embed)) if embed is not None else None
        embed_unit = next(u for u in self.ctx.units if u.code == TEXT_EMBED)
        head.component.tie(self.module_of(head), embed_weight, embed_unit, head.component.draw_embedding)

    def tied_embedding_weight(self):
        """This stage's copy of the tied embedding / output weight (None when untied or neither is here)."""
        if not self.spec.language.tie_word_embeddings:
            return None
        for role in (TEXT_EMBED, HEAD):
            part = self.part(role)
            if part is not None:
                return part.component.tied_weight(self.module_of(part))
        return None

    # checkpoint ------------------------------------------------------------------------------------
    def unit_modules(self):
        """(unit, module, where the module sits in this stage's state dict) for each unit of the stage."""
        for part in self.parts:
            c = part.component
            for unit, module, path in c.unit_modules(self.get_submodule(c.attr), part.units, part.blocks):
                yield unit, module, f"{c.attr}{path}."

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron-core sharded state dict whose checkpoint keys are the global unit names (see
        megatron/vlm/parallel/sharding.py): independent of stage, recompute segmentation, layout and TP size."""
        if sharded_offsets:
            raise ValueError("VLMStage.sharded_state_dict: units carry global names; no offsets apply")
        components = {id(p.component): p.component for p in self.parts}
        by_unit = {u.index: components[id(p.component)] for p in self.parts for u in p.units}
        sd = {}
        for unit, module, path in self.unit_modules():
            sd.update(by_unit[unit.index].sharded_state_dict(unit, module, prefix + path, metadata))
        return sd

    # running ---------------------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, batch: MicroBatch):
        """The stage's slice of the model: the next stage's input, or at the end ``HeadOutput`` (loss mode)
        or this TP rank's logits (logits mode)."""
        x, cache = self.input_tensor, StageCache()
        if self.detach_input and x is not None:  # nothing upstream trains: no gradient of the input is needed
            x = x.detach()
        if self.sides_in and x is not None:
            x, received = unpack(x, [(self._rows(s, batch), s.width) for s in self.sides_in])
            for side, tensor in zip(self.sides_in, received):
                cache.put_side(side.name, tensor)
        for k, part in enumerate(self.parts):
            if k < self.no_grad_parts:  # frozen, nothing trainable upstream: forward only, nothing kept
                with torch.no_grad():
                    x = part.component.forward(self.module_of(part), x, batch, cache)
            else:
                if self._recomputed_without_input_grad(k, x):
                    x = x.detach().requires_grad_()
                x = part.component.forward(self.module_of(part), x, batch, cache)
            if self.detach_input and k == self.zero_grad_after:
                x = _zero_input_grad(x, self.input_tensor)
        if self.post_process:
            return x
        x = pack(x, [cache.take_side(s.name) for s in self.sides_out])
        # megatron-core frees a sent stage output's storage (deallocate_pipeline_outputs), which a view of
        # another tensor (the projector's unsqueeze, a reshape) cannot give up
        return make_viewless_tensor(x, requires_grad=x.requires_grad, keep_graph=True)

    def _rows(self, side, batch: MicroBatch) -> int:
        """Rows of side tensor ``side`` in ``batch`` on this rank (host ints only: ``DataSide.side_rows``)."""
        if side.rows != "image_tokens":
            raise ValueError(f"side tensor {side.name!r}: rows {side.rows!r} unknown (\"image_tokens\")")
        cp = self.stage_build.cp
        if cp > 1:

            return self.side_rows(self.spec, batch, cp, parallel_state.get_context_parallel_rank())
        return self.side_rows(self.spec, batch, 1, 0)


    def _recomputed_without_input_grad(self, k: int, x) -> bool:
        """Part ``k`` holds fully recomputed layers with trained parameters (LoRA adapters, unfrozen layers) and gets
        an input that needs no gradient (after a frozen prefix run without autograd, a detached stage input, a
        micro-batch without images into a frozen embedding): megatron-core's recompute (``tensor_parallel.checkpoint``)
        back-propagates only when its input needs a gradient, so the input is made to need one."""
        return (k in self.recomputed_trained_parts and torch.is_grad_enabled() and torch.is_tensor(x)
                and not x.requires_grad)


class _ZeroInputGrad(torch.autograd.Function):
    """``out`` unchanged, attached to the graph of ``inp``, whose gradient is zeros.  megatron-core's 1F1B
    schedule sends every stage's input gradient upstream and the previous stage waits for it; a stage whose
    frozen prefix ran without autograd has none, so it sends zeros (the previous stage's output has no
    ``requires_grad`` then, and megatron-core's ``backward_step`` skips its backward)."""

    @staticmethod
    def forward(ctx, out, inp):
        ctx.meta = (inp.shape, inp.dtype, inp.device)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _zero_input_grad(x, stage_input):
    """After a frozen prefix run without autograd: ``x`` with a zero gradient for the stage's input when the
    schedule expects one (training, a stage that receives a tensor), else ``x`` as it is."""
    if stage_input is None or not torch.is_grad_enabled() or not stage_input.requires_grad:
        return x
    if not torch.is_tensor(x):  # the head's output (the first trained unit is the head): on its loss
        return x._replace(loss=_ZeroInputGrad.apply(x.loss, stage_input))
    return _ZeroInputGrad.apply(x, stage_input)


def _runs(units: list[Unit]) -> list[list[Unit]]:
    """``units`` cut into runs of consecutive units of one kind."""
    runs: list[list[Unit]] = []
    for unit in units:
        if runs and runs[-1][-1].kind == unit.kind:
            runs[-1].append(unit)
        else:
            runs.append([unit])
    return runs

