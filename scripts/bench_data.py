#!/usr/bin/env python
"""Does the data pipeline keep up?  Loader throughput, TP decode strategies, and the trainer's wait for data.

Data: a dataset of conversations records (meta JSON + JSONL, megatron/vlm/data/records.py) of photo-sized JPEGs
made here: smooth random images of 320-1920 px a side (JPEG quality 90), 70% one-image samples, 15%
two-image samples, 15% text-only.

Four measurements, every number from this machine:

=============  ==========================================================================================
loader         in-process MicroBatches of a ViT stage (decodes) and of an LLM-only stage (no decode), K
               samples per micro-batch, --num-workers 0 vs 2: samples/s per loading rank
tp_decode      two gloo processes (a stage's two TP ranks) each needing the same micro-batch: ``broadcast``
               (TP rank 0 decodes, broadcast_micro_batch to the other) vs ``split`` (each decodes half of the
               samples, all_gather_object, both collate) vs ``duplicate`` (each decodes all, the old
               behaviour): ms per micro-batch, the slower rank's
scan           the validation scan that decodes every image before training: in one process, split over
               two gloo processes (each decodes every other record), and read back from the scan cache
trainer        torchrun PP2 (stage 0 ViT + projector + embedding + half the LLM, stage 1 LLM-only), the tiny
               model at --image-size 448 --patch-size 28, --num-workers 0 vs 2: median ms/iteration and
               the "data wait ms" the trainer logs (the slowest rank's time in next(data_iterator) per
               iteration), and its share of the iteration
=============  ==========================================================================================

On a 2-core machine the workers share the cores with the two trainer processes: the gain shown is what
overlap buys there, not what a node with spare cores gets.

Outputs (``--out`` folder): data.json (also ``--json``), the runs' logs, the dataset.

Usage: python scripts/bench_data.py [--out DIR] [--json OUT] [--quick] [--samples N] [--iters N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

sys.path.insert(0, str(bl.ROOT))

IMAGE_SIZE, PATCH_SIZE, MAX_TILES, SEQ = 448, 28, 4, 1024
LAYOUT = "Iv*4PEt*2|t*2L"  # tiny: 4 ViT, 4 LLM layers; stage 1 is LLM-only
WORDS = "the a photo of cat dog street car tree river house red green blue small large left right".split()


# ------------------------------------------------------------------------------------------------ data
def make_dataset(folder: str, num_samples: int, seed: int = 0) -> str:
    """Photo-sized JPEG dataset in InternVL format; returns the meta JSON path."""
    from PIL import Image

    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    meta = os.path.join(folder, "meta.json")
    if os.path.exists(meta):
        return meta
    rng = np.random.default_rng(seed)
    n_img = 0

    def image() -> str:
        nonlocal n_img
        w, h = (int(x) for x in rng.integers(320, 1921, 2))
        low = rng.integers(0, 256, (int(rng.integers(4, 12)), int(rng.integers(4, 12)), 3), dtype=np.uint8)
        im = Image.fromarray(low).resize((w, h), Image.Resampling.BICUBIC)
        noise = rng.integers(-12, 13, (h, w, 3))
        im = Image.fromarray(np.clip(np.asarray(im, np.int16) + noise, 0, 255).astype(np.uint8))
        name = f"images/{n_img:05d}.jpg"
        im.save(os.path.join(folder, name), quality=90)
        n_img += 1
        return name

    def text(lo, hi) -> str:
        return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))

    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for i in range(num_samples):
            u = rng.random()
            rec = {"id": i, "conversations": [{"from": "human", "value": text(4, 20) + "?"},
                                              {"from": "gpt", "value": text(4, 30) + "."}]}
            if u < 0.7:
                rec["image"] = image()
                rec["conversations"][0]["value"] = "<image>\n" + rec["conversations"][0]["value"]
            elif u < 0.85:
                rec["image"] = [image(), image()]
                rec["conversations"][0]["value"] = "<image> <image>\n" + rec["conversations"][0]["value"]
            f.write(json.dumps(rec) + "\n")
    with open(meta, "w") as f:
        json.dump({"photos": {"root": ".", "annotation": "train.jsonl", "length": num_samples}}, f)
    return meta


def spec():
    from omnibal_ext.model.units import get_preset

    s = get_preset("tiny")
    import dataclasses

    return s.replace(vision=dataclasses.replace(s.vision, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE))


def open_dataset(meta: str):
    from megatron.vlm.data import ByteTokenizer, RecordDataset, TileImages

    sp = spec()
    tok = ByteTokenizer()
    return RecordDataset(meta, tok, TileImages(IMAGE_SIZE, sp.tokens_per_tile, MAX_TILES), SEQ), tok


# ------------------------------------------------------------------------------------------------ loader
def loader_rate(ds, tok, workers: int, pixels: bool, batches: int, k: int) -> dict:
    from megatron.vlm.stage.batches import MicroBatches, StageInputs
    from omnibal_ext.data.sampler import GroupBatchSampler, random_groups

    from megatron.vlm.stage.components import units_inputs
    from omnibal_ext.model.spec import HEAD, TEXT_LAYER
    from omnibal_ext.model.units import build_units

    sp = spec()  # without pixels: a stage of LLM layers and the head
    inputs = StageInputs() if pixels else units_inputs(sp, [u for u in build_units(sp) if u.code in (TEXT_LAYER, HEAD)])
    sampler = GroupBatchSampler(random_groups(len(ds), k, seed=0), 1, 0, seed=0)
    mb = MicroBatches(ds, sampler, tok.pad_id, packed=False, inputs=inputs, num_workers=workers)
    next(mb)  # workers started, first batch in
    t0 = time.perf_counter()
    samples = tiles = 0
    for _ in range(batches):
        b = next(mb)
        samples += len(b.samples.sample_tokens)
        tiles += int(b.samples.sample_tiles.sum())
    dt = time.perf_counter() - t0
    del mb
    return {"stage": "ViT (decodes)" if pixels else "LLM-only", "workers": workers, "batches": batches,
            "samples_per_s": samples / dt, "tiles_per_s": tiles / dt, "ms_per_batch": dt / batches * 1e3}


# ------------------------------------------------------------------------------------------------ TP decode
_TP = {}


def _tp_worker(rank: int, port: int, batches: int, k: int, result_path: str):
    import torch
    import torch.distributed as dist

    from megatron.vlm.data.collate import collate_padded
    from megatron.vlm.stage.micro_batch import MicroBatch, broadcast_micro_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ds, tok = _TP["ds"], _TP["tok"]
    rng = np.random.default_rng(1)
    groups = [rng.choice(len(ds), k, replace=False).tolist() for _ in range(batches + 1)]
    out = {}
    for mode in ("broadcast", "split", "duplicate"):
        times = []
        for j, g in enumerate(groups):
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "broadcast":
                batch = MicroBatch.of(collate_padded([ds[i] for i in g], tok.pad_id)) if rank == 0 else None
                batch = broadcast_micro_batch(batch, 0, None)
            elif mode == "split":
                mine = [ds[i] for i in g[rank::2]]
                parts = [None, None]
                dist.all_gather_object(parts, mine)
                samples = [parts[n % 2][n // 2] for n in range(len(g))]
                batch = collate_padded(samples, tok.pad_id)
            else:
                batch = collate_padded([ds[i] for i in g], tok.pad_id)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if j:  # the first is a warm-up
                times.append(float(dt))
        pixels = batch.vision.pixel_values if isinstance(batch, MicroBatch) else batch["pixel_values"]
        out[mode] = {"ms_per_batch": float(np.median(times)) * 1e3, "mb_per_batch": pixels.numel() * 4 / 2**20}
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def tp_decode(ds, tok, batches: int, k: int, workdir: str) -> list[dict]:
    import torch.multiprocessing as mp

    _TP.update(ds=ds, tok=tok)
    path = os.path.join(workdir, "tp_decode.json")
    mp.start_processes(_tp_worker, args=(bl.free_port(), batches, k, path), nprocs=2, start_method="fork")
    with open(path) as f:
        res = json.load(f)
    return [{"mode": m, **v} for m, v in res.items()]


# ------------------------------------------------------------------------------------------------ scan
def _scan_worker(rank: int, port: int, meta: str, result_path: str):
    import torch
    import torch.distributed as dist

    from megatron.vlm.data import ByteTokenizer
    from megatron.vlm.data.records import scan_annotations

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.barrier()
    t0 = time.perf_counter()
    scan_annotations(meta, ByteTokenizer(), _reader_config(), progress=False, group=dist.group.WORLD)
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"s": float(dt)}, f)
    dist.destroy_process_group()


def _reader_config():
    from megatron.vlm.data import ReaderConfig, TileImages

    return ReaderConfig(TileImages(IMAGE_SIZE, spec().tokens_per_tile, MAX_TILES), SEQ)


def scan_times(meta: str, workdir: str) -> list[dict]:
    """The validation scan (every image decoded): one process, split over two gloo processes, read from the
    scan cache (seconds, the slower process's)."""
    import shutil

    import torch.multiprocessing as mp

    from megatron.vlm.data import ByteTokenizer
    from megatron.vlm.data.records import scan_annotations

    cache = os.path.join(workdir, "scan_cache")
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    scan_annotations(meta, ByteTokenizer(), _reader_config(), progress=False, cache_dir=cache)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    scan_annotations(meta, ByteTokenizer(), _reader_config(), progress=False, cache_dir=cache)
    cached = time.perf_counter() - t0
    path = os.path.join(workdir, "scan.json")
    mp.start_processes(_scan_worker, args=(bl.free_port(), meta, path), nprocs=2, start_method="fork")
    with open(path) as f:
        two = json.load(f)["s"]
    return [{"scan": "one process", "s": one}, {"scan": "split over 2 processes", "s": two},
            {"scan": "read from the scan cache", "s": cached}]


# ------------------------------------------------------------------------------------------------ trainer
def trainer_runs(meta: str, iters: int, warmup: int, workdir: str) -> list[dict]:
    rows = []
    base = ["--data-path", meta, "--valid-data-path", meta, "--eval-interval", "0", "--image-size", str(IMAGE_SIZE),
            "--patch-size", str(PATCH_SIZE), "--max-num-tiles", str(MAX_TILES), "--seq-length", str(SEQ),
            "--pipeline-model-parallel-size", "2", "--pipeline-layout", LAYOUT, "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(iters), "--lr-warmup-iters", "0", "--seed", "3"]
    for workers in (0, 2):
        run = bl.run_trainer(base + ["--num-workers", str(workers)], workdir, f"trainer_w{workers}", nproc=2,
                             timeout=1800)
        st = bl.steady(run.records, warmup)
        ms = float(np.median([r[bl.ITER_KEY] for r in st]))
        wait = float(np.median([r["data wait ms"] for r in st]))
        rows.append({"workers": workers, "iterations": len(run.records), "ms_per_iter": ms, "data_wait_ms": wait,
                     "data_wait_share": wait / ms, "samples_per_s": 8e3 / ms,
                     "losses": [r["lm loss"] for r in run.records], "wall_s": run.wall_s})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_data_out")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline and the JSON, not speed")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="trainer iterations per run")
    p.add_argument("--batches", type=int, default=None, help="loader micro-batches timed per row")
    args = p.parse_args(argv)
    n = args.samples or (24 if args.quick else 160)
    iters = args.iters or (3 if args.quick else 10)
    batches = args.batches or (3 if args.quick else 16)
    warmup = 1 if args.quick else 2
    k = 4
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    meta = make_dataset(os.path.join(args.out, f"photos_{n}"), n)
    ds, tok = open_dataset(meta)
    _, tiles = ds.sample_lengths()
    loader = [loader_rate(ds, tok, w, pixels, batches, k) for pixels in (True, False) for w in (0, 2)]
    tp = tp_decode(ds, tok, max(2, batches // 2), k, args.out)
    scan = scan_times(meta, args.out)
    trainer = trainer_runs(meta, iters, warmup, args.out)
    result = {"config": {"samples": n, "images": int(len(ds.scan.img_width)), "mean_tiles_per_sample": float(tiles.mean()),
                         "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "max_num_tiles": MAX_TILES,
                         "samples_per_microbatch": k, "layout": LAYOUT, "quick": args.quick,
                         "cpus": os.cpu_count()},
              "loader": loader, "tp_decode": tp, "scan": scan, "trainer": trainer, "wall_s": time.perf_counter() - t0}
    print(f"\nloader, one rank, {k} samples per micro-batch ({result['config']['mean_tiles_per_sample']:.2f} tiles "
          f"of {IMAGE_SIZE} px per sample)")
    print(bl.format_table(loader, [("stage", "stage", ""), ("workers", "workers", "d"),
                                   ("samples/s", "samples_per_s", ".1f"), ("tiles/s", "tiles_per_s", ".1f"),
                                   ("ms/batch", "ms_per_batch", ".1f")]))
    print("\nTP=2: the same micro-batch on both TP ranks (ms, the slower rank)")
    print(bl.format_table(tp, [("mode", "mode", ""), ("ms/batch", "ms_per_batch", ".1f"),
                               ("pixels MiB", "mb_per_batch", ".1f")]))
    print(f"\nvalidation scan of the {n} samples ({result['config']['images']} images decoded), seconds")
    print(bl.format_table(scan, [("scan", "scan", ""), ("s", "s", ".2f")]))
    print(f"\ntrainer PP2 ({LAYOUT}), 8 samples per iteration, median of steady iterations")
    print(bl.format_table(trainer, [("workers", "workers", "d"), ("ms/iter", "ms_per_iter", ".1f"),
                                    ("data wait ms", "data_wait_ms", ".1f"), ("wait share", "data_wait_share", ".3f"),
                                    ("samples/s", "samples_per_s", ".2f")]))
    bl.write_json(os.path.join(args.out, "data.json"), result)
    if args.json:
        bl.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
