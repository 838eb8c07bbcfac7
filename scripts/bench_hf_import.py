"""Import cost of --hf-checkpoint per rank: one InternViT-6B layer and one InternLM2-20B-class LLM layer at
their real sizes, random weights saved by this script in the HF layout (bf16 safetensors), loaded by
``megatron.vlm.hf.load.load_hf_into_stage`` at TP 1, 2, 4 (torchrun, one stage holding just that layer).

Per rank: load seconds, bytes read from the safetensors, this rank's own slice (its parameters, fp32), and the
peak extra host memory of the load (VmHWM reset through /proc/self/clear_refs right before it, minus the RSS
then). The loader writes each piece a chunk at a time straight into the parameters and closes the shards after
each parameter, so the peak is about the safetensors pages of the largest one tensor read (file-backed, bf16;
a column cut maps whole rows) plus one chunk; "anon" = peak minus bytes read (0 when the peak is below them).
Measured (one InternViT-6B / InternLM2-20B layer): peak+/own 0.17 / 0.26 at TP 1, 0.33 / 0.27 at TP 2,
0.65 / 0.52 at TP 4 (before: 0.97-1.87x, the gated MLP and fused QKV pieces converted and concatenated).
Prints a table and one JSON line.

    python scripts/bench_hf_import.py [--tp 1 2 4] [--layers vit llm] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def bench_spec(which: str):
    from omnibal_ext.model.units import get_preset

    spec = get_preset("internvl-6b-20b")
    vision = dataclasses.replace(spec.vision, num_layers=1)
    language = dataclasses.replace(spec.language, num_layers=1, vocab_size=128, real_vocab_size=None)
    return spec.replace(name=f"bench-{which}", vision=vision, language=language)


def unit_of(which: str) -> str:
    return "vit.layer.0" if which == "vit" else "llm.layer.0"


def info_for():
    from megatron.vlm.hf.config import HFInfo

    return HFInfo("original", "internlm2", 1, 0)  # InternVL-Chat-V1-5's layout: fused ViT qkv, InternLM2 wqkv


def write_hf(which: str, folder: str) -> int:
    """Random bf16 tensors of the one layer under their HF names; returns bytes written."""
    import torch
    from safetensors.torch import save_file

    from megatron.vlm.hf.keys import recipes

    spec = bench_spec(which)
    _, shapes = recipes(spec, info_for(), "legacy", [unit_of(which)])
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return sum(t.numel() * 2 for t in tensors.values())


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def worker(which: str, folder: str, out: str) -> None:
    """One rank (under torchrun): build the stage of the one layer at TP = world size, load it, report."""
    import torch
    import torch.distributed as dist

    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.load import load_hf_into_stage
    from megatron.vlm.hf.reader import HFCheckpoint
    from megatron.vlm.stage.build import StageBuild, build_stage
    from omnibal_ext.model.units import build_units

    tp = int(os.environ["WORLD_SIZE"])
    spec = bench_spec(which)
    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), tp, 1)
        try:
            units = build_units(spec)
            index = next(u.index for u in units if u.name == unit_of(which))
            stage = build_stage(StageBuild(spec, range(index, index + 1), tp=tp, initialize=False))
            own = sum(p.numel() * p.element_size() for p in stage.parameters())
            with torch.no_grad():
                for p_ in stage.parameters():
                    p_.zero_()  # the parameters resident before the measure: it counts the load's own memory
            reader = HFCheckpoint(folder)
            read = {"bytes": 0}
            box = reader.box

            def counting_box(*a, **k):
                t = box(*a, **k)
                read["bytes"] += t.numel() * t.element_size()
                return t

            reader.box = counting_box
            src = HFSource(folder, {}, spec, info_for(), reader, "legacy")
            import gc

            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            rss0 = _rss_kib("VmRSS:")
            t0 = time.perf_counter()
            load_hf_into_stage(stage, src)
            seconds = time.perf_counter() - t0
            extra = (_rss_kib("VmHWM:") - rss0) * 1024
            row = {"layer": which, "tp": tp, "rank": dist.get_rank(), "seconds": seconds, "own_bytes": own,
                   "read_bytes": read["bytes"], "peak_extra_bytes": extra}
            rows = [None] * tp
            dist.all_gather_object(rows, row)
            if dist.get_rank() == 0:
                with open(out, "w") as f:
                    json.dump(rows, f)
        finally:
            destroy()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", nargs="+", choices=["vit", "llm"], default=["vit", "llm"])
    p.add_argument("--workdir", default=None)
    p.add_argument("--worker", nargs=3, metavar=("LAYER", "DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    import benchlib

    work = args.workdir or tempfile.mkdtemp(prefix="bench_hf_import_")
    results = []
    for which in args.layers:
        folder = os.path.join(work, which)
        written = write_hf(which, folder)
        print(f"{which}: wrote {written / 2**20:.0f} MiB of bf16 HF tensors to {folder}", flush=True)
        for tp in args.tp:
            out = os.path.join(work, f"{which}_tp{tp}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
                   str(benchlib.free_port()), os.path.abspath(__file__), "--worker", which, folder, out]
            run = subprocess.run(cmd, env=benchlib.trainer_env(), capture_output=True, text=True)
            if run.returncode:
                print(run.stdout[-3000:] + run.stderr[-3000:], file=sys.stderr)
                return 1
            results += json.load(open(out))
    mib = 2.0**20
    print(f"{'layer':<6}{'TP':>3}{'rank':>5}{'load s':>8}{'own MiB':>9}{'read MiB':>9}{'peak+ MiB':>10}{'peak+/own':>10}{'anon/own':>9}")
    for r in results:
        print(f"{r['layer']:<6}{r['tp']:>3}{r['rank']:>5}{r['seconds']:>8.2f}{r['own_bytes'] / mib:>9.0f}"
              f"{r['read_bytes'] / mib:>9.0f}{r['peak_extra_bytes'] / mib:>10.0f}{r['peak_extra_bytes'] / r['own_bytes']:>10.2f}"
              f"{max(r['peak_extra_bytes'] - r['read_bytes'], 0) / r['own_bytes']:>9.2f}")
    print(json.dumps({"bench": "hf_import", "rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
