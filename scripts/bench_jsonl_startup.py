#!/usr/bin/env python
"""The JSONL data path's startup at scale: time to the first training step, with and without a cached scan.

The trainer scans every record of a meta JSON / JSONL dataset before the first step (each image decoded, JPEGs at
1/8 scale; the text tokenized: ``megatron/vlm/data/records.py``) and keeps the scan in ``--data-cache-dir``
(``scan_cache.py``); a relaunch of the same data reads it back. Per dataset size (``--sizes`` records), two
launches of ``pretrain_vlm.py`` (``--nproc`` data-parallel ranks, default one, which split the scan; the tiny model,
one iteration): ``cold`` with an empty cache folder, ``cached`` with the folder the first one filled. Reported: the
launch's wall time (start to exit after the first step) and the seconds per record of the cold scan.

The records reuse a pool of ``--pool`` image files (``--image-px`` a side, JPEG quality 90), so that a million
records hold little disk: each record names one of them (the scan still decodes one image per record).

    python scripts/bench_jsonl_startup.py --sizes 1000 10000 --json results/bench_jsonl_startup.json
    python scripts/bench_jsonl_startup.py --sizes 1000000 --json results/bench_jsonl_startup.json   # the issue's size
    python scripts/bench_jsonl_startup.py --sizes 1000000 --nproc 8   # 8 ranks split the cold scan
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

BENCH_DATE = "2026-12-04"
WORDS = "the a photo of cat dog street car tree river house red green blue small large left right".split()
MODEL_FLAGS = ["--image-size", "448", "--patch-size", "28", "--max-num-tiles", "4", "--seq-length", "1024",
               "--micro-batch-size", "2", "--train-iters", "1", "--lr-warmup-iters", "0",
               "--eval-interval", "0", "--seed", "3"]


def make_pool(folder: Path, count: int, px: tuple[int, int], seed: int) -> list[str]:
    """``count`` smooth random JPEGs of ``px`` (min, max) px a side; their names relative to ``folder``."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = []
    for i in range(count):
        w, h = (int(x) for x in rng.integers(px[0], px[1] + 1, 2))
        low = rng.integers(0, 256, (int(rng.integers(4, 12)), int(rng.integers(4, 12)), 3), dtype=np.uint8)
        names.append(f"images/{i:04d}.jpg")
        Image.fromarray(low).resize((w, h), Image.Resampling.BICUBIC).save(folder / names[-1], quality=90)
    return names


def make_records(folder: Path, records: int, pool: list[str], seed: int) -> Path:
    """A meta JSON and its JSONL of ``records`` one-image conversations over ``pool``; returns the meta path."""
    rng = np.random.default_rng(seed)
    with open(folder / "train.jsonl", "w") as f:
        for i in range(records):
            question = " ".join(rng.choice(WORDS, int(rng.integers(4, 20))))
            answer = " ".join(rng.choice(WORDS, int(rng.integers(4, 30))))
            f.write(json.dumps({"id": i, "image": pool[i % len(pool)],
                                "conversations": [{"from": "human", "value": f"<image>\n{question}?"},
                                                  {"from": "gpt", "value": f"{answer}."}]}) + "\n")
    meta = folder / "meta.json"
    meta.write_text(json.dumps({"records": {"root": ".", "annotation": "train.jsonl", "length": records}}))
    return meta


def launch(meta: Path, cache: Path, workdir: Path, name: str, timeout: int, nproc: int = 1) -> dict:
    """One trainer launch of one iteration on ``nproc`` ranks (data parallel, so they split the scan): its wall
    seconds, iterations run, and whether it read a cached scan."""
    run = bl.run_trainer(["--data-path", str(meta), "--data-cache-dir", str(cache), *MODEL_FLAGS,
                          "--global-batch-size", str(2 * nproc)], workdir, name, nproc=nproc, timeout=timeout)
    return {"wall_s": run.wall_s, "iterations": len(run.records), "read_cache": "is read from" in run.output}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--pool", type=int, default=64, help="image files the records share")
    ap.add_argument("--image-px", type=int, nargs=2, default=[320, 1920], metavar=("MIN", "MAX"))
    ap.add_argument("--out", default="bench_jsonl_startup_out")
    ap.add_argument("--json")
    ap.add_argument("--timeout", type=int, default=36000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks of each launch (data parallel): the scan is split between them")
    args = ap.parse_args(argv)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    pool = make_pool(out_dir, args.pool, tuple(args.image_px), args.seed)
    rows = []
    for n in args.sizes:
        meta = make_records(out_dir, n, pool, args.seed)
        cache = out_dir / f"cache_{n}"
        shutil.rmtree(cache, ignore_errors=True)
        load = os.getloadavg()[0]
        cold = launch(meta, cache, out_dir, f"cold_{n}", args.timeout, args.nproc)
        cached = launch(meta, cache, out_dir, f"cached_{n}", args.timeout, args.nproc)
        row = {"records": n, "cold_s": cold["wall_s"], "cached_s": cached["wall_s"],
               "cold_read_cache": cold["read_cache"], "cached_read_cache": cached["read_cache"],
               "cold_over_cached": cold["wall_s"] / cached["wall_s"],
               "scan_ms": (cold["wall_s"] - cached["wall_s"]) / n * 1e3, "load_average_1min": load}
        rows.append(row)
        print(bl.format_table([row], COLUMNS), flush=True)
    result = {"date": BENCH_DATE, "pool": args.pool, "image_px": args.image_px, "cpus": os.cpu_count(),
              "nproc": args.nproc,
              "rows": rows}
    if args.json:
        bl.write_json(args.json, result)
    return result


COLUMNS = [("records", "records", "d"), ("cold s", "cold_s", ".1f"), ("cached s", "cached_s", ".1f"),
           ("cold/cached", "cold_over_cached", ".1f"), ("scan ms/record", "scan_ms", ".2f")]


if __name__ == "__main__":
    main()
