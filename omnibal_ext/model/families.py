"""Model families: the ``Family`` every planner reads (the protocol), and the one registry of families.

A family is ONE registered ``Family``: its name, its ViT spec class, the cost component of each kind of unit it has,
its ordered unit list, its presets and capabilities (all tensor-free: the planners read them without torch), and
``runtime``, where its run-time side lives (``"module:attribute"``, imported only when the trainer, the profiler or
the Hugging Face converter asks for it: ``Family.load_runtime``). Everything a built-in family is lives in one folder,
``megatron/vlm/families/<name>/``, whose ``__init__`` registers it; this module names no family and imports no
trainer code.

``register(family)`` is the only way into the registry. Registering a different object under a taken name (or a
preset name another family has) is refused; registering the same object again does nothing (a plugin imported twice,
a worker pool running the trainer's ``main`` with ``--family-module`` more than once).
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import UserError
from .components import CostComponent
from .lora import TARGETS
from .moe import first_layers
from .spec import LanguageSpec, ModelSpec, SideTensor


@dataclass(frozen=True)
class Capabilities:
    """What a family implements beyond the plain forward and backward of its units. ``megatron.training.arguments``
    refuses a flag that asks for something its family does not declare (``CAPABILITY_FLAGS`` there maps each field
    to its flags); the defaults declare nothing, so a new family states what it supports.

    drop_path: ViT stochastic depth (``--vision-drop-path-rate``); context_parallel: ``--context-parallel-size`` > 1;
    sequence_parallel: ``--sequence-parallel``; lora_targets: the ``--lora-targets`` its layers take (from
    ``omnibal_ext.model.lora.TARGETS``); image_flags: the data flags its image rule reads (``--max-num-tiles`` ...:
    the reader refuses the others when given); video: video records; moe: mixture-of-experts LLM layers."""

    drop_path: bool = False
    context_parallel: bool = False
    sequence_parallel: bool = False
    lora_targets: tuple[str, ...] = ()
    image_flags: tuple[str, ...] = ()
    video: bool = False
    moe: bool = False

    def __post_init__(self):
        bad = [t for t in self.lora_targets if t not in TARGETS]
        if bad:
            raise ValueError(f"Capabilities.lora_targets: {bad} are no LoRA targets ({', '.join(TARGETS)})")



def fewer_layers(spec: ModelSpec, vision_layers: int, llm_layers: int) -> ModelSpec:
    """``spec`` with ``vision_layers`` ViT and ``llm_layers`` LLM layers (``Family.few_layers``' default)."""
    return spec.replace(vision=dataclasses.replace(spec.vision, num_layers=vision_layers),
                        language=dataclasses.replace(spec.language, num_layers=llm_layers,
                                                     moe=first_layers(spec.language.moe, llm_layers)))


@dataclass(frozen=True)
class Family:
    """name: ``ModelSpec.family``; vision_spec: the dataclass of ``ModelSpec.vision``; components: one
    ``CostComponent`` class per kind of unit; unit_list(spec): (global name, component class, layer
    number or None) in pipeline order, roles in the order I v* P E t* L; vision_item: what the ViT's
    work is counted in (``MicroBatchShape.vision_items``, ISF's Qv); presets: published sizes by name;
    segments_sq(spec, rows, cols): for ViTs whose items vary in size, the (full-attention, window) sums of squared
    attention-segment lengths of images of ``rows x cols`` patches (``MicroBatchShape.vision_attn_tokens_sq``,
    ``vision_window_tokens_sq``), None where an item's attention is fixed (fixed-size tiles).
    spec_problem(spec): what makes a ModelSpec of the family unbuildable (a message naming the flag), or None.
    side_tensors(spec): the tensors its units hand to later units beside the hidden states (``SideTensor``:
    DeepStack features), () for most families; only those whose producer and consumers ``spec`` has (the trainer's
    profiler runs a model of few layers: ``megatron.training.profiling.profile_units``). capabilities: what it
    implements beyond the plain model (``Capabilities``: drop path, CP, SP, LoRA targets, image flags, video, MoE),
    checked when flags are parsed. default_preset: the name of the preset a run without ``--model`` trains
    (``default_model``); the registered families give one name between them. language_spec: the LanguageSpec
    (sub)class of its LLM (a hybrid decoder's extra fields: its layer kinds). few_layers(spec, vision_layers,
    llm_layers): the model of ``spec``'s first ``vision_layers`` ViT and (at least) ``llm_layers`` LLM layers, what
    the trainer's profiler builds (default: ``spec`` at those depths; a family with side tensors also keeps the indexes
    those layers hold). runtime: where its run-time side lives, ``"module:attribute"`` of a
    ``megatron.vlm.stage.components.FamilyRuntime`` (modules, data side, Hugging Face side), imported by
    ``load_runtime`` only (the planner path stays free of torch); "" for a family that only plans."""

    name: str
    vision_spec: type
    components: tuple[type[CostComponent], ...]
    unit_list: Callable[[ModelSpec], list[tuple[str, type[CostComponent], int | None]]]
    vision_item: str
    presets: dict[str, ModelSpec] = field(default_factory=dict)
    segments_sq: Callable | None = None
    spec_problem: Callable[[ModelSpec], str | None] = lambda spec: None  # noqa: E731
    side_tensors: Callable[[ModelSpec], tuple[SideTensor, ...]] = lambda spec: ()  # noqa: E731
    capabilities: Capabilities = Capabilities()
    default_preset: str | None = None
    language_spec: type = LanguageSpec  # the dataclass of ``ModelSpec.language`` (a LanguageSpec subclass)
    few_layers: Callable[[ModelSpec, int, int], ModelSpec] = fewer_layers
    runtime: str = ""

    def load_runtime(self) -> Any:
        """The family's run-time side (the object ``runtime`` names, ``"module:attribute"``), imported on first use
        (the planners never call this: the runtime imports torch)."""
        if not self.runtime:
            raise UserError(f"model family {self.name!r} has no run-time side (Family.runtime is empty)")
        return _load(self.runtime)


def _load(ref: str) -> Any:
    """The attribute ``ref`` (``"module:attribute"``) names, its module imported by name."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


FAMILIES: dict[str, Family] = {}  # name -> Family; filled by ``register`` only


def register(family: Family) -> Family:
    """Add a family; its presets become known (``PRESETS``). The same object again is a no-op; a different object
    under a taken name, or with a preset name another family has, is refused. Returns ``family``."""
    if not isinstance(family, Family):
        raise TypeError(f"register: {family!r} is no omnibal_ext.model.families.Family")
    held = FAMILIES.get(family.name)
    if held is family:
        return family
    if held is not None:
        raise UserError(f"register: model family {family.name!r} is registered already (by another object); "
                        "give the new family another name")
    taken = {p: f.name for f in FAMILIES.values() for p in f.presets}
    clash = sorted(p for p in family.presets if p in taken)
    if clash:
        raise UserError(f"register: family {family.name!r}: preset(s) {', '.join(clash)} belong to family "
                        f"{taken[clash[0]]!r} already")
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family registered by ``register`` (tests)."""
    FAMILIES.pop(name, None)


def family_of(spec: ModelSpec) -> Family:
    try:
        return FAMILIES[spec.family]
    except KeyError:
        raise UserError(f"model {spec.name!r}: unknown family {spec.family!r}; known: {', '.join(FAMILIES)}") from None


def default_model() -> str:
    """The preset a run without ``--model`` trains: the ``default_preset`` the registered families give (one name;
    a family copied from another gives the same)."""
    named = {f.default_preset for f in FAMILIES.values() if f.default_preset}
    if len(named) != 1:
        raise UserError(f"no default model preset: the registered families give {sorted(named) or 'none'}; "
                        "pass --model")
    return named.pop()


class Presets(Mapping):
    """Every registered family's presets by name (a live view: a family registered later adds its own)."""

    def _all(self) -> dict[str, ModelSpec]:
        return {name: spec for f in FAMILIES.values() for name, spec in f.presets.items()}

    def __getitem__(self, name: str) -> ModelSpec:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


PRESETS = Presets()


