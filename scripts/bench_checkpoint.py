#!/usr/bin/env python
"""Benchmark of checkpoint save/load (issue #12): our megatron-core ``torch_dist`` checkpoints
(megatron/training/checkpointing/: DCP shards, checksum manifest, atomic rename, verified load) against
today's baseline, one ``torch.save`` per rank of the rank's state dicts (:func:`baseline_save` /
:func:`baseline_load`).

Cases (CPU, fp32, model + Adam state, built in-process by the trainer's own functions,
training.build_model / build_optimizer, inside cpu_compat.patched()):

- ``tiny``: the whole tiny preset (PP = the world size: PP1 for one process, the default PP2 layout
  under ``--nproc 2``);
- ``6b20b``: preset internvl-6b-20b cut to 1 InternViT-6B layer (hidden 3200, 25 heads, MLP 12800) and
  1 InternLM2-20B layer (hidden 6144, 48 heads, 8 KV heads, MLP 16384) at their real widths, with the
  vocabulary cut to ``--vocab`` rows (the real 92544-row embedding + head would be 1.1 B parameters and
  dominate); the ViT embedding and the projector stay at their real sizes and are counted apart
  (``params``: per unit kind).  It needs ~18 GiB (fp32 weights, gradient buffer, Adam moments, and the
  load's copy); a case that does not fit the available memory is skipped and reported so;
- ``6b-vit``: the InternViT-6B layer alone at its real width (LLM at the tiny widths), ~3.6 GiB.

Both formats are measured side by side, alternating within each repeat (the machine is noisy); the
tables give medians over ``--repeats`` timed rounds after one untimed warm-up round (``--quick``: one
round, no warm-up).  Our save is split into building the sharded state dict, megatron-core's
``dist_checkpointing.save`` and the checksum manifest (the rest: mkdir/rmtree, fsync, renames, tracker); our
load into ``find_checkpoint`` (the verification: manifest, sizes and the XXH3 checksum of every file) and
``load_checkpoint``.  The first save of the process (megatron-core's one-time set-up) is reported apart.
Loads read files just written, from the page cache, in both formats alike.

    python scripts/bench_checkpoint.py [--quick] [--json out.json] [--cases tiny 6b20b] [--repeats 3]
    python scripts/bench_checkpoint.py --nproc 2 ...   # relaunches itself under torchrun, per-rank rows
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import shutil
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

SAVE_TARGET = 1.5  # issue #12: our save may cost at most 1.5x today's


# ------------------------------------------------------------------------------------------------
# Today's baseline: one torch.save per rank
# ------------------------------------------------------------------------------------------------
def baseline_path(root: str, rank: int) -> str:
    return os.path.join(root, f"mp_rank_{rank:03d}", "model_optim_rng.pt")


def baseline_save(root: str, rank: int, iteration: int, model, optimizer, scheduler, rng: dict) -> str:
    """The previous format: this rank's {model, optimizer, scheduler, rng, iteration} in one torch.save."""
    path = baseline_path(root, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"iteration": iteration, "model": model[0].state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": rng}, path)
    return path


def baseline_load(root: str, rank: int, model, optimizer, scheduler) -> dict:
    """Its load: torch.load of the rank's file, then the state dicts into the model, optimizer, scheduler."""
    sd = torch.load(baseline_path(root, rank), map_location="cpu", weights_only=False)
    model[0].load_state_dict(sd["model"])
    optimizer.load_state_dict(sd["optimizer"])
    scheduler.load_state_dict(sd["scheduler"])
    return {"iteration": sd["iteration"]}


# ------------------------------------------------------------------------------------------------
# Building the model and optimizer through the trainer's functions
# ------------------------------------------------------------------------------------------------
CASES = {
    "tiny": ["--model", "tiny"],
    "6b20b": ["--model", "internvl-6b-20b", "--vision-num-layers", "1", "--num-layers", "1"],
    # the InternViT-6B layer alone at its real width (the LLM cut to the tiny preset's widths): ~1/4 of
    # 6b20b's memory, for a machine that cannot hold 6b20b (~18 GiB with the load's copy)
    "6b-vit": ["--model", "internvl-6b-20b", "--vision-num-layers", "1", "--num-layers", "1", "--hidden-size", "64",
               "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "192"],
}


class _DataStub:
    """What save_checkpoint asks of the training data: its position."""

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 0, "seed": 1234}


@dataclasses.dataclass
class Built:
    plan: object  # megatron.training.run_plan.RunPlan
    model: list
    optimizer: object
    scheduler: object


def build(case: str, vocab: int, distributed_optimizer: bool, world: int) -> Built:
    from megatron.training import setup, training
    from megatron.training.arguments import parse_config
    flags = ["--device", "cpu", *CASES[case], "--pipeline-model-parallel-size", str(world)]
    if distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    config = parse_config(flags, world)
    spec = config.model.spec
    if case != "tiny":
        spec = spec.replace(language=dataclasses.replace(spec.language, vocab_size=vocab, real_vocab_size=None))
    plan = setup.build_run_plan(config, spec, torch.device("cpu"))
    model = training.build_model(plan, 5, torch.device("cpu"))
    optimizer, scheduler = training.build_optimizer(plan, model)
    # Adam's state exists after a first step (zero gradients: the moments stay zero, the step count is 1)
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()
    scheduler.step(increment=config.optim.global_batch_size)
    return Built(plan, model, optimizer, scheduler)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
class _Split:
    """Seconds spent in wrapped functions of the checkpointing package during one call (its files are not
    changed: module attributes are wrapped while the benchmark runs)."""

    def __init__(self):
        self.s: dict = {}

    @contextlib.contextmanager
    def wrapped(self, module, name: str, label: str):
        orig = getattr(module, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.s[label] = self.s.get(label, 0.0) + time.perf_counter() - t0

        setattr(module, name, timed)
        try:
            yield
        finally:
            setattr(module, name, orig)


def _barrier():
    import torch.distributed as dist

    dist.barrier()


def _dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def _ours_rank_bytes(folder: str, world: int) -> list[int]:
    """Bytes per rank: ``__<rank>_<n>.distcp`` to its writer, everything else (metadata, common state,
    manifest) to rank 0."""
    out = [0] * world
    for d, _, fs in os.walk(folder):
        for f in fs:
            size = os.path.getsize(os.path.join(d, f))
            r = int(f[2:].split("_")[0]) if f.startswith("__") and f.endswith(".distcp") else 0
            out[r if r < world else 0] += size
    return out


def ours_save(b: Built, root: str, iteration: int) -> dict:
    from megatron.training import checkpointing as ck
    from megatron.training.checkpointing import save as ck_save

    split = _Split()
    config = b.plan.config
    plan = dataclasses.replace(b.plan, config=dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint, save=root)))
    _barrier()
    t0 = time.perf_counter()
    # dist save: PyTorch DCP's planning, the write of this rank's file and its fsync, the metadata
    with split.wrapped(ck_save, "sharded_state_dict", "state_dict_s"), \
            split.wrapped(ck_save.dist_checkpointing, "save", "dist_save_s"), \
            split.wrapped(ck_save, "hash_files", "manifest_s"):
        ck.save_checkpoint(plan, iteration, 0, b.model, b.optimizer, b.scheduler, _DataStub())
    total = time.perf_counter() - t0
    outer = sum(v for k, v in split.s.items() if k in ("state_dict_s", "dist_save_s", "manifest_s"))
    return {"save_s": total, **split.s, "other_s": total - outer}


