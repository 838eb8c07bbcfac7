"""``omnibal memory``: per-stage memory and the adaptive recompute plan of a model, offline.

Costs come from the analytic model for ``--model`` at ``--tiles`` / ``--llm-tokens`` per micro-batch
(calibrated by ``--profile`` when given), or straight from a cost table with ``--costs``.  The
layout is ``--layout``: ``default`` (Megatron: ViT on stage 0, LLM uniform), ``search`` (partition
search with the memory check, then one recompute-aware round), ``joint`` (also the exact joint
optimum of layout and recompute), or an explicit ``--pipeline-layout`` flag such as ``Iv*3|vPEt*4L``.
With ``--recompute-plan FLAG`` that plan is evaluated instead of planned.

Output JSON (``--json``)::

    {"model", "pp", "tp", "dp", "micro_batches", "budget_bytes", "distributed_optimizer", "cost_source",
     "layout": {"flag", "stage_units", "how", "candidates"},
     "recompute": {"flag", "stages", "stage_time_s", "stage_peak_bytes", "stage_static_bytes", "budget_bytes"},
     "stages": [{"stage", "units", "static_bytes", "act_bytes_per_mb", "in_flight", "transient_bytes",
                 "peak_bytes", "time_s", "fits"}],
     "baselines": {"none" | "full": {"flag", "stage_peak_bytes", "stage_time_s"}},
     "error": null or the reason no plan fits (then the full-recompute plan is shown and the exit status is 1)}

All bytes are per GPU; times are seconds per micro-batch (forward + backward + recompute).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import UserError, report
from ..model.cli import build_costs  # lazy: the analytic cost model
from ..model.cli import with_freezing
from ..model.costs import CostTable
from ..model.layout import default_layout, parse_layout
from ..model.trainable import add_freeze_flags
from ..model.units import PRESETS, build_units, get_preset
from .memory_model import GIB, stage_memory
from .recompute import (MemoryBudgetError, evaluate_plan, full_recompute_plan, no_recompute_plan, parse_recompute_plan,
                        plan_layout_and_recompute, plan_recompute, validate_recompute_plan)


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (costs are per TP rank)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="the trainer's --sequence-parallel (TP > 1): activations and TP traffic counted with it")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (shards the distributed optimizer)")
    p.add_argument("--micro-batches", type=int, required=True, help="micro-batches per iteration (1F1B)")
    p.add_argument("--budget-gib", type=float, required=True,
                   help="usable memory per GPU, GiB (leave room for the CUDA context and fragmentation)")
    p.add_argument("--layout", default="default",
                   help="'default', 'search', 'joint' or a --pipeline-layout flag (e.g. 'Iv*3|vPEt*4L')")
    p.add_argument("--recompute-plan", default=None,
                   help="evaluate this plan instead of planning (e.g. 'v2s,t3|t0s'; see omnibal_ext.memory.recompute)")
    p.add_argument("--tiles", type=int, default=9, help="ViT tiles per micro-batch")
    p.add_argument("--llm-tokens", type=int, default=4096, help="LLM tokens per micro-batch")
    p.add_argument("--device", default="a100-80g", help="device preset of the analytic cost model")
    p.add_argument("--profile", default=None, help="measured profile JSON to calibrate the analytic costs with")
    p.add_argument("--costs", default=None, help="a cost table JSON used as is (instead of the analytic model)")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="optimizer state not sharded over DP (18 bytes/parameter instead of 6 + 12/dp)")
    p.add_argument("--no-selective", action="store_true", help="plan with full recompute only")
    p.add_argument("--json", required=True, help="where to write the result JSON")

    add_freeze_flags(p)
    return p


def add_memory_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``memory`` on an ``argparse`` subparsers object; sets ``func``."""
    p = subparsers.add_parser("memory", help="per-stage memory and adaptive recompute plan (offline)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    p.set_defaults(func=run_memory)
    return p


def _costs(args) -> CostTable:
    if args.costs:
        try:
            return with_freezing(args, CostTable.load(args.costs))
        except UserError as e:
            raise UserError(f"--costs {args.costs}: {e}") from None
    return build_costs(args)


def run_memory(args) -> dict:
    for flag, value in (("--pp", args.pp), ("--tp", args.tp), ("--dp", args.dp), ("--micro-batches", args.micro_batches)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if not args.budget_gib > 0:
        raise UserError(f"--budget-gib must be > 0, got {args.budget_gib}")
    spec = get_preset(args.model)
    units = build_units(spec)
    costs = _costs(args)
    if [u.name for u in costs.units] != [u.name for u in units]:
        raise UserError(f"cost table units do not match model {spec.name!r} ({len(costs.units)} vs {len(units)} units)")
    budget = args.budget_gib * GIB
    dist_opt = not args.no_distributed_optimizer
    common = dict(tp=args.tp, dp=args.dp, num_microbatches=args.micro_batches, distributed_optimizer=dist_opt)
    how, candidates, error = args.layout, (), None
    if args.layout in ("search", "joint"):
        if args.recompute_plan:
            raise UserError("--recompute-plan needs a fixed --layout (default or a layout flag)")
        joint = plan_layout_and_recompute(costs, args.pp, budget, method="searched" if args.layout == "search"
                                          else "joint", allow_selective=not args.no_selective, **common)
        layout, plan, how, candidates = joint.layout, joint.recompute, joint.how, joint.candidates
    else:
        layout = (default_layout(spec, args.pp) if args.layout == "default"
                  else parse_layout(args.layout, spec, args.pp, "--layout"))  # LayoutError names --layout
        if args.recompute_plan:
            stages = parse_recompute_plan(args.recompute_plan, args.pp)  # RecomputeFlagError
            validate_recompute_plan(stages, layout, units)
            plan = evaluate_plan(costs, layout, stages, args.pp, budget_bytes=budget, **common)
            how = "given"
        else:
            try:
                plan = plan_recompute(costs, layout, budget, args.pp, allow_selective=not args.no_selective,
                                      **common)
            except MemoryBudgetError as e:  # show the least-memory baseline, then fail
                error = e
                plan = evaluate_plan(costs, layout, full_recompute_plan(layout, units), args.pp,
                                     budget_bytes=budget, **common)
                how = f"{args.layout} (no plan fits; full recompute shown)"
    mem = stage_memory(costs, layout, plan.stages, args.pp, **common)
    baselines = {}
    for name, stages in (("none", no_recompute_plan(layout)), ("full", full_recompute_plan(layout, units))):
        ev = evaluate_plan(costs, layout, stages, args.pp, **common)
        baselines[name] = {"flag": ev.to_flag(), "stage_peak_bytes": list(ev.stage_peak_bytes),
                           "stage_time_s": list(ev.stage_time_s)}
    flags = layout.to_flag(units).split("|")
    out = {
        "model": spec.name, "pp": args.pp, "tp": args.tp, "dp": args.dp, "micro_batches": args.micro_batches,
        "budget_bytes": budget, "distributed_optimizer": dist_opt, "cost_source": costs.source,
        "layout": {"flag": layout.to_flag(units), "stage_units": list(layout.stage_units), "how": how,
                   "candidates": [{"how": h, "stage_units": list(c), "bottleneck_s": b} for h, c, b in candidates]},
        "recompute": plan.to_dict(),
        "stages": [{"stage": s, "units": flags[s], "static_bytes": m.static_bytes,
                    "act_bytes_per_mb": m.act_bytes_per_mb, "in_flight": m.in_flight,
                    "transient_bytes": m.transient_bytes, "peak_bytes": m.peak_bytes,
                    "time_s": plan.stage_time_s[s], "fits": m.peak_bytes <= budget} for s, m in enumerate(mem)],
        "baselines": baselines,
        "error": None if error is None else str(error),
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(format_table(out))
    if error:
        raise error
    return out


def format_table(out: dict) -> str:
    g = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
    lines = [f"{out['model']}  PP={out['pp']} TP={out['tp']} DP={out['dp']} m={out['micro_batches']}  "
             f"budget {out['budget_bytes'] / GIB:.2f} GiB/GPU  costs={out['cost_source']}  "
             f"layout ({out['layout']['how']}): {out['layout']['flag']}",
             f"{'stage':>5} {'static':>8} {'act/mb':>8} {'inflt':>5} {'peak':>8} {'no-rc':>8} {'full-rc':>8} "
             f"{'time s':>8} {'full s':>8}  plan   (GiB; time per micro-batch)"]
    plan_flags = out["recompute"]["flag"].split("|")
    for s, st in enumerate(out["stages"]):
        lines.append(f"{s:>5} {g(st['static_bytes'])} {g(st['act_bytes_per_mb'])} {st['in_flight']:>5} "
                     f"{g(st['peak_bytes'])} {g(out['baselines']['none']['stage_peak_bytes'][s])} "
                     f"{g(out['baselines']['full']['stage_peak_bytes'][s])} {st['time_s']:8.4f} "
                     f"{out['baselines']['full']['stage_time_s'][s]:8.4f}  {plan_flags[s]}"
                     + ("" if st["fits"] else "  OVER BUDGET"))
    full_max = max(out["baselines"]["full"]["stage_time_s"])
    ours = max(out["recompute"]["stage_time_s"])
    lines.append(f"slowest stage {ours:.4f} s/micro-batch vs {full_max:.4f} s with full recompute "
                 f"(speed-up {full_max / ours:.3f}x)   --recompute-plan '{out['recompute']['flag']}'")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run ``memory`` with its flags (no sub-command word)."""
    parser = _configure(argparse.ArgumentParser(prog="omnibal memory", description=__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_memory(parser.parse_args(argv))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(report(e, "omnibal memory: "))
