"""The run-time side of a unit kind, and of a model family.

Each kind of unit (``omnibal_ext.model.unit_kind.UnitKind``: its name, role, cost, micro-batch parts and Hugging Face
mapping, in one torch-free declaration) names a ``RuntimeComponent`` class (``UnitKind.runtime``) that knows

* how its module is built from megatron-core parts (``build``; the units of a layer kind that sit together
  on a stage become TransformerBlock segments carrying their recompute settings) and run (``forward``);
* its checkpoint keys (``sharded_state_dict``: keyed by the unit's global name);
* how the profiler runs one unit of it (``profile_module``, ``profile_forward``).

``runtime_of`` imports it on first use and checks it. The GPT decoder's components (text embedding, text layer, MoE
layer, head) are here, since every family's LLM is one (their kinds: ``megatron.vlm.stage.kinds``). A family's
other run-time parts (the ViT's config, its data and Hugging Face sides) are its ``FamilyRuntime``
(``Family.runtime``, ``runtime_family``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar, Protocol, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from omnibal_ext.memory.recompute import StageRecompute
from omnibal_ext.model.families import family_of
from omnibal_ext.model.lora import Lora
from omnibal_ext.model.spec import HEAD, TEXT_LAYER, VISION_LAYER, ModelSpec, Unit
from omnibal_ext.model.unit_kind import UnitKind

from megatron.vlm.hf.config import HFSide
from megatron.vlm.layers import blocks as layers, moe
from megatron.vlm.layers.head import OutputHead
from megatron.vlm.layers.layer_impl import LayerImpl
from megatron.vlm.layers.moe import token_mask
from megatron.vlm.layers.norms import TorchNorm
from megatron.vlm.layers.seeding import seeded
from megatron.vlm.parallel import sequence_parallel
from megatron.vlm.parallel.context_parallel import (context_parallel_group, gather_rows, tile_ranges,
                                                    vision_process_groups)
from megatron.vlm.parallel.padded_heads import tp_rank
from megatron.vlm.parallel.sharding import drop_padded_heads, unit_sharded_state_dict
from megatron.vlm.stage.data_side import TILED, DataSide
from megatron.vlm.stage.micro_batch import MicroBatch, StageInputs
from megatron.vlm.stage.side import StageCache
from megatron.vlm.stage.text import TextContext, TextEmbedding, run_text_blocks, text_context, word_embedding


@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a stage's components are built with (``megatron.vlm.stage.build.build_stage`` makes it)."""

    spec: ModelSpec
    units: tuple[Unit, ...]  # the whole model's unit list (a tied head finds the text embedding in it)
    vision_config: TransformerConfig
    language_config: TransformerConfig
    seed: int
    recompute: StageRecompute
    img_context_id: int
    impl: LayerImpl  # how the layers are built (TransformerEngine or torch modules, THD or a dense mask)
    output: str  # "loss" or "logits"
    vision_drop_path_rate: float = 0.0  # ViT stochastic depth at the last layer (megatron/vlm/layers/drop_path.py)
    stage_start: int = 0  # index in ``units`` of the stage's first unit
    lora: Lora = Lora()  # LoRA adapters (megatron/vlm/layers/lora.py); rank 0: none
    moe_dispatcher: str = "alltoall"  # MoE layers' token dispatcher (--moe-token-dispatcher-type)

    def build_layers(self, units: list[Unit], config: TransformerConfig, spec_for, role: str,
                     lora_linears: tuple[str, ...] | None = None) -> torch.nn.ModuleList:
        """The TransformerBlock segments of a run of layer ``units`` of ``role`` built with ``config``: this stage's
        recompute of the role and the LoRA adapters its targets put on these layers (``layers.build_blocks``;
        ``lora_linears``: of those, the ones these layers have, None: all); ViT layers without the CP group
        (``context_parallel.vision_process_groups``)."""
        full, selective = self.layer_recompute(role, units[0].index)
        linears = self.lora.linears(role)
        if lora_linears is not None:
            linears = tuple(n for n in linears if n in lora_linears)
        return layers.build_blocks(config, spec_for, units[0].index, len(units), full, selective,
                                   self.lora, linears,
                                   vision_process_groups() if role == VISION_LAYER else None)

    def sequence_parallel_edges(self, units: list[Unit], config: TransformerConfig,
                                split_after: tuple[str, ...] = ()) -> tuple[bool, bool]:
        """(enters, leaves) the sequence-parallel region, for a run of ``units`` of one role (``code``: a family's
        several ViT layer kinds share one region) built with ``config``: it enters unless the unit before it (in
        the whole model) has its role, so the input comes split; it leaves unless the unit after it has its role
        or one in ``split_after`` (the head reads split hidden states). Both False without sequence parallelism."""
        if not config.sequence_parallel:
            return False, False
        first, last, role = units[0].index, units[-1].index, units[0].code
        enters = first == 0 or self.units[first - 1].code != role
        after = self.units[last + 1] if last + 1 < len(self.units) else None
        return enters, after is None or (after.code != role and after.code not in split_after)

    def layer_recompute(self, role: str, first_index: int | None = None) -> tuple[int, bool]:
        """(fully recomputed layers, selective) of the run of ``role`` layers starting at unit ``first_index``:
        the stage's plan recomputes its first ``full`` layers of the role in unit order (as the memory model
        counts them), so a run after others of the role on the stage (windowed and full-attention
        layers alternate) gets what they left (``first_index`` None: the stage's first run)."""
        r = self.recompute
        if role == VISION_LAYER:
            full, selective = r.vit_full_layers, r.vit_selective
        elif role == TEXT_LAYER:
            full, selective = r.llm_full_layers, r.llm_selective
        else:
            raise ValueError(f"role {role!r} has no layers to recompute")
        start = self.stage_start if first_index is None else first_index
        before = sum(1 for u in self.units[self.stage_start:start] if u.code == role)
        return max(0, full - before), selective