def ours_load(b: Built, root: str) -> dict:
    from megatron.training import checkpointing as ck

    _barrier()
    t0 = time.perf_counter()
    ckpt = ck.find_checkpoint(root)
    t1 = time.perf_counter()
    ck.load_checkpoint(ckpt, b.plan, b.model, b.optimizer, b.scheduler)
    t2 = time.perf_counter()
    gc.collect()
    return {"load_s": t2 - t0, "verify_s": t1 - t0, "restore_s": t2 - t1}


def base_save(b: Built, root: str, iteration: int, rank: int) -> dict:
    from megatron.training.checkpointing import rng_state

    _barrier()
    t0 = time.perf_counter()
    path = baseline_save(root, rank, iteration, b.model, b.optimizer, b.scheduler, rng_state())
    t1 = time.perf_counter()
    # not part of today's save (torch.save does not fsync): what an fsync of the file would add
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return {"save_s": t1 - t0, "fsync_s": time.perf_counter() - t1}


def base_load(b: Built, root: str, rank: int) -> dict:
    _barrier()
    t0 = time.perf_counter()
    baseline_load(root, rank, b.model, b.optimizer, b.scheduler)
    t = time.perf_counter() - t0
    gc.collect()
    return {"load_s": t}


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split()[1] for line in f}
        return int(info["MemAvailable"]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if key in r]
    return float(np.median(vals)) if vals else None


