"""``omnibal`` command line: sub-commands of the OmniBal-Megatron tools.

* ``omnibal isf stats|search|pack``  data level (``omnibal_ext.data.cli``);
* ``omnibal partition``              model level: pipeline layout (``omnibal_ext.model.cli``);
* ``omnibal memory``                 memory level: per-stage memory and recompute (``omnibal_ext.memory.cli``);
* ``omnibal plan``                   all three together, with predictions (``omnibal_ext.plan``);
* ``omnibal profile``                measure the units on this machine (runs the trainer's profiler);
* ``omnibal hf import|export``       Hugging Face InternVL folders to and from trainer checkpoints
                                     (``megatron.vlm.hf``).

Bad input (a missing or malformed file, a flag that cannot work, a model that fits no
configuration) prints one line ``omnibal <command>: error: ...`` on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from omnibal_ext.data.cli import _json_default, add_isf_parser
from omnibal_ext.errors import UserError, report


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object; sets ``func``."""
    from omnibal_ext.model.cost_model import DEVICES
    from omnibal_ext.model.units import PRESETS
    from omnibal_ext.plan import DEFAULT_GLOBAL_BATCH
    from omnibal_ext.plan import __doc__ as plan_doc

    p = subparsers.add_parser(
        "plan", help="data + model + memory balance in one plan, with predictions vs Megatron's default",
        description="Plan ISF thresholds, parallel sizes, pipeline layout and per-stage recompute together, "
                    "and predict iteration time, tokens/s and GPU-days of the Megatron default, +data, +model "
                    "and +memory.\n\n" + (plan_doc or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, metavar="STATS_OR_META",
                   help="per-sample stats JSON files (OmniBal format: lists of {vit_num, token_num}), "
                        "or InternVL meta JSONs (scanned as by `omnibal isf`), or folders of either; concatenated")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help=f"model preset: {', '.join(PRESETS)}")
    model.add_argument("--hf-checkpoint", metavar="DIR",
                       help="the model of a Hugging Face InternVL folder's config.json (the plan's trainer flags "
                            "then start from it with --hf-checkpoint)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="memory of one GPU, GiB")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: chosen)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default: chosen)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: gpus / (tp * pp))")
    p.add_argument("--device", default="a100-80g", help=f"device preset of the cost model: {', '.join(DEVICES)}")
    p.add_argument("--samples", type=int, default=None,
                   help="dataset size for GPU-days, samples (one epoch; default: the stats' count)")
    p.add_argument("--samples-per-group", type=int, default=4, metavar="K",
                   help="samples per micro-batch (Megatron) and target per ISF group (default 4)")
    p.add_argument("--max-seq-length", type=int, default=None, metavar="L",
                   help="fixed ISF token cap Qt per group, tokens (default: searched from K)")
    p.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH,
                   help=f"samples per iteration (default {DEFAULT_GLOBAL_BATCH}; rounded up to whole micro-batches)")
    p.add_argument("--memory-reserve", type=float, default=0.1,
                   help="fraction of GPU memory kept out of the budget (CUDA context, fragmentation; default 0.1)")
    p.add_argument("--attention", choices=["unfused", "flash"], default="unfused",
                   help="attention kernel the cost model assumes (memory of the scores; default unfused)")
    p.add_argument("--choose-for", choices=["omnibal", "baseline"], default="omnibal",
                   help="parallel sizes (when not given) fastest for the balanced plan (default) or for "
                        "Megatron's default")
    p.add_argument("--min-pp", type=int, default=1, metavar="P",
                   help="when choosing the parallel sizes, only pipelines of at least P stages (default 1)")
    p.add_argument("--sim-iterations", type=int, default=8, help="iterations simulated per setting (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, metavar="OUT", help="where to write the plan JSON")
    p.add_argument("--plot", default=None, metavar="PREFIX",
                   help="write PREFIX_stages.png (stage times) and PREFIX_timeline.png (pipeline timeline)")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args) -> int:
    from omnibal_ext.model.units import get_preset
    from omnibal_ext.plan import format_plan, make_plan, plot_plan

    if args.hf_checkpoint:
        import os

        from megatron.vlm.hf.config import read_config, spec_from_config

        spec, _ = spec_from_config(read_config(args.hf_checkpoint),
                                   "hf:" + os.path.basename(os.path.normpath(args.hf_checkpoint)),
                                   os.path.join(args.hf_checkpoint, "config.json"))
    else:
        spec = get_preset(args.model)
    stats = load_stats_or_meta(args.data, "--data", spec)
    plan = make_plan(stats, dataclasses.replace(plan_config(args), model=spec))
    if args.hf_checkpoint:  # the trainer takes the model from the folder, not from a preset name
        flags = {"--hf-checkpoint": args.hf_checkpoint}
        flags.update({k: v for k, v in plan.trainer_flags.items() if k != "--model"})
        plan.trainer_flags.clear()
        plan.trainer_flags.update(flags)
    doc = plan.to_dict()
    doc["files"] = list(stats.files)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
    print(format_plan(plan))
    if args.plot:
        for path in plot_plan(plan, args.plot):
            print(f"wrote {path}")
    return 0