class RuntimeComponent:
    """One kind of unit at run time (the class its ``UnitKind.runtime`` names), bound to a stage's ``StageContext``
    and to the run of its units on the stage (``units``: one unit; for a layer kind the consecutive units on this
    stage). Stateless: what it decides from those (sequence-parallel edges, DeepStack slots, its rotary table) is
    derived from them (properties, computed once), never set while it builds or runs; assigning an attribute raises.
    What its units share per micro-batch lives in the forward's ``StageCache``.

    attr: the stage attribute holding its module (where the module sits in the stage's state dict); layers: a
    transformer-layer kind (units that sit together form TransformerBlock segments; ``attr`` then holds a ModuleList
    of blocks). Its kind's name, role and micro-batch parts are the ``UnitKind``'s (``kind()``, ``code()``: its
    units').
    """

    attr: ClassVar[str] = ""
    layers: ClassVar[bool] = False

    def __init__(self, ctx: StageContext, units: Sequence[Unit]):
        object.__setattr__(self, "ctx", ctx)
        object.__setattr__(self, "spec", ctx.spec)
        object.__setattr__(self, "units", tuple(units))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__}.{name}: runtime components hold no state (derive it from "
                             "ctx and units)")

    @functools.cached_property
    def sp_edges(self) -> tuple[bool, bool]:
        """(enters, leaves) the sequence-parallel region (``StageContext.sequence_parallel_edges``); the default:
        neither (a kind outside the sequence-parallel layers)."""
        return False, False

    @property
    def sp_enters(self) -> bool:
        """The input comes whole and is split here (``sp_edges``)."""
        return self.sp_edges[0]

    @property
    def sp_leaves(self) -> bool:
        """The output is gathered whole here (``sp_edges``)."""
        return self.sp_edges[1]

    def kind(self) -> str:
        """Its units' kind (``UnitKind.name``)."""
        return self.units[0].kind

    def code(self) -> str:
        """Its units' role (``UnitKind.role``, the layout letter)."""
        return self.units[0].code

    # building and running --------------------------------------------------------------------------
    def build(self) -> torch.nn.Module:
        """The module of ``units``. The stage draws a single unit's module under the unit's seed; layers seed
        themselves per unit."""
        raise NotImplementedError

    def extra_modules(self) -> dict[str, torch.nn.Module]:
        """Parameter-free helpers the stage registers after the module (the LLM layers' rotary table)."""
        return {}

    def forward(self, module: torch.nn.Module, x, batch: MicroBatch, cache: StageCache):
        """The unit(s) on the previous output ``x`` (None at the model's start); ``cache``: per micro-batch."""
        raise NotImplementedError

    def prepare(self, module: torch.nn.Module, batch: MicroBatch, cache: StageCache) -> None:
        """Build what ``forward`` keeps in ``cache`` for ``batch`` now (the profiler times units without it)."""

    def parameter_role(self, unit: Unit, name: str) -> str:
        """The role (layout letter) parameter ``name`` of ``unit``'s module plays for freezing, LoRA and the
        per-module learning rates: the unit's own, unless a unit holds parts of another role (DeepStack
        mergers, the projector's, in ViT layer units)."""
        return unit.code

    # checkpoint ------------------------------------------------------------------------------------
    def unit_modules(self, module: torch.nn.Module, units: list[Unit], blocks: range = range(0)):
        """(unit, its module, path of that module below ``attr``) for each of ``units``; a layer kind's
        ``module`` is the stage's ModuleList, its units in the blocks ``blocks``."""
        if not self.layers:
            (unit,) = units
            yield unit, module, ""
            return
        layer_units = iter(units)
        for b in blocks:
            for j, layer in enumerate(module[b].layers):
                yield next(layer_units), layer, f".{b}.layers.{j}"

    def sharded_state_dict(self, unit: Unit, module: torch.nn.Module, module_prefix: str, metadata) -> dict:
        """The unit's tensors keyed by its global name (megatron/vlm/parallel/sharding.py)."""
        return unit_sharded_state_dict(module, module_prefix, f"{unit.name}.", metadata)

    # profiling -------------------------------------------------------------------------------------
    def profile_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module of one unit (a layer kind: the first block, one layer on a profiling stage)."""
        return module[0] if self.layers else module

    def profile_forward(self, module: torch.nn.Module, x, batch: MicroBatch, cache: StageCache):
        """One unit's forward (a layer kind: the first block)."""
        return self.forward(module[:1] if self.layers else module, x, batch, cache)

    def tied_weight(self, module: torch.nn.Module):
        """The tied input/output embedding weight this unit holds (None: none)."""
        return None


