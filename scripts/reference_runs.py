"""Fixed reference runs of the trainer: each run's per-iteration loss and gradient norm, to show a refactor keeps
the numbers bit-identical.

    python scripts/reference_runs.py --out /tmp/now.json                     # record
    python scripts/reference_runs.py --out /tmp/now.json --compare old.json  # record, then report the first difference
    python scripts/reference_runs.py --compare-only old.json new.json        # compare two records

The runs (a few iterations each, 2 ranks; the tiny Hugging Face folders are the tests' own, written from fixed seeds):

* ``builtin_pp2``, ``builtin_tp2``: the built-in tiny VLM on its synthetic data at PP2 and at TP2;
* ``builtin_pp2_omnibal``: PP2 with ``--omnibal-isf --omnibal-partition auto --omnibal-recompute auto`` from the
  pinned profile ``tests/data/reference_profile.json`` (a profile measured at launch depends on timing; write it once
  with ``--write-profile``);
* ``builtin_moe_ep2``: the built-in model with MoE layers at EP2;
* ``qwen3_vl_pp2``: a tiny Qwen3-VL (DeepStack) fine-tuned from ``--hf-checkpoint`` at PP2;
* ``qwen3_5_pp2``: a tiny Qwen3.5 (Gated DeltaNet) fine-tuned from ``--hf-checkpoint`` at PP2.

Besides the numbers each record keeps the pipeline layout and recompute plan that the run printed, so a changed plan
shows even where it happens to give the same losses. Equality is exact (floats as JSON writes them: repr).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import benchlib  # noqa: E402

PROFILE = ROOT / "tests" / "data" / "reference_profile.json"
ITERS = ["--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0",
         "--log-interval", "1", "--eval-interval", "0"]
BUILTIN = ITERS + ["--lr", "2e-3", "--seed", "7"]
PP2 = ["--pipeline-model-parallel-size", "2"]
OMNIBAL = PP2 + ["--omnibal-isf", "--omnibal-partition", "auto", "--omnibal-recompute", "auto",
                 "--omnibal-memory-budget", "0.0084"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-layer-freq", "[1,0,1,1]",
       "--moe-aux-loss-coeff", "0.01", "--expert-model-parallel-size", "2"]
KEYS = ("lm loss", "grad norm")


def hf_flags(kind: str, folder: Path, data_cache: Path) -> list[str]:
    """Flags of a fine-tune of the tests' tiny HF ``kind`` ("qwen3_vl" or "qwen3_5") written under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3_vl":
        import hf_tiny_qwen3_vl

        hf_tiny_qwen3_vl.make_tiny_with_tokenizer(folder / "hf", seed=3)
        return ["--hf-checkpoint", str(folder / "hf"), "--data-path", hf_tiny_qwen3_vl.write_messages_data(folder),
                "--seq-length", "256", "--data-cache-dir", str(data_cache)]
    import hf_tiny_qwen3_5

    return hf_tiny_qwen3_5.training_flags(folder, data_cache, seed=3)


def runs(work: Path, data_cache: Path) -> dict[str, list[str]]:
    """Each reference run's flags by name (2 ranks each)."""
    data = ["--data-cache-dir", str(data_cache)]
    return {
        "builtin_pp2": BUILTIN + data + PP2,
        "builtin_tp2": BUILTIN + data + ["--tensor-model-parallel-size", "2"],
        "builtin_pp2_omnibal": BUILTIN + data + OMNIBAL + ["--omnibal-profile", str(PROFILE)],
        "builtin_moe_ep2": BUILTIN + data + MOE,
        "qwen3_vl_pp2": ITERS + ["--lr", "3e-3", "--seed", "5"] + hf_flags("qwen3_vl", work / "qwen3_vl", data_cache)
        + PP2,
        "qwen3_5_pp2": ITERS + ["--lr", "3e-3", "--seed", "5"] + hf_flags("qwen3_5", work / "qwen3_5", data_cache)
        + PP2,
    }


def record(run: benchlib.RunResult) -> dict:
    """What a reference run keeps: its iterations' numbers, its layout and recompute lines."""
    if not run.ok:
        raise SystemExit(f"{run.name} failed ({run.returncode}):\n{run.error_tail(4000)}")
    layout = re.search(r"layout (\S+?),", run.output)
    recompute = re.search(r"> omnibal recompute: plan (\S+)", run.output)
    return {"iterations": [{"iteration": r["iteration"], **{k: r[k] for k in KEYS}} for r in run.records],
            "layout": layout.group(1) if layout else None, "recompute": recompute.group(1) if recompute else None}


def first_difference(old: dict, new: dict) -> str | None:
    """The first difference between two records of reference runs (by run, then iteration and key), or None."""
    for name in old:
        if name not in new:
            return f"{name}: missing from the new record"
        a, b = old[name], new[name]
        for key in ("layout", "recompute"):
            if a[key] != b[key]:
                return f"{name}: {key} {a[key]!r} -> {b[key]!r}"
        if len(a["iterations"]) != len(b["iterations"]):
            return f"{name}: {len(a['iterations'])} iterations -> {len(b['iterations'])}"
        for x, y in zip(a["iterations"], b["iterations"]):
            for key in KEYS:
                if x[key] != y[key]:
                    return f"{name}: iteration {x['iteration']} {key} {x[key]!r} -> {y[key]!r}"
    extra = sorted(set(new) - set(old))
    return f"new runs not in the old record: {extra}" if extra else None


def compare(old_path: str, new: dict) -> int:
    diff = first_difference(json.loads(Path(old_path).read_text()), new)
    print(f"reference runs: {'identical to ' + old_path if diff is None else 'FIRST DIFFERENCE ' + diff}")
    return 0 if diff is None else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON to write the record to")
    p.add_argument("--compare", help="an earlier record: report the first difference (exit 1 if any)")
    p.add_argument("--compare-only", nargs=2, metavar=("OLD", "NEW"), help="compare two records, run nothing")
    p.add_argument("--only", nargs="*", help="run only these runs")
    p.add_argument("--write-profile", action="store_true",
                   help=f"measure and write the pinned profile {PROFILE.relative_to(ROOT)} first (once)")
    a = p.parse_args(argv)
    if a.compare_only:
        return compare(a.compare_only[0], json.loads(Path(a.compare_only[1]).read_text()))
    if not a.out:
        p.error("--out is required unless --compare-only")
    with tempfile.TemporaryDirectory(prefix="reference_runs_") as tmp:
        work = Path(tmp)
        data_cache = work / "data_cache"
        if a.write_profile:
            PROFILE.unlink(missing_ok=True)
            flags = BUILTIN + ["--data-cache-dir", str(data_cache)] + OMNIBAL + ["--omnibal-profile", str(PROFILE)]
            record(benchlib.run_trainer(flags, work, "profile", nproc=2, check=False))
        elif not PROFILE.exists():
            raise SystemExit(f"{PROFILE} is missing: write it once with --write-profile")
        result = {}
        for name, flags in runs(work, data_cache).items():
            if a.only and name not in a.only:
                continue
            result[name] = record(benchlib.run_trainer(flags, work, name, nproc=2, check=False))
            print(f"{name}: " + ", ".join(f"{r['lm loss']:.6f}/{r['grad norm']:.6f}" for r in result[name]["iterations"])
                  + f" layout {result[name]['layout']} recompute {result[name]['recompute']}", flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return compare(a.compare, result) if a.compare else 0


if __name__ == "__main__":
    sys.exit(main())