def plan_config(args):
    """The PlanConfig of ``omnibal plan``'s flags (``--gpu-memory`` is in GiB)."""
    from omnibal_ext.memory.memory_model import GIB
    from omnibal_ext.plan import PlanConfig

    return PlanConfig(model=args.model, gpus=args.gpus, gpu_memory_bytes=args.gpu_memory * GIB, tp=args.tp,
                      pp=args.pp, dp=args.dp, device=args.device, samples=args.samples,
                      samples_per_group=args.samples_per_group, max_seq_length=args.max_seq_length,
                      global_batch_size=args.global_batch_size, memory_reserve=args.memory_reserve,
                      attention=args.attention, sim_iterations=args.sim_iterations, choose_for=args.choose_for,
                      min_pp=args.min_pp, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    from omnibal_ext.memory.cli import add_memory_parser
    from omnibal_ext.model.cli import add_partition_parser

    parser = argparse.ArgumentParser(prog="omnibal", description="OmniBal-Megatron balancing tools")
    sub = parser.add_subparsers(dest="command", required=True)
    add_isf_parser(sub, stats_loader=stats_or_meta_loader)
    add_partition_parser(sub)
    add_memory_parser(sub)
    add_plan_parser(sub)
    add_profile_parser(sub)
    add_hf_parser(sub)
    return parser


def add_hf_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal hf import|export``: offline conversion (torch is imported only when one runs)."""
    p = subparsers.add_parser("hf", help="convert Hugging Face InternVL checkpoints to and from trainer checkpoints",
                              description="Offline conversion between a Hugging Face InternVL folder (config.json + "
                                          "*.safetensors; native InternVLForConditionalGeneration or original "
                                          "InternVLChatModel layout) and a trainer checkpoint (torch_dist).")
    sub = p.add_subparsers(dest="hf_command", required=True)
    imp = sub.add_parser("import", help="HF folder -> weights-only trainer checkpoint at iteration 0 "
                                        "(load it with pretrain_vlm.py --load at any TP/PP/layout)")
    imp.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="Hugging Face model folder")
    imp.add_argument("--save", required=True, metavar="CKPT", help="checkpoint folder to write")
    imp.set_defaults(func=_run_hf_import)
    exp = sub.add_parser("export", help="trainer checkpoint (any TP/PP/DP/layout) -> native HF folder that "
                                        "InternVLForConditionalGeneration.from_pretrained loads")
    exp.add_argument("--load", required=True, metavar="CKPT", help="checkpoint folder (its newest iteration)")
    exp.add_argument("--out", required=True, metavar="DIR", help="folder to write config.json + *.safetensors into")
    exp.add_argument("--ckpt-step", type=int, default=None, help="that iteration instead of the newest")
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="tensor dtype written (default: the imported checkpoint's)")
    exp.set_defaults(func=_run_hf_export)
    return p


def _run_hf_import(args) -> int:
    import torch

    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed
    from megatron.vlm.hf.convert import import_hf

    with cpu_compat.patched():
        try:
            initialize_distributed(torch.device("cpu"), 1, 1)
            done = import_hf(args.hf_checkpoint, args.save)
        finally:
            destroy()
    spec = done["spec"]
    print(f"imported {done['tensors']} tensors ({done['layout']} layout): ViT {spec.vision.num_layers} layers, "
          f"LLM {spec.language.num_layers} layers, vocabulary {spec.language.vocab_real} (padded to "
          f"{spec.language.vocab_size}) -> {args.save}")
    return 0


def _run_hf_export(args) -> int:
    from megatron.vlm.hf.convert import export_hf

    done = export_hf(args.load, args.out, args.ckpt_step, args.dtype)
    print(f"exported iteration {done['iteration']}: {done['tensors']} tensors in {', '.join(done['files'])}"
          + (f", tokenizer from {done['tokenizer']}" if done["tokenizer"] else ", no tokenizer found") + f" -> {args.out}")
    return 0


def data_files(paths, flag: str) -> list[str]:
    """The files named, a folder standing for its ``*.json`` and ``*.json.gz`` files (sorted)."""
    from omnibal_ext.data.stats import StatsError

    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(str(f) for pattern in ("*.json", "*.json.gz") for f in path.glob(pattern))
            if not found:
                raise StatsError(f"{flag} {path}: no *.json or *.json.gz files in this folder")
            files += found
        else:
            files.append(str(path))
    return files


def load_stats_or_meta(paths, flag: str = "--stats", spec=None):
    """Per-sample stats files in the OmniBal format, or InternVL meta JSONs (a JSON object, not a list).

    A meta JSON is scanned once by the trainer's reader (tiles from image sizes, tokens from the
    tokenizer): tiles of the model ``spec``'s image size and tokens per tile (without a model, as by
    ``omnibal isf``: InternVL-Chat's 448 px and 256 tokens per tile), 1 to 6 tiles, the byte-level
    tokenizer unless OMNIBAL_TOKENIZER names a Hugging Face tokenizer folder.  For other settings,
    write the stats with megatron.vlm.data.stats.write_stats first.
    """
    import os

    from omnibal_ext.data.stats import from_arrays, load_stats

    files = data_files(paths, flag)
    if not files:
        return load_stats(files)  # the loader's own "no stats files" error
    metas = [f for f in files if _is_meta(f)]
    if not metas:
        return load_stats(files)
    if len(metas) != len(files):
        raise UserError(f"{flag}: give stats files or meta JSONs, not both")
    from megatron.vlm.data.internvl import ReaderConfig, scan_annotations
    from megatron.vlm.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(os.environ.get("OMNIBAL_TOKENIZER"))
    image_size, tokens_per_tile = (448, 256) if spec is None else (spec.vision.image_size, spec.tokens_per_tile)
    config = ReaderConfig(image_size=image_size, tokens_per_tile=tokens_per_tile, max_num_tiles=6,
                          max_seq_length=None)
    tiles, tokens, source = [], [], []
    for i, meta in enumerate(metas):
        scan = scan_annotations(meta, tokenizer, config, progress=True)
        tiles.append(scan.rec_tiles[scan.order])
        tokens.append(scan.rec_tokens[scan.order])
        source.append(np.full(len(scan.order), i))
    return from_arrays(np.concatenate(tiles), np.concatenate(tokens), np.concatenate(source), metas)


def stats_or_meta_loader(args):
    """``omnibal isf --stats``: see :func:`load_stats_or_meta`."""
    return load_stats_or_meta(args.stats, "--stats")


def _is_meta(path: str) -> bool:
    try:
        with open(path) as f:
            head = f.read(4096).lstrip()
    except (OSError, UnicodeDecodeError):
        return False  # the stats loader names the file and the reason (gzip files are stats, never metas)
    return head.startswith("{")


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal profile --json OUT [trainer flags]``: measure every unit on this machine.

    Runs pretrain_vlm.py's profiler in this process (a world of one) for the model the trainer
    flags describe, at the micro-batch shape training would use, and writes the profile JSON.
    """
    p = subparsers.add_parser("profile", help="measure per-unit forward/backward time and activation bytes",
                              description=add_profile_parser.__doc__)
    p.add_argument("--json", required=True, metavar="OUT", help="profile JSON to write")
    g = p.add_argument_group("explicit shape (no data read; for models too large to train here)")
    g.add_argument("--tiles", type=int, default=None, help="ViT tiles per micro-batch")
    g.add_argument("--llm-tokens", type=int, default=None, help="LLM tokens per micro-batch")
    g.add_argument("--sample-tokens", type=int, default=None,
                   help="length of each packed sample, tokens (attention is within a sample; default: "
                        "one sequence of --llm-tokens)")
    p.add_argument("--compare-device", default=None, metavar="PRESET",
                   help="print measured against this analytic device preset (e.g. h200-141g)")
    p.set_defaults(func=_run_profile, accepts_trainer_flags=True)
    return p