# ---------------------------------------------------------------------------------------------------
# The GPT decoder's components, shared by every family
# ---------------------------------------------------------------------------------------------------
class TextEmbed(RuntimeComponent):
    """Vocabulary-parallel token embedding; the vision features go into the image-context slots."""

    attr = "text_embed"

    def build(self):
        return TextEmbedding(self.spec, self.ctx.language_config, self.ctx.img_context_id,
                             self.spec.tokens_per_tile)

    def forward(self, module, x, batch, cache):
        # context parallelism: every rank's tiles, then this rank's tokens'
        if batch.cp is not None and batch.cp.image_feature_index is not None:
            group = context_parallel_group()
            T = self.spec.tokens_per_tile
            x = gather_rows(x, [len(r) * T for r in tile_ranges(batch.cp.num_tiles, group.size())], group)
            return module(batch.text.tokens, x, batch.vision.image_tile_index, batch.cp.image_feature_index)
        return module(batch.text.tokens, x, batch.vision.image_tile_index)

    def tied_weight(self, module):
        return module.word.weight


class TextLayer(RuntimeComponent):
    """GPT decoder layers (megatron-core's layer spec): causal attention within each packed sample, RoPE; per-head
    q/k RMSNorm where the LanguageSpec has ``qk_norm`` (Qwen3)."""

    attr, layers = "llm_blocks", True
    lora_linears: tuple[str, ...] | None = None  # the LoRA targets' linears its layers have (None: all)

    def layer_spec(self, first_unit_index: int):
        ctx = self.ctx
        spec = layers.layer_spec(self.spec.language.normalization, ctx.impl.llm_mask_type, ctx.seed,
                                 first_unit_index, ctx.impl)
        return layers.with_qk_norm(spec) if self.spec.language.qk_norm else spec

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.language_config, (HEAD,))

    def build(self):
        return self.ctx.build_layers(self.units, self.ctx.language_config, self.layer_spec, self.code(),
                                     lora_linears=self.lora_linears)

    @functools.cached_property
    def rotary(self) -> torch.nn.Module:
        """The rotary table (parameter-free; the stage registers it: ``extra_modules``)."""
        lang = self.spec.language
        return RotaryEmbedding(kv_channels=lang.kv_channels, rotary_percent=1.0, rotary_base=lang.rotary_base,
                               use_cpu_initialization=True)

    def extra_modules(self):
        return {"rotary": self.rotary}

    def context(self, module, batch: MicroBatch, cache: StageCache) -> TextContext:
        """The LLM blocks' inputs besides the hidden states, built once per micro-batch (``text_context``)."""
        def make():
            device = next(module.parameters()).device if self.ctx.impl.transformer_engine else None
            return text_context(batch, self.rotary, self.ctx.impl.thd, device)

        return cache.once(TextContext, make)

    def prepare(self, module, batch, cache):
        self.context(module, batch, cache)

    def forward(self, module, x, batch, cache):
        if self.sp_enters:  # the embedding's output (every token) -> this TP rank's tokens
            x = sequence_parallel.enter(x)
        x = run_text_blocks(module, x, self.context(module, batch, cache), self.ctx.impl.thd)
        return sequence_parallel.leave(x) if self.sp_leaves else x