def run_case(case: str, opt_kind: str, a, work: str) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    params = sum(_params(case, a.vocab).values())
    # fp32: weights, DDP gradient buffer, Adam's two moments resident; a load holds one more copy of the
    # weights and moments while it copies them in (both formats)
    need = params * 4 * (4 + 3) * 1.1
    avail = _available_bytes()
    if avail is not None and need > avail:
        msg = f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
        if rank == 0:
            print(f"  {case}/{opt_kind}: skipped ({msg})", flush=True)
        return {"case": case, "optimizer": "distributed" if opt_kind == "distributed" else "adam", "world": world,
                "skipped": msg}
    t0 = time.perf_counter()
    b = build(case, a.vocab, opt_kind == "distributed", world)
    build_s = time.perf_counter() - t0
    ours_root, base_root = os.path.join(work, f"{case}_{opt_kind}_ours"), os.path.join(work, f"{case}_{opt_kind}_base")
    rows = {"ours_save": [], "ours_load": [], "base_save": [], "base_load": []}
    first_save = None
    bytes_ours = bytes_base = None
    warmup = 0 if a.quick else a.warmup
    rounds = a.repeats + warmup
    for rep in range(rounds):
        timed = rep >= warmup
        order = ("ours", "base") if rep % 2 == 0 else ("base", "ours")
        for fmt in order:
            if fmt == "ours":
                s = ours_save(b, ours_root, rep + 1)
                if first_save is None:
                    first_save = s
                folder = os.path.join(ours_root, f"iter_{rep + 1:07d}")
                _barrier()
                bytes_ours = _ours_rank_bytes(folder, world)
                l_ = ours_load(b, ours_root)
                _barrier()
                if rank == 0:
                    shutil.rmtree(ours_root, ignore_errors=True)
            else:
                s = base_save(b, base_root, rep + 1, rank)
                _barrier()
                bytes_base = [os.path.getsize(baseline_path(base_root, r)) for r in range(world)]
                l_ = base_load(b, base_root, rank)
                _barrier()
                if rank == 0:
                    shutil.rmtree(base_root, ignore_errors=True)
            if timed:
                rows[f"{fmt}_save"].append(s)
                rows[f"{fmt}_load"].append(l_)
            if rank == 0:
                print(f"  {case}/{opt_kind} round {rep}{'' if timed else ' (warm-up)'} {fmt}: save {s['save_s']:.3f} s, "
                      f"load {l_['load_s']:.3f} s", flush=True)
    mine = {f"{k}_{kk}": _median(v, kk) for k, v in rows.items() for kk in (v[0].keys() if v else [])}
    mine["first_save_s"] = first_save["save_s"]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    del b
    gc.collect()
    out = {"case": case, "optimizer": "distributed" if opt_kind == "distributed" else "adam",
           "world": world, "repeats": a.repeats, "warmup_rounds": warmup, "build_s": build_s,
           "per_rank": everyone, "bytes_ours_per_rank": bytes_ours, "bytes_base_per_rank": bytes_base,
           "bytes_ours": sum(bytes_ours), "bytes_base": sum(bytes_base)}
    # the job's time is its slowest rank's
    for key in everyone[0]:
        vals = [e[key] for e in everyone if e.get(key) is not None]
        out[key] = max(vals) if vals else None
    out["save_ratio"] = out["ours_save_save_s"] / out["base_save_save_s"]
    out["load_ratio"] = out["ours_load_load_s"] / out["base_load_load_s"]
    out["bytes_ratio"] = out["bytes_ours"] / out["bytes_base"]
    out["verify_share"] = out["ours_load_verify_s"] / out["ours_load_load_s"]
    return out


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
COLUMNS = [("case", "case", ""), ("opt", "optimizer", ""), ("ranks", "world", ""),
           ("save ours s", "ours_save_save_s", ".3f"), ("save base s", "base_save_save_s", ".3f"),
           ("save x", "save_ratio", ".2f"), ("load ours s", "ours_load_load_s", ".3f"),
           ("verify s", "ours_load_verify_s", ".3f"), ("load base s", "base_load_load_s", ".3f"),
           ("load x", "load_ratio", ".2f"), ("MiB ours", "mib_ours", ".1f"), ("MiB base", "mib_base", ".1f"),
           ("bytes x", "bytes_ratio", ".3f")]
SPLIT_COLUMNS = [("case", "case", ""), ("opt", "optimizer", ""), ("first save s", "first_save_s", ".3f"),
                 ("state dict s", "ours_save_state_dict_s", ".3f"), ("dist save s", "ours_save_dist_save_s", ".3f"),
                 ("manifest s", "ours_save_manifest_s", ".3f"), ("other s", "ours_save_other_s", ".3f"),
                 ("base fsync s", "base_save_fsync_s", ".3f"), ("verify share", "verify_share", ".2f")]


