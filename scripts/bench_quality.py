#!/usr/bin/env python
"""Quality benchmark: does OmniBal change what the model learns, or only how fast?  (The paper's "Model
Performance Preservation".)

The README's default run (``torchrun --nproc-per-node 2 pretrain_vlm.py --pipeline-model-parallel-size 2``:
the ``tiny`` InternVL-style VLM, the built-in digits dataset, 16 samples per iteration) is trained two ways,

=========  ====================================  ===================  =====================================
config     batching                              pipeline layout      recompute
=========  ====================================  ===================  =====================================
baseline   random, 4 samples per micro-batch     Megatron default     full, every layer
omnibal    ISF groups (``--omnibal-isf``)        searched (auto)      planned at a 2 GiB budget (auto)
=========  ====================================  ===================  =====================================

for every seed (``--seeds``) and loss reduction (``--reductions``), each run seeing the same number of
training samples (``--samples``, default 24,000 as the default run's 1500 iterations of 16).  The baseline runs
samples / 16 iterations; an ISF iteration holds 4 groups of varying size, so the ISF run's iterations are
samples / (4 x its mean group size), the mean taken from the trainer's own ISF plan for that seed (a probe run,
``--omnibal-isf --omnibal-profile``, which plans the groups, profiles the units for the layout search and
exits).  The samples each run actually saw are reported (``samples_seen``).

Quality is the validation set's answer accuracy and token-mean loss (the trainer logs both whatever the
reduction) after the last iteration: per configuration the mean, the sample standard deviation over the
seeds (ddof 1) and min..max.  The answer accuracy is teacher-forced (a record is right when every answer token is
the argmax after the reference tokens); beside it, the generation accuracy: each run's final checkpoint is served
(``omnibal serve --load``, PP 2) and asked every answer of the validation set greedily through its OpenAI-compatible
API (``omnibal eval``'s client), each after the record's turns before it; a record is right when every generated
answer equals its reference (exact match) -- what greedy decoding reproduces, so the two agree but for near-ties
and answers that do not stop where the reference does (``--gen-records 0``: no generation).  Verdict per
reduction and metric: OmniBal differs from the baseline beyond seed noise when |mean difference| > 2 standard
errors of that difference, the standard error from the pooled seed standard deviation, s_p sqrt(1/n_a + 1/n_b)
(undetermined with fewer than 2 seeds).

Resumable: each run writes ``runs/NAME.jsonl`` (the trainer's log), ``NAME.out`` and, once done,
``NAME.result.json``; a rerun skips every run whose result file exists (a killed benchmark loses at most the run
in progress).  Outputs in ``--out``: quality.json, quality.md (the table printed on stdout), quality.png
(validation token-mean loss against samples seen and against training time; without matplotlib the
script says so and writes the rest).

Usage: python scripts/bench_quality.py [--out DIR] [--seeds 1 2 3] [--samples 24000] [--reductions token square]
                                       [--gen-records N]
About an hour on 2 CPU cores with the defaults (12 runs); a smoke run: --samples 64 --seeds 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

CONFIGS = ("baseline", "omnibal")
MICRO_BATCH_SIZE = 4  # samples per random micro-batch; ISF's target group size
MICRO_BATCHES = 4  # per iteration (PP=2, DP=1): 16 samples per baseline iteration, 4 ISF groups
MEMORY_BUDGET_GIB = 2.0  # the README's example budget for --omnibal-recompute auto
TIME_KEY = bl.ITER_KEY
ISF_LINE = re.compile(r"> ISF: (\d+) samples -> (\d+) groups")
GEN_MAX_NEW_TOKENS = 16  # the digits answers are at most 3 characters and the end of turn
GEN_BATCH = 32  # requests the server batches, and in flight from the client


def common_flags(seed: int, reduction: str, out: Path, eval_interval: int) -> list[str]:
    return ["--pipeline-model-parallel-size", "2", "--seed", str(seed), "--loss-reduction", reduction,
            "--micro-batch-size", str(MICRO_BATCH_SIZE), "--global-batch-size", str(MICRO_BATCH_SIZE * MICRO_BATCHES),
            "--eval-interval", str(eval_interval), "--data-cache-dir", str(out / "data_cache")]


def isf_probe(seed: int, out: Path) -> dict:
    """The trainer's ISF plan for ``seed`` ({"samples", "groups", "profile"}), from a probe run that plans the
    groups, writes the unit profile the OmniBal runs of this seed reuse, and exits (cached in runs/)."""
    cache = out / "runs" / f"isf_probe_seed{seed}.json"
    profile = out / "runs" / f"profile_seed{seed}.json"
    if cache.exists() and profile.exists():
        return json.loads(cache.read_text())
    flags = common_flags(seed, "token", out, 0) + ["--omnibal-isf", "--omnibal-profile", str(profile)]
    r = bl.run_trainer(flags, out / "runs", f"isf_probe_seed{seed}")
    m = ISF_LINE.search(r.output)
    if m is None:
        raise RuntimeError(f"the ISF probe of seed {seed} printed no '> ISF:' line:\n{r.error_tail()}")
    plan = {"samples": int(m.group(1)), "groups": int(m.group(2)), "profile": str(profile)}
    bl.write_json(cache, plan)
    return plan


def run_flags(config: str, seed: int, reduction: str, samples: int, out: Path, eval_interval: int) -> list[str]:
    """The trainer flags of one run (``samples`` training samples)."""
    flags = common_flags(seed, reduction, out, eval_interval)
    if config == "baseline":
        iters = max(1, round(samples / (MICRO_BATCH_SIZE * MICRO_BATCHES)))
        return flags + ["--train-iters", str(iters), "--recompute-granularity", "full"]
    plan = isf_probe(seed, out)
    mean_group = plan["samples"] / plan["groups"]
    iters = max(1, round(samples / (MICRO_BATCHES * mean_group)))
    return flags + ["--train-iters", str(iters), "--omnibal-isf", "--omnibal-partition", "auto",
                    "--omnibal-recompute", "auto", "--omnibal-memory-budget", repr(MEMORY_BUDGET_GIB),
                    "--omnibal-profile", plan["profile"]]


def run_record(name: str, config: str, seed: int, reduction: str, result: bl.RunResult, log: list[dict]) -> dict:
    """One finished run: its validation curve (after each evaluation: samples seen, training seconds so far,
    token-mean loss, answer accuracy) and its final values."""
    train = [r for r in log if not r.get("prefix")]
    by_iter = {r["iteration"]: r for r in train}
    elapsed = np.cumsum([r[TIME_KEY] / 1e3 for r in train])
    train_s = {r["iteration"]: float(t) for r, t in zip(train, elapsed)}
    curve = [{"iteration": v["iteration"], "samples": by_iter[v["iteration"]]["consumed samples"],
              "train_s": train_s[v["iteration"]], "loss": v["token mean loss"], "acc": v["answer acc"],
              "lm_loss": v["lm loss"], "answers": v["answers"]}
             for v in log if v.get("prefix") == "validation "]
    if not curve:
        raise RuntimeError(f"run {name} logged no validation record")
    return {"name": name, "config": config, "seed": seed, "reduction": reduction, "flags": result.flags,
            "iterations": train[-1]["iteration"], "samples_seen": train[-1]["consumed samples"],
            "train_s": float(elapsed[-1]), "wall_s": result.wall_s, "layout": result.layout_flag,
            "recompute": result.recompute_flag or ("full" if config == "baseline" else None),
            "final_loss": curve[-1]["loss"], "final_acc": curve[-1]["acc"], "curve": curve}


def train_one(config: str, seed: int, reduction: str, samples: int, out: Path, eval_interval: int,
              gen_records: int | None = None) -> dict:
    """Run (or, when its result file exists, reuse) one configuration x seed x reduction; then its generation
    accuracy on ``gen_records`` validation records (None: all; 0: none)."""
    name = f"{config}_{reduction}_seed{seed}_n{samples}"
    done = out / "runs" / f"{name}.result.json"
    if done.exists():
        print(f"  {name}: done before, reused", flush=True)
        return json.loads(done.read_text())
    checkpoint = out / "runs" / f"{name}.ckpt"
    flags = run_flags(config, seed, reduction, samples, out, eval_interval)
    if gen_records != 0:
        flags += ["--save", str(checkpoint), "--save-interval", "0"]
    result = bl.run_trainer(flags, out / "runs", name)
    log = [json.loads(x) for x in (out / "runs" / f"{name}.jsonl").read_text().splitlines()]
    rec = run_record(name, config, seed, reduction, result, log)
    if gen_records != 0:
        rec.update(generation_accuracy(checkpoint, out, name, gen_records))
    bl.write_json(done, rec)
    gen = f", generation acc {rec['final_gen_acc']:.4f}" if "final_gen_acc" in rec else ""
    print(f"  {name}: {rec['samples_seen']} samples, val acc {rec['final_acc']:.4f}{gen}, val token loss "
          f"{rec['final_loss']:.4f}, {rec['train_s']:.0f} s training", flush=True)
    return rec


def validation_task(out: Path) -> Path:
    """The digits validation annotations the runs validate on (``conversations`` records; ``omnibal eval`` reads
    them as they are)."""
    found = sorted((out / "data_cache").glob("*/val.jsonl"))
    if len(found) != 1:
        raise RuntimeError(f"expected one digits build under {out / 'data_cache'}, found {found}")
    return found[0]


def generation_accuracy(checkpoint: Path, out: Path, name: str, records: int | None) -> dict:
    """Serve ``checkpoint`` (PP 2, the default layout) and ask it the first ``records`` validation records (None:
    all) greedily: {"final_gen_acc": records with every answer right / records, "final_gen_answer_acc": right
    answers / answers, "gen_records", "gen_answers"}; each answer's prediction goes to runs/NAME.gen.json."""
    from megatron.vlm.inference.eval_task import read_task
    from megatron.vlm.inference.evaluate import evaluate_with_client, write_report

    task = validation_task(out)
    samples = read_task(str(task), records)
    flags = ["--load", str(checkpoint), "--pipeline-model-parallel-size", "2", "--served-model-name", name,
             "--max-batch-size", str(GEN_BATCH)]
    with bl.serving(flags, out / "runs" / f"{name}.serve") as served:
        report = evaluate_with_client(samples, served.url, str(task), name, GEN_MAX_NEW_TOKENS, GEN_BATCH, "path")
        if served.stop() != [0, 0]:
            raise RuntimeError(f"omnibal serve of {name} did not stop cleanly:\n{served.output()}")
    write_report(report, str(out / "runs" / f"{name}.gen.json"))
    return {"final_gen_acc": report.record_accuracy, "final_gen_answer_acc": report.accuracy,
            "gen_records": report.records, "gen_answers": report.samples}