class MoEMLPs:
    """A mixin for LLM layer components whose MLP is megatron-core's ``MoELayer`` (``LanguageSpec.moe``;
    ``megatron/vlm/layers/moe.py``): ``with_moe`` turns a dense layer spec into the MoE one (top-k router, ``SequentialMLP``
    experts drawn per global expert, the run's token dispatcher; the router's ``layer_number`` the decoder layer + 1,
    by which megatron-core's aux-loss tracker indexes the decoder's layers), and ``context`` adds the router's token
    mask (padding and packed-sample membership, ``moe_padding_mask``), so its aux losses and the expert load count
    real tokens only."""

    def with_moe(self, dense_spec, first_unit_index: int):
        units, lang = self.ctx.units, self.spec.language
        previous = dense_spec.params.get("redraw")

        def redraw(layer, config):  # megatron-core's API for the router's tracker index
            if previous is not None:
                previous(layer, config)
            layer.mlp.set_layer_number(units[first_unit_index + layer.layer_number - 1].layer + 1)

        spec = moe.layer_spec(dense_spec, lang.moe.num_experts, lang.normalization, self.ctx.moe_dispatcher)
        spec.params = {**spec.params, "redraw": redraw}
        return spec

    def context(self, module, batch, cache):
        def make():
            text = super(MoEMLPs, self).context(module, batch, cache)
            mask = moe_padding_mask(batch, self.ctx.impl.thd, self.ctx.language_config.sequence_parallel)
            return MoEContext(text.attention_mask, text.rotary_pos_emb, text.packed_seq_params, mask)

        return cache.once(MoEContext, make)


class MoEContext(TextContext):
    """The MoE layers' ``TextContext``: with the router's token mask (``padding_mask``), held apart from the dense
    layers' context in the ``StageCache``."""


