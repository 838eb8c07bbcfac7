"""Per-unit costs: the numbers the partition search, the simulator and the memory planner read.

They come from a profile (measured on a device) or from the analytic cost model (for models too
large for the machine at hand).  All values are for ONE micro-batch on ONE tensor-parallel rank.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .spec import TEXT_LAYER, VISION_LAYER
from .units import role_of_kind


@dataclass(frozen=True)
class UnitCost:
    name: str  # the unit's stable name (omnibal_ext.model.units)
    kind: str  # the unit's kind
    fwd_s: float  # forward time, seconds
    bwd_s: float  # backward time without recompute, seconds
    act_bytes: float  # activation bytes kept for backward, no recompute
    act_bytes_full: float  # kept under full recompute (the unit's input only)
    act_bytes_selective: float  # kept under selective (core attention) recompute
    selective_recompute_s: float  # extra backward time of selective recompute, seconds
    send_bytes: float  # bytes of the unit's output, sent when a stage boundary follows it
    param_count: int  # parameters of the unit (whole model, before tensor-parallel split)
    code: str | None = None  # the unit's role (layout letter); None: the role of ``kind`` in its family
    frozen: bool = False  # its weights do not train (omnibal_ext.model.trainable): static bytes are the weights only
    lora_params: int = 0  # LoRA adapter parameters (trained; whole model, omnibal_ext.model.lora)
    lora_replicated: int = 0  # of which every TP rank holds whole (a rank: (lora - replicated) / tp + replicated)
    # bytes of the side tensors (DeepStack features) live at the boundary after the unit, sent with its output when
    # a stage boundary follows it and kept by the receiving stage per micro-batch in flight (side_bytes.py)
    side_send_bytes: float = 0.0
    # of param_count, the routed experts' (split over EP x ETP instead of TP; omnibal_ext.model.moe_cost)
    expert_params: int = 0
    expert_split: int = 1  # ranks the routed experts are split over: EP x ETP of the run the table was built for

    def __post_init__(self):
        if self.code is None:
            object.__setattr__(self, "code", role_of_kind(self.kind))


@dataclass(frozen=True)
class UnitArrays:
    """The units' numeric fields as float64 arrays in pipeline order (``frozen``: bool), read-only: what the memory
    model and the recompute planner compute with, built once per table (``CostTable.arrays``)."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    act_bytes: np.ndarray
    act_bytes_full: np.ndarray
    act_bytes_selective: np.ndarray
    selective_recompute_s: np.ndarray
    param_count: np.ndarray
    frozen: np.ndarray
    lora_params: np.ndarray
    lora_replicated: np.ndarray
    expert_params: np.ndarray
    expert_split: np.ndarray
    side_send_bytes: np.ndarray
    block: np.ndarray  # int: 1 a ViT layer, 2 an LLM layer, 0 any other unit (never recomputed)

    @classmethod
    def of(cls, units: tuple[UnitCost, ...]) -> "UnitArrays":
        def column(name: str) -> np.ndarray:
            if name == "block":
                values = np.array([1 if u.code == VISION_LAYER else 2 if u.code == TEXT_LAYER else 0 for u in units])
            else:
                values = np.array([getattr(u, name) for u in units], dtype=bool if name == "frozen" else np.float64)
            values.flags.writeable = False
            return values

        return cls(**{f.name: column(f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class CostTable:
    """Unit costs in pipeline order plus where they came from."""

    units: tuple[UnitCost, ...]
    source: str = "analytic"  # "analytic", "profile", "calibrated"
    meta: dict = field(default_factory=dict)  # device, dtype, shapes, versions

    @functools.cached_property
    def arrays(self) -> UnitArrays:
        """The units' fields as arrays (computed on first use; the table is frozen)."""
        return UnitArrays.of(self.units)

    def to_dict(self) -> dict:
        return {"source": self.source, "meta": self.meta, "units": [dataclasses.asdict(u) for u in self.units]}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        names = {f.name for f in dataclasses.fields(UnitCost)}
        units = []
        for i, u in enumerate(d["units"]):
            missing = names - set(u) - {"code", "frozen", "lora_params", "lora_replicated", "side_send_bytes",
                                        "expert_params", "expert_split"}  # tables written before units carried these
            if missing:
                raise ValueError(f"cost table unit {i} ({u.get('name', '?')}): missing keys {sorted(missing)}")
            units.append(UnitCost(**{k: u[k] for k in names if k in u}))
        return cls(tuple(units), d.get("source", "profile"), d.get("meta", {}))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostTable":
        """Read a cost table or profile JSON; a missing or malformed file raises ``UserError`` naming it."""
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except OSError as e:
            raise UserError(f"{path}: cannot read the cost table/profile: {e.strerror or e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: not a cost table/profile: {e}") from e
