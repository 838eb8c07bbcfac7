"""The side tensors' (DeepStack features') bytes at every stage boundary, for the planners (tensor-free).

A side tensor (``spec.SideTensor``) travels packed with the hidden states across every boundary between its producer
and its last consumer (``megatron.vlm.stage.side``).  Per micro-batch and TP rank, at the boundary after unit ``u``:

    side_send_bytes[u] = sum over the side tensors live there of rows x width x dtype bytes

with ``rows`` the LLM image tokens of the micro-batch on one (the busiest) CP rank (``image_tokens``: the
projector's output rows, which a family's projector cost component gives as its sent bytes over the LLM width)
and every TP rank holding all rows (replicated also under sequence parallelism).  The sender frees its packed
output after the send; the receiver keeps the received tensor (hidden states and side tensors) for its backward,
so a stage holds its incoming side bytes once per micro-batch in flight (``omnibal_ext.memory.memory_model``).
The padding of the packed tensor (under one row of the hidden states) is not counted.
"""
from __future__ import annotations

import dataclasses

from .shape import MicroBatchShape
from .spec import PROJECTOR, ModelSpec, SideTensor
from .units import build_units, family_of, unit_components


def image_tokens(spec: ModelSpec, shape: MicroBatchShape) -> int:
    """LLM image tokens of one micro-batch on the busiest CP rank: the projector's output rows."""

    units, components = build_units(spec), unit_components(spec)
    projector = next(c for u, c in zip(units, components) if u.code == PROJECTOR)
    sent = projector.act_bytes(shape, 1, 0.0, "flash").send
    return int(round(sent / (spec.language.hidden_size * shape.dtype_bytes)))


def side_rows(side: SideTensor, spec: ModelSpec, shape: MicroBatchShape) -> int:
    if side.rows != "image_tokens":
        raise ValueError(f"side tensor {side.name!r}: rows {side.rows!r} unknown (\"image_tokens\")")
    return image_tokens(spec, shape)


def boundary_side_bytes(spec: ModelSpec, shape: MicroBatchShape) -> list[float]:
    """Per unit ``u`` of the unit list: bytes of the side tensors live at the boundary after it (module docstring)."""

    n = len(build_units(spec))
    out = [0.0] * n
    for side in family_of(spec).side_tensors(spec):
        size = float(side_rows(side, spec, shape) * side.width * shape.dtype_bytes)
        for u in range(side.producer, side.last_consumer):  # boundaries producer+1 .. last consumer
            out[u] += size
    return out


def with_side_bytes(costs, spec: ModelSpec, shape: MicroBatchShape):
    """``costs`` (a CostTable of ``spec``'s units) with every unit's ``side_send_bytes`` from ``boundary_side_bytes``."""
    sides = boundary_side_bytes(spec, shape)
    if len(sides) != len(costs.units):
        raise ValueError(f"cost table has {len(costs.units)} units but {spec.name!r} has {len(sides)}")
    if not any(sides) and not any(u.side_send_bytes for u in costs.units):
        return costs
    return dataclasses.replace(costs, units=tuple(dataclasses.replace(u, side_send_bytes=b)
                                                  for u, b in zip(costs.units, sides)))
