"""Model families, planning side: what a family declares so that every planner serves it, and the registry.

A family is a ``Family``: its name, its ViT spec class, the cost component of each kind of unit it
has, its ordered unit list and its presets. Its runtime side (modules, checkpoint and Hugging Face
keys, data) lives in ``megatron/vlm/families/<name>/`` under the same name.

``register(family)`` is the only way into the registry: every module of this package registers its family when
imported, and the package imports them all (``pkgutil``), so that no shared module names a family; a family
defined elsewhere (a plugin, a test) calls ``register`` itself (the runtime's ``megatron.vlm.families.register``
does it for both sides).
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Callable

from ...errors import UserError
from ..components import CostComponent
from ..lora import TARGETS
from ..moe import first_layers
from ..spec import LanguageSpec, ModelSpec, SideTensor


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
    ``vision_window_tokens_sq``), None where an item's attention is fixed (InternVL's tiles).
    spec_problem(spec): what makes a ModelSpec of the family unbuildable (a message naming the flag), or None.
    side_tensors(spec): the tensors its units hand to later units beside the hidden states (``SideTensor``:
    DeepStack features), () for most families; only those whose producer and consumers ``spec`` has (the trainer's
    profiler runs a model of few layers: ``megatron.training.profiling.profile_units``). capabilities: what it
    implements beyond the plain model (``Capabilities``: drop path, CP, SP, LoRA targets, image flags, video, MoE),
    checked when flags are parsed. default_preset: the name of the preset a run without ``--model`` trains
    (``default_model``); the registered families give one name between them. language_spec: the LanguageSpec
    (sub)class of its LLM (a hybrid decoder's extra fields: its layer kinds). few_layers(spec, vision_layers,
    llm_layers): the model of ``spec``'s first ``vision_layers`` ViT and (at least) ``llm_layers`` LLM layers, what
    the trainer's profiler builds (default: ``spec`` at those depths; Qwen3-VL also keeps the DeepStack indexes
    those layers hold)."""

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


FAMILIES: dict[str, Family] = {}  # name -> Family; filled by ``register`` only


def register(family: Family) -> Family:
    """Add (or replace) a family's planning side; its presets become known (``PRESETS``). Returns ``family``."""
    if not isinstance(family, Family):
        raise TypeError(f"register: {family!r} is no omnibal_ext.model.families.Family")
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


def _discover() -> None:
    """Import every module of this package: each registers its family."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_discover()
