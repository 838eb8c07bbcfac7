"""Per-stage costs linear in the micro-batch shape (tiles, LLM tokens, sum of squared sample lengths).

The analytic cost model gives every unit's time as a linear function of the shape, so a layout's
per-stage forward, backward (with the recompute extra) and send times are read once at three unit
shapes (:func:`basis_costs`) and combined per micro-batch (:func:`stage_coefficients`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..model.spec import LAYER_ROLES
from ..memory.memory_model import unit_modes
from ..memory.recompute import StageRecompute
from ..model.cost_model import DeviceSpec, MicroBatchShape, analytic_costs
from ..model.moe_cost import MEAN_RUN, ExpertRun
from ..model.costs import CostTable
from ..model.layout import PipelineLayout
from ..model.sample_time import VisionSegments
from ..model.simulate import layout_stage_costs
from ..model.units import ModelSpec

# tiles, LLM tokens and sum of squared sample lengths (tokens^2) of the unit shapes the linear costs are read at
BASIS = 1024.0
MODE_NAMES = {0: "none", 1: "selective", 2: "full"}  # memory_model's per-unit recompute modes


def basis_costs(spec: ModelSpec, tp: int, device: DeviceSpec, attention: str = "unfused",
                sequence_parallel: bool = False, cp: int = 1,
                segments: VisionSegments | None = None, experts: ExpertRun = MEAN_RUN) -> tuple[CostTable, ...]:
    """Cost tables at the unit shapes: tiles only, tokens only, tokens + attention (see stage_coefficients).

    cp: context-parallel size; the unit shapes are split over ``cp`` ranks (``MicroBatchShape.cp``), so the
    coefficients give one CP rank's time of a whole micro-batch's (padded) shape (BASIS is a multiple of any
    power-of-two CP, so the split's rounding does not enter).
    segments: for ViTs whose items vary in size (native-resolution patches), the data's attention segments per item:
    the ViT items of the basis carry ``segments.mean_shape_sq`` (None: the family's default).
    experts: how MoE layers run (``moe_cost.ExpertRun``; their costs are linear in the tokens too)."""
    b = int(BASIS)
    kw = dict(attention=attention, sequence_parallel=sequence_parallel, experts=experts)
    vit_sq = {} if segments is None else segments.shape_sq(b, mean=True)
    return (analytic_costs(spec, MicroBatchShape(b, 0, cp=cp, **vit_sq), tp, device, **kw),
            analytic_costs(spec, MicroBatchShape(0, b, llm_attn_tokens_sq=0.0, cp=cp), tp, device, **kw),
            analytic_costs(spec, MicroBatchShape(0, b, llm_attn_tokens_sq=BASIS**2, cp=cp), tp, device, **kw))


def stage_coefficients(basis: Sequence[CostTable], layout: PipelineLayout, pp: int, p2p_bytes_per_s: float,
                       recompute_modes: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fwd, bwd, p2p), each (3, pp * V): seconds per stage = [tiles, tokens, sum len^2] @ coefficients.

    bwd includes the recompute extra of ``recompute_modes`` (per-unit "none"/"selective"/"full").  A layout of
    ``pp * V`` stages (interleaved) gives column ``i * V + v`` to rank ``i``'s chunk ``v`` (layout stage
    ``v * pp + i``); V = 1 is one column per stage.
    """
    per = [layout_stage_costs(c, layout, pp, p2p_bytes_per_s, recompute_modes) for c in basis]
    out = []
    for k in range(3):
        tiles, toks, toks_attn = (per[j][k].reshape(-1) for j in range(3))
        out.append(np.stack([tiles / BASIS, toks / BASIS, (toks_attn - toks) / BASIS**2]))
    return tuple(out)


def full_modes(costs: CostTable) -> list[str]:
    """Per-unit mode names of full recompute on every ViT and LLM layer."""
    return ["full" if u.code in LAYER_ROLES else "none" for u in costs.units]


def stage_modes(costs: CostTable, layout: PipelineLayout, stages: Sequence[StageRecompute]) -> list[str]:
    """Per-unit mode names of a per-stage recompute plan on a layout."""
    return [MODE_NAMES[int(m)] for m in unit_modes(costs, layout, stages)]
