"""Memory level: per-stage memory (static + activations) and the adaptive recompute planner.

Tensor-free: reads CostTables and layouts, returns frozen dataclasses that serialise to JSON.
"""
from .memory_model import MIXED_BF16_ADAM, Precision, StageMemory, in_flight_1f1b, stage_memory
from .recompute import (
    MemoryBudgetError,
    RecomputePlan,
    StageRecompute,
    evaluate_plan,
    format_recompute_plan,
    full_recompute_plan,
    no_recompute_plan,
    joint_optimal_layout,
    parse_recompute_plan,
    plan_layout_and_recompute,
    plan_recompute,
)

__all__ = [
    "MIXED_BF16_ADAM", "Precision", "StageMemory", "in_flight_1f1b", "stage_memory", "MemoryBudgetError",
    "RecomputePlan", "StageRecompute", "format_recompute_plan", "full_recompute_plan", "no_recompute_plan",
    "parse_recompute_plan", "plan_recompute", "evaluate_plan", "joint_optimal_layout", "plan_layout_and_recompute",
]
