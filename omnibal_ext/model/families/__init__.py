"""Model families, planning side: what a family declares so that every planner serves it.

A family is a ``Family``: its name, its ViT spec class, the cost component of each kind of unit it
has, its ordered unit list and its presets. Its runtime side (modules, checkpoint and Hugging Face
keys, data) lives in ``megatron/vlm/families/<name>/`` under the same name. The registry is
``omnibal_ext.model.units``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..components import CostComponent
from ..spec import ModelSpec, SideTensor


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
    profiler runs a model of few layers: ``megatron.training.profiling.profile_units``)."""

    name: str
    vision_spec: type
    components: tuple[type[CostComponent], ...]
    unit_list: Callable[[ModelSpec], list[tuple[str, type[CostComponent], int | None]]]
    vision_item: str
    presets: dict[str, ModelSpec] = field(default_factory=dict)
    segments_sq: Callable | None = None
    spec_problem: Callable[[ModelSpec], str | None] = lambda spec: None  # noqa: E731
    side_tensors: Callable[[ModelSpec], tuple[SideTensor, ...]] = lambda spec: ()  # noqa: E731
