"""Model families: the ``Family`` every planner reads (the protocol), and the one registry of families.

A family is ONE registered ``Family``: its name, its ViT spec class, its kinds of unit (``UnitKind``: each kind's
cost, run-time component, micro-batch parts and Hugging Face mapping in one declaration), its ordered unit list, its
presets and capabilities (all tensor-free: the planners read them without torch), and ``runtime``, where the rest of
its run-time side lives (``"module:attribute"``: the ViT's config, its data and Hugging Face sides), imported only
when the trainer, the profiler or the Hugging Face converter asks for it (``Family.load_runtime``). Its hooks are
methods of its own ``Family`` subclass. Everything a built-in family is lives in one folder,
``megatron/vlm/families/<name>/``, whose ``__init__`` registers it; this module names no family and imports no
trainer code.

``register(family)`` is the only way into the registry. Registering a different object under a taken name (or a
preset name another family has) is refused; registering the same object again does nothing (a plugin imported twice,
a worker pool running the trainer's ``main`` with ``--family-module`` more than once).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import UserError
from .lora import TARGETS
from .moe import first_layers
from .spec import LanguageSpec, ModelSpec, SideTensor
from .unit_kind import UnitEntry, UnitKind, resolve


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


class PatchVision(Protocol):
    """The ViT spec (``ModelSpec.vision``) of a family whose ViT's work is counted in patches (``Family.vision_item``
    "patch": images at native resolution, so an item's attention cost varies with its image)."""

    def segments_sq(self, rows, cols) -> tuple[np.ndarray, np.ndarray]:
        """(full-attention, window) sums of squared attention-segment lengths (patches^2) of images of ``rows x
        cols`` patches (arrays, one entry per image): what ``MicroBatchShape.vision_attn_tokens_sq`` and
        ``vision_window_tokens_sq`` add per image."""


VISION_ITEMS = ("tile", "patch")  # what a ViT's work is counted in: fixed-size tiles, or patches (PatchVision)


@dataclass(frozen=True)
class Family(abc.ABC):
    """One model family: the object every planner reads and the one the registry holds. Its data are fields; its
    hooks are methods, which a family overrides in a subclass of its own (``unit_list`` it must give; the others
    have defaults), so that each says its signature, its units and its default in one place.

    name: ``ModelSpec.family``; kinds: every kind of unit its models have (``UnitKind``: each kind's cost, run-time
    component, micro-batch parts and Hugging Face mapping; names distinct), which ``unit_list`` places; vision_spec: the
    dataclass of ``ModelSpec.vision`` (a ``PatchVision`` where ``vision_item`` is "patch"); vision_item: what the
    ViT's work is counted in (``MicroBatchShape.vision_items``, ISF's Qv): "tile" (fixed-size tiles: every item costs
    alike) or "patch" (native resolution: ``native_resolution``); presets: published sizes by name; capabilities:
    what it implements beyond the plain model (``Capabilities``: drop path, CP, SP, LoRA targets, image flags, video,
    MoE), checked when flags are parsed; default_preset: the name of the preset a run without ``--model`` trains
    (``default_model``; the registered families give one name between them); language_spec: the ``LanguageSpec``
    (sub)class of ``ModelSpec.language`` (a hybrid decoder's extra fields: its layer kinds); runtime: where the rest
    of its run-time side lives, ``"module:attribute"`` of a ``megatron.vlm.stage.components.FamilyRuntime`` (the
    ViT's config, the data side, the Hugging Face side), imported by ``load_runtime`` only (the planner path stays
    free of torch); "" for a family that only plans."""

    name: str
    vision_spec: type
    kinds: tuple[UnitKind, ...]
    vision_item: str
    presets: dict[str, ModelSpec] = field(default_factory=dict)
    capabilities: Capabilities = Capabilities()
    default_preset: str | None = None
    language_spec: type = LanguageSpec
    runtime: str = ""

    def __post_init__(self):
        names = [getattr(k, "name", k) for k in self.kinds]
        if not all(isinstance(k, UnitKind) for k in self.kinds) or len(set(names)) != len(names):
            raise TypeError(f"family {self.name!r}: kinds must be UnitKinds of distinct names, got {names}")
        if self.vision_item not in VISION_ITEMS:
            raise TypeError(f"family {self.name!r}: vision_item must be one of {VISION_ITEMS}, got "
                            f"{self.vision_item!r}")
        if self.native_resolution and not callable(getattr(self.vision_spec, "segments_sq", None)):
            raise TypeError(f"family {self.name!r}: its ViT counts patches, so its vision spec "
                            f"{self.vision_spec.__name__} must give segments_sq(rows, cols) (PatchVision)")

    # hooks ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def unit_list(self, spec: ModelSpec) -> list[UnitEntry]:
        """(global name, kind, layer number or None) of each unit of ``spec`` in pipeline order, roles in the order
        I v* P E t* L, each kind one of ``kinds``; the global names are the checkpoint keys' and the profiles'
        (``vit.embed``, ``vit.layer.<i>``, ``projector``, ``llm.embed``, ``llm.layer.<i>``, ``llm.head``)."""

    def spec_problem(self, spec: ModelSpec) -> str | None:
        """What makes a ModelSpec of the family unbuildable (a message naming the flag or config key), or None."""
        return None

    def side_tensors(self, spec: ModelSpec) -> tuple[SideTensor, ...]:
        """The tensors ``spec``'s units hand to later units beside the hidden states (``SideTensor``: DeepStack
        features); only those whose producer and consumers ``spec`` has (the trainer's profiler runs a model of few
        layers: ``megatron.training.profiling.profile_units``). Default: none."""
        return ()

    def few_layers(self, spec: ModelSpec, vision_layers: int, llm_layers: int) -> ModelSpec:
        """The model of ``spec``'s first ``vision_layers`` ViT and (at least) ``llm_layers`` LLM layers: what the
        trainer's profiler builds. Default: ``spec`` at those depths (``fewer_layers``); a family with side tensors
        also keeps the indexes those layers hold, a hybrid decoder a layer of each kind."""
        return fewer_layers(spec, vision_layers, llm_layers)

    # derived -------------------------------------------------------------------------------------
    def kind(self, name: str) -> UnitKind:
        """Its kind of unit called ``name`` (``Unit.kind``)."""
        for kind in self.kinds:
            if kind.name == name:
                return kind
        raise KeyError(f"family {self.name!r} has no unit kind {name!r} (its kinds: "
                       f"{', '.join(k.name for k in self.kinds)})")

    @property
    def native_resolution(self) -> bool:
        """Its ViT's items are patches whose cost varies with their image (``vision_item`` "patch"): an image's
        attention segments come from its patch grid (``spec.vision.segments_sq``, ``PatchVision``)."""
        return self.vision_item == "patch"

    def load_runtime(self) -> Any:
        """The family's run-time side (the object ``runtime`` names, ``"module:attribute"``), imported on first use
        (the planners never call this: the runtime imports torch)."""
        if not self.runtime:
            raise UserError(f"model family {self.name!r} has no run-time side (Family.runtime is empty)")
        return resolve(self.runtime)


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


