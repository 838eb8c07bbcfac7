"""The plan as text (``omnibal plan``'s report) and as figures."""
from __future__ import annotations

from ..memory.memory_model import GIB
from ..plots import plot_stage_times, plot_timeline
from .results import Plan


def format_plan(plan: Plan) -> str:
    """The plain-text report ``omnibal plan`` prints."""
    g = lambda b: b / GIB  # noqa: E731
    p = plan.isf["params"]
    lines = [
        f"{plan.model} on {plan.gpus} x {plan.device} ({plan.gpu_memory_bytes / GIB:.0f} GiB, budget "
        f"{g(plan.budget_bytes):.1f} GiB/GPU): TP={plan.tp} PP={plan.pp} "
        f"{f'CP={plan.cp} ' if plan.cp > 1 else ''}{f'EP={plan.ep} ETP={plan.etp} ' if plan.moe else ''}DP={plan.dp}"
        f"{f' V={plan.vpp} (interleaved)' if plan.vpp > 1 else ''}, "
        f"{plan.num_microbatches} micro-batches x {plan.samples_per_group} samples, global batch "
        f"{plan.global_batch_size}, {plan.samples} samples per epoch",
        f"ISF: Qv={p['qv']} Qt={p['qt']} Q'v={p['qv_min']} Q't={p['qt_min']} T={p['iters']}; "
        f"{plan.isf['groups']} groups of {plan.isf['samples_per_group']:.2f} samples; "
        f"DistRatio llm {plan.isf['metrics']['dist_ratio_llm']:.4f} vit {plan.isf['metrics']['dist_ratio_vit']:.4f} "
        f"(random: PadRatio {plan.random['pad_ratio']:.3f}, DistRatio llm {plan.random['dist_ratio_llm']:.3f} "
        f"vit {plan.random['dist_ratio_vit']:.3f})",
        *([time_line(plan)] if "dist_ratio_time" in plan.isf["metrics"] else []),
        "",
        f"{'setting':<9} {'batch':<6} {'slowest s':>9} {'peak GiB':>8} {'fits':>4} {'iter s':>8} {'straggle':>8} "
        f"{'bubble':>6} {'tokens/s':>9} {'GPU-days':>9} {'speed-up':>8}",
    ]
    for r in plan.rows:
        lines.append(
            f"{r.setting:<9} {r.batching:<6} {max(r.stage_time_s):9.3f} {g(max(r.stage_peak_bytes)):8.1f} "
            f"{'yes' if r.fits_memory else 'NO':>4} {r.iteration_s:8.2f} {r.iteration_s / r.balanced_iteration_s:8.3f} "
            f"{r.bubble_fraction:6.1%} {r.tokens_per_s:9.0f} {r.gpu_days:9.2f} {r.speedup:7.2f}x")
    lines.append("")
    for r in plan.rows:
        lines.append(f"{r.setting:<9} layout ({r.how}): {r.layout_flag}   recompute: {r.recompute_flag}")
    final = plan.row("+memory")
    if any(final.boundary_side_bytes):
        lines.append("+memory side tensors (DeepStack features) sent with the hidden states per boundary, MiB per "
                     "micro-batch at the ISF caps: " + " | ".join(f"{b / 2**20:.2f}" for b in final.boundary_side_bytes))
    lines.append("")
    base, final = plan.row("baseline"), plan.row("+memory")
    lines.append(f"{'stage':>5} {'default s':>9} {'GiB':>6} {'+memory s':>9} {'GiB':>6}  recompute"
                 f"{' (per chunk)' if final.vpp > 1 else ''}")
    rc = final.recompute_flag.split("|")
    for s in range(plan.pp):
        chunks = ",".join(rc[c * plan.pp + s] for c in range(final.vpp))  # rank s runs layout stages s, s + pp, ...
        lines.append(f"{s:>5} {plan.row('+data').stage_time_s[s]:9.3f} {g(plan.row('+data').stage_peak_bytes[s]):6.1f} "
                     f"{final.stage_time_s[s]:9.3f} {g(final.stage_peak_bytes[s]):6.1f}  {chunks}")
    lines.append(f"(stage seconds per mean ISF micro-batch; baseline mean padded micro-batch: slowest stage "
                 f"{max(base.stage_time_s):.3f} s)")
    lines.append("")
    lines += serving_lines(plan)
    lines.append("trainer: pretrain_vlm.py " + plan.trainer_args)
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def serving_lines(plan: Plan) -> list[str]:
    """What each layout serves at (generation's decode, analytic: ``omnibal_ext.model.decode_cost``)."""
    if not plan.serving:
        return []
    first = plan.serving[0]
    lines = [f"serving (generation on the layout, TP={plan.tp}; decode {first['context']:.0f} cached tokens per "
             f"sequence, prompt = the mean sample):"]
    for r in plan.serving:
        lines.append(f"  {r['setting']:<9} {r['layout']:<24} batch {r['batch']:>4}: {r['tokens_per_s']:10.1f} tokens/s, "
                     f"{r['ms_per_token']:7.2f} ms/token, first token {r.get('ttft_ms', float('nan')):7.1f} ms "
                     f"({r['groups']} group(s) in flight)")
    lines.append("")
    return lines


def time_line(plan: Plan) -> str:
    """The ISF line of a plan grouped in predicted time: its time thresholds and DistRatio in time vs random's."""
    p, m, r = plan.isf["params"], plan.isf["metrics"], plan.random
    return (f"ISF in predicted time: ViT {p['vit_time'] / 1e6:.3f} ms (min {p['vit_time_min'] / 1e6:.3f}), LLM "
            f"{p['llm_time'] / 1e6:.3f} ms (min {p['llm_time_min'] / 1e6:.3f}) per group; DistRatio in time llm "
            f"{m['dist_ratio_llm_time']:.4f} vit {m['dist_ratio_vit_time']:.4f} total {m['dist_ratio_time']:.4f} "
            f"(random: llm {r['dist_ratio_llm_time']:.3f} vit {r['dist_ratio_vit_time']:.3f} total "
            f"{r['dist_ratio_time']:.3f})")


def plot_plan(plan: Plan, prefix: str) -> list[str]:
    """PREFIX_stages.png (stage times, default vs balanced) and PREFIX_timeline.png (+memory pipeline)."""

    bars = {"+data (default layout)": plan.stage_time_bars["+data"], "+model": plan.stage_time_bars["+model"],
            "+memory": plan.stage_time_bars["+memory"]}
    out = [plot_stage_times(bars, f"{prefix}_stages.png",
                            title=f"{plan.model} TP={plan.tp} PP={plan.pp}: stage time per mean ISF micro-batch")]
    tl = plan.timelines.get("+memory")
    if tl is not None:
        out.append(plot_timeline(tl, f"{prefix}_timeline.png",
                                 title=f"+memory: slowest DP rank, iteration {tl.iteration_s:.2f} s, "
                                       f"bubble {tl.bubble_fraction:.1%}"))
    return out
