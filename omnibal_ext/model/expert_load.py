"""Measured expert load, planning side: the expert-parallel imbalance of tokens per expert, at any EP size, and where
a profile keeps it (``CostTable.meta["expert_load"]``, written by the trainer's profiler:
``megatron/training/routing_profile.py``).

The tokens per expert of an MoE layer (the routers' counts over one training iteration's micro-batches, every
data-parallel rank's, padding excluded) say the load of every EP size: EP rank r holds the E / EP consecutive experts
r * E / EP ..., so its load is their tokens summed; the layer's imbalance at EP is the busiest rank's load over the
mean rank's (1.0 at EP 1, and for a layer that routed no token). The profile's overall factor at an EP size is the
mean of its MoE layers' (each layer waits for its own busiest rank, so the MoE layers' summed expert time scales
with the mean; the trainer's log prints the largest, ``ep load imbalance``).

``meta["expert_load"]``: {"tokens_per_expert": {layer: [E counts]}, "micro_batches": n,
"ep_imbalance": {ep: {"overall": f, "per_layer": {layer: f}}}} with layers and EP sizes as strings (JSON keys), at
every EP size that divides the experts.
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError


def rank_loads(tokens_per_expert, ep: int) -> np.ndarray:
    """Tokens each of ``ep`` EP ranks' experts run (rank r: the E / EP consecutive experts from r * E / EP)."""
    counts = np.asarray(tokens_per_expert, dtype=np.float64)
    if ep < 1 or counts.size % ep:
        raise UserError(f"EP {ep} does not divide the {counts.size} experts")
    return counts.reshape(ep, -1).sum(axis=1)


def ep_imbalance(tokens_per_expert, ep: int) -> float:
    """The busiest EP rank's tokens over the mean rank's (1.0 when no token was routed)."""
    loads = rank_loads(tokens_per_expert, ep)
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


def expert_load_meta(counts: dict, micro_batches: int) -> dict:
    """The profile's ``expert_load`` (module docstring) from tokens per expert per MoE layer (``counts``: decoder
    layer -> E counts)."""
    if not counts:
        raise UserError("expert load: no MoE layer routed anything (no counts)")
    layers = sorted(int(k) for k in counts)
    tokens = {str(k): [float(x) for x in counts[k]] for k in layers}
    num_experts = len(next(iter(tokens.values())))
    table = {}
    for ep in (e for e in range(1, num_experts + 1) if num_experts % e == 0):
        per_layer = {k: ep_imbalance(c, ep) for k, c in tokens.items()}
        table[str(ep)] = {"overall": float(np.mean(list(per_layer.values()))), "per_layer": per_layer}
    return {"tokens_per_expert": tokens, "micro_batches": int(micro_batches), "ep_imbalance": table}


def measured_imbalance(meta: dict | None, ep: int) -> float | None:
    """The overall imbalance a profile's meta measured at EP ``ep`` (None: none measured, or not at that EP)."""
    load = (meta or {}).get("expert_load")
    if not load:
        return None
    at = load.get("ep_imbalance", {}).get(str(int(ep)))
    return None if at is None else float(at["overall"])


def measured_by_ep(meta: dict | None) -> tuple[tuple[int, float], ...]:
    """(EP, overall imbalance) at every EP size a profile's meta measured, ascending; () when none."""
    load = (meta or {}).get("expert_load") or {}
    return tuple(sorted((int(ep), float(v["overall"])) for ep, v in load.get("ep_imbalance", {}).items()))