def _run_profile(args) -> int:
    from megatron.training import cpu_compat
    from megatron.training.arguments import requested_device
    from megatron.training.initialize import choose_device
    from omnibal_ext.model.cost_model import get_device, profile_report
    from omnibal_ext.model.costs import CostTable

    explicit = (args.tiles, args.llm_tokens)
    if None in explicit and (args.tiles, args.llm_tokens, args.sample_tokens) != (None, None, None):
        raise UserError("--tiles and --llm-tokens go together (an explicit micro-batch shape; --sample-tokens "
                        "needs them)")
    device = get_device(args.compare_device) if args.compare_device else None  # bad name: before any work
    with cpu_compat.patched_for(choose_device(requested_device(args.trainer_flags))):  # CPU: teardown included
        _profile(args)
    print(f"profile written to {args.json}")
    if device is not None:
        rows = profile_report(CostTable.load(args.json), device)
        print(format_profile_report(rows, device.name))
    return 0


def _profile(args) -> None:
    """Measure the units as ``omnibal profile`` asks (an explicit shape, or the trainer's data)."""
    from megatron.training.initialize import destroy
    from omnibal_ext.model.cost_model import MicroBatchShape

    try:
        if args.tiles is not None:
            from megatron.training.profiling import profile_at_shape

            sample = args.sample_tokens or args.llm_tokens
            if not 1 <= sample <= args.llm_tokens:
                raise UserError(f"--sample-tokens must be in [1, --llm-tokens], got {sample}")
            shape = MicroBatchShape(args.tiles, args.llm_tokens, llm_attn_tokens_sq=float(args.llm_tokens * sample))
            profile_at_shape(list(args.trainer_flags), shape, args.json)
        else:
            import pretrain_vlm  # the trainer's entry point (installed as a module beside this package)

            pretrain_vlm.main(list(args.trainer_flags) + ["--omnibal-profile", args.json])
    finally:
        destroy()