class MoETextLayer(MoEMLPs, TextLayer):
    """GPT decoder layers with MoE MLPs (``MoEMLPs``). LoRA adapts the attention only."""

    lora_linears = ("qkv", "proj")

    def layer_spec(self, first_unit_index: int):
        return self.with_moe(super().layer_spec(first_unit_index), first_unit_index)


def moe_padding_mask(batch: MicroBatch, thd: bool, sequence_parallel: bool) -> torch.Tensor:
    """The router's token mask (``megatron.vlm.layers.moe.token_mask``: padding and packed-sample membership, bool [rows,
    sequence, 1 + samples]; THD: the micro-batch's rows flattened, [1, rows x sequence, 1 + samples]) from the
    collate's segment ids (-1: padding); under sequence parallelism this TP rank's tokens (the MoE layer sees 1/TP of
    them). Under context parallelism the sample axis has one column per segment of the unsplit micro-batch
    (``cu_seqlens``, the same on every CP rank; padding segments' columns stay empty), so that the CP ranks' per-sample
    statistics line up when summed (a rank may hold none of a short sample's tokens)."""

    packing = batch.packing
    samples = len(packing.cu_seqlens) - 1 if context_parallel_group() is not None else None
    mask = token_mask(packing.segment_ids, samples)
    if thd:
        mask = mask.reshape(1, -1, mask.shape[-1])
    if sequence_parallel:

        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        n = mask.shape[1] // tp
        mask = mask[:, rank * n:(rank + 1) * n]
    return mask


class Head(RuntimeComponent):
    """Final norm, vocabulary-parallel output layer and loss (or logits: ``StageBuild.output``)."""

    attr = "head"

    def norm_builder(self):
        """The final norm's builder (called as megatron-core's: ``config=, hidden_size=, eps=``)."""

        if self.ctx.language_config.sequence_parallel:  # megatron-core's torch norm refuses it
            return TorchNorm
        return get_gpt_layer_local_spec(normalization=self.spec.language.normalization).submodules.input_layernorm

    @functools.cached_property
    def sp_edges(self):
        """Sequence parallel: the LLM layers hand over this TP rank's tokens; the norm runs on them and the output
        layer all-gathers them (its config's sequence_parallel); it enters the region when no LLM layer precedes."""
        units = self.units
        before = self.ctx.units[units[0].index - 1] if units[0].index else None
        return self.ctx.language_config.sequence_parallel and (before is None or before.code != TEXT_LAYER), False

    def build(self):
        norm = self.norm_builder()
        return OutputHead(self.spec, self.ctx.language_config, norm, output=self.ctx.output)

    def forward(self, module, x, batch, cache):
        if self.sp_enters:
            x = sequence_parallel.enter(x)
        return module(x, batch.text.labels if self.ctx.output == "loss" else None)

    def logits(self, module, x):
        """This TP rank's logits [t, 1, V/tp] of the hidden states ``x``, whatever the stage's output mode
        (generation: ``megatron.vlm.inference``)."""
        if self.sp_enters:
            x = sequence_parallel.enter(x)
        return module.logits(x)

    def profile_forward(self, module, x, batch, cache):
        out = self.forward(module, x, batch, cache)
        return out.loss if self.ctx.output == "loss" else out

    def tied_weight(self, module):
        return module.output.weight

    def tie(self, module: OutputHead, embed_weight: torch.Tensor | None, embed_unit: Unit,
            draw_embedding: Callable[[], torch.nn.Module]) -> None:
        """Tied embeddings: use the stage's embedding Parameter, or (E on another stage) hold a copy drawn
        as E draws it, marked ``shared`` (megatron/vlm/parallel/tied.py)."""
        if embed_weight is not None:
            module.output.weight = embed_weight
            return
        with seeded(self.ctx.seed, embed_unit.index):
            drawn = draw_embedding()
        with torch.no_grad():
            module.output.weight.copy_(drawn.weight)
        module.output.weight.shared = True

    def draw_embedding(self):
        return word_embedding(self.spec, self.ctx.language_config)