def format_results(res: dict) -> str:
    rows = [{**r, "mib_ours": r["bytes_ours"] / 2**20, "mib_base": r["bytes_base"] / 2**20} for r in res["cases"]
            if "skipped" not in r]
    lines = [f"checkpoint save/load, CPU fp32, model + Adam state; medians of {res['repeats']} alternating round(s); "
             "times of the slowest rank", bl.format_table(rows, COLUMNS), "",
             "where our save's time goes (medians; 'other': mkdir/rmtree, fsyncs, renames, tracker) and today's "
             "save's missing fsync:", bl.format_table(rows, SPLIT_COLUMNS)]
    for r in rows:
        p = r.get("params") or {}
        if p:
            lines.append(f"{r['case']} parameters: " + ", ".join(f"{k} {v / 1e6:.2f} M" for k, v in p.items())
                         + f"; total {sum(p.values()) / 1e6:.1f} M")
        if r["world"] > 1:
            for i, pr in enumerate(r["per_rank"]):
                lines.append(f"  rank {i}: save ours {pr['ours_save_save_s']:.3f} s / base {pr['base_save_save_s']:.3f} s, "
                             f"load ours {pr['ours_load_load_s']:.3f} s / base {pr['base_load_load_s']:.3f} s, "
                             f"MiB ours {r['bytes_ours_per_rank'][i] / 2**20:.1f} / base {r['bytes_base_per_rank'][i] / 2**20:.1f}")
    lines += [f"{r['case']}/{r['optimizer']}: skipped, {r['skipped']}" for r in res["cases"] if "skipped" in r]
    lines += res["targets"]
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="tiny model only, one round, no warm-up")
    ap.add_argument("--cases", nargs="+", default=["tiny", "6b20b"], choices=sorted(CASES))
    ap.add_argument("--optimizers", nargs="+", default=["adam"], choices=["adam", "distributed"],
                    help="adam: megatron-core's plain (non-distributed) Adam; distributed: --use-distributed-optimizer")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary rows of the 6b20b case")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (PP = nproc); > 1 relaunches under torchrun")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--workdir", default="bench_out/checkpoint")
    a = ap.parse_args(argv)
    if a.quick:
        a.cases, a.repeats = ["tiny"], 1
    if a.nproc > 1 and "WORLD_SIZE" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(bl.free_port()), os.path.abspath(__file__),
               *(argv if argv is not None else sys.argv[1:])]
        subprocess.run(cmd, check=True, env=bl.trainer_env(a.threads))
        return None
    torch.set_num_threads(a.threads)
    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed, set_seeds, world_size_from_env

    work = os.path.abspath(a.workdir)
    world = world_size_from_env()
    res = {"repeats": a.repeats, "quick": a.quick, "vocab_6b20b": a.vocab, "cases": []}
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 1, world)
        set_seeds(1234)
        import torch.distributed as dist

        rank = dist.get_rank()
        try:
            for case in a.cases:
                for opt in a.optimizers:
                    r = run_case(case, opt, a, work)
                    res["cases"].append(r)
        finally:
            destroy()
    for r in res["cases"]:  # parameter counts per unit kind, for the report (cheap: from the spec)
        r["params"] = _params(r["case"], a.vocab)
    res["targets"] = [f"{'PASS' if r['save_ratio'] <= SAVE_TARGET else 'FAIL'} save ours <= {SAVE_TARGET}x today's "
                      f"({r['case']}, {r['optimizer']}): {r['save_ratio']:.2f}x" for r in res["cases"] if "skipped" not in r]
    if rank == 0:
        print(format_results(res), flush=True)
        if a.json:
            bl.write_json(a.json, res)
    return res


def _params(case: str, vocab: int) -> dict:
    from megatron.training.arguments import parse_config
    from omnibal_ext.model.cost_model import unit_param_counts
    from omnibal_ext.model.units import build_units

    spec = parse_config(["--device", "cpu", *CASES[case]], 1).model.spec
    if case != "tiny":
        spec = spec.replace(language=dataclasses.replace(spec.language, vocab_size=vocab, real_vocab_size=None))
    counts = unit_param_counts(spec, 1)
    out: dict = {}
    for u in build_units(spec):
        out[u.kind] = out.get(u.kind, 0) + int(counts[u.index])
    return out


if __name__ == "__main__":
    main()
