"""``omnibal partition``: plan the pipeline layout of a model offline.

Costs come from the analytic model (``cost_model.analytic_costs``), calibrated by a measured
profile when ``--profile`` is given. Output JSON (``--json``)::

    {"model", "pp", "vpp", "tp", "shape", "device", "cost_source", "search_seconds",
     "layers": [{"name", "kind", "fwd_s", "bwd_s", "act_bytes", "send_bytes"}, ...],   # pipeline order
     "layouts": {"default" | "param_split" | "searched" | "optimal":
                 {"stage_layers": [units per chunk over "layers"], "stage_times_s", "bottleneck_over_mean",
                  "flag", "gap_to_optimum", "stage_send_bytes", "stage_act_bytes", "simulated": {...}}}}

With ``--vpp V`` the layouts hold ``pp * V`` chunk counts (chunk c on stage c % pp) while
``stage_times_s`` has one entry per stage.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import UserError, report
from ..plots import plot_stage_times, plot_timeline
from .cost_model import DEVICES, MicroBatchShape, analytic_costs, calibrated_costs, get_device
from .costs import CostTable
from .partition import plan_partitions
from .simulate import simulate_layout
from .trainable import Freeze, add_freeze_flags
from .units import PRESETS, build_units, get_preset

LAYOUT_NAMES = ("default", "param_split", "searched", "optimal")


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage (interleaved 1F1B)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (costs are per TP rank)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="the trainer's --sequence-parallel (TP > 1): activations and TP traffic counted with it")
    p.add_argument("--tiles", type=int, default=9, help="ViT tiles per micro-batch")
    p.add_argument("--llm-tokens", type=int, default=4096, help="LLM tokens per micro-batch")
    p.add_argument("--device", default="a100-80g", help=f"device preset: {', '.join(DEVICES)}")
    p.add_argument("--profile", default=None, help="measured profile JSON (`omnibal profile`) to calibrate with")
    p.add_argument("--radius", type=int, default=2, help="search radius (units) around the anchor boundaries")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per iteration for the schedule simulation (default 4 * pp)")
    p.add_argument("--json", required=True, help="where to write the plan JSON")
    p.add_argument("--plot", default=None, help="prefix for PNG figures (stage times, timelines)")
    add_freeze_flags(p)
    return p


def add_partition_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``partition`` on an ``argparse`` subparsers object; sets ``func``."""
    p = subparsers.add_parser("partition", help="plan the pipeline layout (offline, from costs)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    p.set_defaults(func=run_partition)
    return p


def build_costs(args) -> CostTable:
    """The unit costs of the flags: analytic (calibrated by --profile), with the frozen units of the freeze flags
    applied (``Trainable.apply``)."""
    return with_freezing(args, _unfrozen_costs(args))


def with_freezing(args, costs: CostTable) -> CostTable:
    """``costs`` with the freeze flags of ``args`` applied (unchanged when none is given)."""
    freeze = Freeze.from_args(args)
    if not freeze.any:
        return costs
    spec = get_preset(args.model)
    return freeze.trainable(build_units(spec), spec.language.tie_word_embeddings, spec).apply(costs)


def _unfrozen_costs(args) -> CostTable:
    spec = get_preset(args.model)
    shape = MicroBatchShape(vision_items=args.tiles, llm_tokens=args.llm_tokens)
    device = get_device(args.device)
    if args.profile:
        try:
            profile = CostTable.load(args.profile)
            return calibrated_costs(spec, shape, profile, tp=args.tp, device=device,
                                    sequence_parallel=getattr(args, "sequence_parallel", False))
        except UserError as e:
            raise UserError(f"--profile {args.profile}: {e}") from None
    return analytic_costs(spec, shape, tp=args.tp, device=device,
                          sequence_parallel=getattr(args, "sequence_parallel", False))


def run_partition(args) -> dict:
    spec = get_preset(args.model)
    costs = build_costs(args)
    device = get_device(args.device)
    reports = plan_partitions(spec, costs, args.pp, vpp=args.vpp, radius=args.radius)
    m = args.microbatches or 4 * args.pp
    if args.vpp > 1 and m % args.pp:
        raise UserError(f"--microbatches {m} must be a multiple of --pp {args.pp} with --vpp > 1")
    sims = {name: simulate_layout(costs, r.layout, args.pp, m, device.p2p_bytes_per_s) for name, r in reports.items()}
    out = {
        "model": spec.name, "pp": args.pp, "vpp": args.vpp, "tp": args.tp,
        "shape": {"tiles": args.tiles, "llm_tokens": args.llm_tokens}, "device": device.name,
        "cost_source": costs.source, "microbatches": m,
        "search_seconds": reports["searched"].search_seconds,
        "layers": [{"name": u.name, "kind": u.kind, "fwd_s": u.fwd_s, "bwd_s": u.bwd_s, "act_bytes": u.act_bytes,
                    "send_bytes": u.send_bytes, "frozen": u.frozen} for u in costs.units],
        "freeze": Freeze.from_args(args).flags(),
        "layouts": {},
    }
    for name in LAYOUT_NAMES:
        d = reports[name].to_dict()
        d["simulated"] = sims[name].to_dict()
        out["layouts"][name] = d
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(format_table(out))
    if args.plot:

        plot_stage_times({n: reports[n].stage_times_s for n in LAYOUT_NAMES}, f"{args.plot}_stage_times.png",
                         title=f"{spec.name} PP={args.pp} VPP={args.vpp}")
        for n in ("default", "searched"):
            plot_timeline(sims[n], f"{args.plot}_timeline_{n}.png", title=f"{n}: iteration {sims[n].iteration_s:.3f} s")
    return out


def format_table(out: dict) -> str:
    lines = [f"{out['model']}  PP={out['pp']} VPP={out['vpp']} TP={out['tp']}  tiles={out['shape']['tiles']} "
             f"llm_tokens={out['shape']['llm_tokens']}  costs={out['cost_source']} ({out['device']})",
             f"{'layout':<12} {'max/mean':>9} {'gap':>7} {'slowest s':>10} {'iter s':>8} {'bubble':>7}  flag"]
    for name, d in out["layouts"].items():
        gap = "" if d["gap_to_optimum"] is None else f"{d['gap_to_optimum']:.1%}"
        lines.append(f"{name:<12} {d['bottleneck_over_mean']:>9.4f} {gap:>7} {d['bottleneck_s']:>10.4f} "
                     f"{d['simulated']['iteration_s']:>8.3f} {d['simulated']['bubble_fraction']:>7.1%}  {d['flag']}")
    lines.append(f"search took {out['search_seconds'] * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run ``partition`` with its flags (no sub-command word), e.g. ``main(["--model", "tiny", ...])``."""
    parser = _configure(argparse.ArgumentParser(prog="omnibal partition", description=__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_partition(parser.parse_args(argv))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(report(e, "omnibal partition: "))