class PaddedHeadLayers(RuntimeComponent):
    """ViT layers built with heads padded to a multiple of TP (``megatron/vlm/parallel/padded_heads.py``): their checkpoint
    holds the real heads only (``sharding.drop_padded_heads``), so it loads at any TP size."""

    def sharded_state_dict(self, unit, module, module_prefix, metadata):
        sd = super().sharded_state_dict(unit, module, module_prefix, metadata)
        cfg = self.ctx.vision_config
        drop_padded_heads(sd, module_prefix, self.spec.vision.num_attention_heads,
                          cfg.num_attention_heads // cfg.tensor_model_parallel_size, tp_rank(cfg), cfg.kv_channels)
        return sd


class VisionConfig(Protocol):
    def __call__(self, spec: ModelSpec, tp: int, on_cpu: bool, dtype: torch.dtype) -> TransformerConfig:
        """The ViT's TransformerConfig for tensor-parallel size ``tp`` (``on_cpu``: CPU initialization)."""


@dataclasses.dataclass(frozen=True)
class FamilyRuntime:
    """A model family's run-time parts besides its unit kinds' components, which its ``Family.runtime`` names
    (``"module:attribute"``) and ``runtime_family`` loads: the ViT's TransformerConfig, its Hugging Face side
    (``megatron.vlm.hf.config.HFSide``: config reader, tensor names, logits-check micro-batches, structure twin; None
    where it has none) and its data side (``megatron.vlm.stage.data_side.DataSide``: image tokens, image rule,
    micro-batches)."""

    vision_config: VisionConfig
    hf: HFSide | None = None
    data: DataSide = TILED


@functools.cache
def runtime_of(kind: UnitKind) -> type[RuntimeComponent]:
    """The run-time component class ``kind.runtime`` names, imported on first use and checked: a
    ``RuntimeComponent`` subclass, and ``kind.reads`` parts of a micro-batch (``StageInputs`` fields). Anything else
    is a TypeError naming the kind (a bug of its family)."""
    try:
        component = kind.load_runtime()
    except (ImportError, AttributeError) as e:
        raise TypeError(f"unit kind {kind.name!r}: its runtime {kind.runtime!r} does not import: {e}") from e
    if not (isinstance(component, type) and issubclass(component, RuntimeComponent)):
        raise TypeError(f"unit kind {kind.name!r}: its runtime {kind.runtime!r} is no RuntimeComponent class")
    try:
        StageInputs.reading(kind.reads)
    except ValueError as e:
        raise TypeError(f"unit kind {kind.name!r}: reads {sorted(kind.reads)}: {e}") from None
    return component


def runtime_family(spec: ModelSpec) -> FamilyRuntime:
    """The run-time side of ``spec``'s family (``Family.runtime``), imported on first use, its unit kinds' components
    with it (``runtime_of``: checked, so that a family's mistake shows before any work)."""
    family = family_of(spec)
    runtime = family.load_runtime()
    if not isinstance(runtime, FamilyRuntime):
        raise TypeError(f"family {family.name!r}: its runtime {family.runtime!r} is no FamilyRuntime")
    for kind in family.kinds:
        runtime_of(kind)
    return runtime


def component_of(spec: ModelSpec, unit: Unit) -> type[RuntimeComponent]:
    """The runtime component class of ``unit`` (a unit of ``build_units(spec)``): its kind's."""
    return runtime_of(family_of(spec).kind(unit.kind))


def units_inputs(spec: ModelSpec, units) -> StageInputs:
    """What a stage holding ``units`` reads of a micro-batch: the union of their kinds' ``reads``."""
    family = family_of(spec)
    return StageInputs.reading(set().union(*(family.kind(unit.kind).reads for unit in units)))