def spread(values: list[float]) -> dict:
    """mean, sample std (ddof 1; None for one value), min, max."""
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else None,
            "min": float(v.min()), "max": float(v.max())}


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (reduction, config) over its seeds, in the order the records first name them."""
    keys = list(dict.fromkeys((r["reduction"], r["config"]) for r in records))
    rows = []
    for reduction, config in keys:
        runs = sorted((r for r in records if (r["reduction"], r["config"]) == (reduction, config)),
                      key=lambda r: r["seed"])
        rows.append({"reduction": reduction, "config": config, "seeds": [r["seed"] for r in runs],
                     "samples_seen": [r["samples_seen"] for r in runs],
                     "acc": spread([r["final_acc"] for r in runs]), "loss": spread([r["final_loss"] for r in runs]),
                     "gen_acc": (spread([r["final_gen_acc"] for r in runs])
                                 if all("final_gen_acc" in r for r in runs) else None),
                     "train_s": spread([r["train_s"] for r in runs])})
    return rows


def verdict(base: dict, other: dict) -> dict:
    """other - base of one metric's spreads (n seeds each): the difference, the pooled seed std, the standard
    error of the difference and whether |difference| > 2 standard errors (None: fewer than 2 seeds a side)."""
    na, nb = base["n"], other["n"]
    diff = other["mean"] - base["mean"]
    if na < 2 or nb < 2:
        return {"diff": diff, "pooled_std": None, "se": None, "differs": None}
    pooled = math.sqrt(((na - 1) * base["std"] ** 2 + (nb - 1) * other["std"] ** 2) / (na + nb - 2))
    se = pooled * math.sqrt(1 / na + 1 / nb)
    return {"diff": diff, "pooled_std": pooled, "se": se, "differs": bool(abs(diff) > 2 * se)}


def verdicts(rows: list[dict]) -> list[dict]:
    """OmniBal against the baseline per reduction and metric (acc, loss)."""
    out = []
    for reduction in dict.fromkeys(r["reduction"] for r in rows):
        by = {r["config"]: r for r in rows if r["reduction"] == reduction}
        if not set(CONFIGS) <= set(by):
            continue
        for metric in ("acc", "loss"):
            a, b = ({**by[c][metric], "n": len(by[c]["seeds"])} for c in CONFIGS)
            out.append({"reduction": reduction, "metric": metric, **verdict(a, b)})
    return out


def verdict_line(v: dict) -> str:
    name = {"acc": "answer accuracy", "loss": "token-mean loss"}[v["metric"]]
    head = f"{v['reduction']}, validation {name}: omnibal - baseline = {v['diff']:+.4f}"
    if v["differs"] is None:
        return head + ": undetermined (needs >= 2 seeds per configuration)"
    word = "DIFFERS beyond seed noise" if v["differs"] else "within seed noise"
    return (head + f" (pooled seed std {v['pooled_std']:.4f}, 2 standard errors {2 * v['se']:.4f}): {word}")


def _cell(s: dict) -> str:
    std = "-" if s["std"] is None else f"{s['std']:.4f}"
    return f"{s['mean']:.4f} ± {std} ({s['min']:.4f}..{s['max']:.4f})"


def markdown(rows: list[dict], lines: list[str]) -> str:
    out = ["| reduction | config | seeds | samples seen | val answer accuracy (teacher-forced), mean ± std (min..max) "
           "| val generation accuracy, mean ± std (min..max) | val token-mean loss, mean ± std (min..max) | "
           "training s, mean |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seen = sorted(set(r["samples_seen"]))
        gen = "-" if r.get("gen_acc") is None else _cell(r["gen_acc"])
        out.append(f"| {r['reduction']} | {r['config']} | {len(r['seeds'])} | {', '.join(map(str, seen))} | "
                   f"{_cell(r['acc'])} | {gen} | {_cell(r['loss'])} | {r['train_s']['mean']:.0f} |")
    return "\n".join(out + [""] + lines)


def plot(records: list[dict], path: Path) -> Path | None:
    """Validation token-mean loss against samples seen and against training time, one line per run; None
    (and a message) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib==3.11.2, the version setup.py pins): "
              "quality.json and quality.md are written, the plot is not", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"baseline": "tab:blue", "omnibal": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    reductions = list(dict.fromkeys(r["reduction"] for r in records))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in records:
        x = {"samples": [p["samples"] for p in r["curve"]], "train_s": [p["train_s"] for p in r["curve"]]}
        y = [p["loss"] for p in r["curve"]]
        style = styles[reductions.index(r["reduction"]) % len(styles)]
        label = f"{r['config']}, {r['reduction']}" if r["seed"] == min(
            q["seed"] for q in records if (q["config"], q["reduction"]) == (r["config"], r["reduction"])) else None
        for ax, key in zip(axes, ("samples", "train_s")):
            ax.plot(x[key], y, style, color=colors.get(r["config"]), marker=".", alpha=0.8, label=label)
    axes[0].set_xlabel("training samples seen")
    axes[1].set_xlabel("training time, s (iterations only)")
    for ax in axes:
        ax.set_ylabel("validation token-mean loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny VLM on digits, PP=2 on CPU: baseline vs OmniBal (one line per seed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/quality", help="folder for the runs, JSON, table and PNG")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="trainer seeds (init, batching, ISF)")
    ap.add_argument("--samples", type=int, default=24000, help="training samples per run (the default run's 24,000)")
    ap.add_argument("--reductions", nargs="+", choices=["token", "sample", "square"], default=["token", "square"])
    ap.add_argument("--eval-interval", type=int, default=200, help="iterations between validations (and at the end)")
    ap.add_argument("--gen-records", type=int, default=None,
                    help="validation records asked by generation after each run (default: all; 0: no generation)")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.eval_interval < 1 or (args.gen_records is not None and args.gen_records < 0):
        ap.error("--samples and --eval-interval must be >= 1, --gen-records >= 0")
    out = Path(args.out).resolve()
    records = [train_one(config, seed, reduction, args.samples, out, args.eval_interval, args.gen_records)
               for reduction in args.reductions for seed in args.seeds for config in CONFIGS]
    rows = aggregate(records)
    vs = verdicts(rows)
    lines = [verdict_line(v) for v in vs]
    table = markdown(rows, lines)
    print(table)
    res = {"samples": args.samples, "seeds": args.seeds, "reductions": args.reductions,
           "memory_budget_gib": MEMORY_BUDGET_GIB, "rows": rows, "verdicts": vs, "verdict_lines": lines,
           "runs": records}
    bl.write_json(out / "quality.json", res)
    (out / "quality.md").write_text(table + "\n")
    png = plot(records, out / "quality.png")
    print(f"wrote {out / 'quality.json'}, {out / 'quality.md'}" + (f" and {png}" if png else ""))
    return res


if __name__ == "__main__":
    main()