def format_profile_report(rows: list[dict], device: str) -> str:
    """The measured-vs-analytic rows of ``cost_model.profile_report`` as a text table (MiB)."""
    mib = 2.0**20
    lines = [f"{'kind':<11} {'fwd ms':>9} {'bwd ms':>9} {'bwd/fwd':>7} {'eff@' + device:>16} "
             f"{'act MiB (model)':>19} {'full MiB (model)':>19} {'sel MiB (model)':>19}"]
    for r in rows:
        def pair(field):
            return f"{r[field] / mib:8.1f} ({r['analytic_' + field] / mib:8.1f})"
        ratio = "-" if r["bwd_over_fwd"] is None else f"{r['bwd_over_fwd']:.2f}"
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(f"{r['kind']:<11} {r['fwd_ms']:9.3f} {r['bwd_ms']:9.3f} {ratio:>7} {eff:>16} "
                     f"{pair('act_bytes'):>19} {pair('act_bytes_full'):>19} {pair('act_bytes_selective'):>19}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``omnibal`` with ``argv`` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "accepts_trainer_flags", False):
        args.trainer_flags = extra  # `omnibal profile` passes the rest to the trainer's parser
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # exits 2
    command = {"isf": f"isf {getattr(args, 'isf_command', '')}", "hf": f"hf {getattr(args, 'hf_command', '')}"}.get(
        args.command, args.command)
    try:
        result = args.func(args)
    except UserError as e:  # StatsError, PlanError, LayoutError, MemoryBudgetError, ...: one line, exit 2
        return report(e, f"omnibal {command}: ")
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
