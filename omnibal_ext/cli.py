"""The planner commands of ``omnibal`` (tensor-free, no trainer):

* ``omnibal isf stats|search|pack``  data level (``omnibal_ext.data.cli``);
* ``omnibal partition``              model level: pipeline layout (``omnibal_ext.model.cli``);
* ``omnibal memory``                 memory level: per-stage memory and recompute (``omnibal_ext.memory.cli``);
* ``omnibal plan``                   all three together, with predictions (``omnibal_ext.plan``).

The ``omnibal`` command itself is ``omnibal_cli.py`` (beside pretrain_vlm.py, above this package and the
trainer): it registers these with the trainer's record reader (meta JSONs as ``--stats``/``--data``) and
Hugging Face config reader (``omnibal plan --hf-checkpoint``) as hooks, and adds ``omnibal profile`` and
``omnibal hf import|export``.  This package imports nothing of the trainer.

Bad input (a missing or malformed file, a flag that cannot work, a model that fits no
configuration) prints one line ``omnibal <command>: error: ...`` on stderr and exits with status 1 (argparse's own usage errors: 2).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from omnibal_ext.data.cli import _json_default, add_isf_parser
from omnibal_ext.data.stats import SampleStats, StatsError, load_stats
from omnibal_ext.errors import UserError, report
from omnibal_ext.memory.cli import add_memory_parser
from omnibal_ext.memory.memory_model import GIB
from omnibal_ext.model.cli import add_partition_parser
from omnibal_ext.model.cost_model import DEVICES
from omnibal_ext.model.costs import CostTable
from omnibal_ext.model.expert_load import measured_by_ep
from omnibal_ext.model.trainable import Freeze, add_freeze_flags
from omnibal_ext.model.units import PRESETS, get_preset
from omnibal_ext.plan import DEFAULT_GLOBAL_BATCH, PlanConfig, __doc__ as plan_doc, format_plan, make_plan, plot_plan

# hooks the `omnibal` command gives (omnibal_cli.py): the trainer's readers
# (meta JSON paths, ModelSpec or None, its Hugging Face folder or None, the command's args with the scan flags
# of add_scan_flags) -> SampleStats of the samples (with each image and video), one source per meta JSON
MetaScanner = Callable[[Sequence[str], object, "str | None", argparse.Namespace], SampleStats]
HFModelReader = Callable[[str], object]  # Hugging Face folder -> ModelSpec of its config.json
StatsWriter = Callable[[argparse.Namespace], int]  # `isf stats --write`: scan --stats' data, write stats; samples


def add_plan_parser(subparsers, scan_metas: MetaScanner | None = None,
                    model_from_hf: HFModelReader | None = None) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object; sets ``func``.  ``scan_metas``: reads
    meta JSONs given to ``--data``; ``model_from_hf``: the model of ``--hf-checkpoint DIR`` (without it the flag
    is not offered)."""

    p = subparsers.add_parser(
        "plan", help="data + model + memory balance in one plan, with predictions vs Megatron's default",
        description="Plan ISF thresholds, parallel sizes, pipeline layout and per-stage recompute together, "
                    "and predict iteration time, tokens/s and GPU-days of the Megatron default, +data, +model "
                    "and +memory.\n\n" + (plan_doc or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, metavar="STATS_OR_META",
                   help="per-sample stats JSON files (OmniBal format: lists of {vit_num, token_num}), "
                        "or meta JSONs (scanned by the trainer's reader with the model's family: its image and video "
                        "rules, the flags below), or folders of either; concatenated")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help=f"model preset: {', '.join(PRESETS)}")
    if model_from_hf is not None:
        model.add_argument("--hf-checkpoint", metavar="DIR",
                           help="the model of a Hugging Face folder's config.json (the plan's trainer "
                                "flags then start from it with --hf-checkpoint)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="memory of one GPU, GiB")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: chosen)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default: chosen)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: gpus / (tp * pp * cp))")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size (the trainer's --context-parallel-size; default 1): costs and "
                        "memory per CP rank; with sequence parallelism (TP > 1) each sample is padded to a multiple "
                        "of 2 x CP x TP")
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
    p.add_argument("--vpp", type=int, default=None, metavar="V",
                   help="model chunks per pipeline rank, the interleaved pipeline (default: chosen among 1..--max-vpp "
                        "where the micro-batches per pipeline are a multiple of PP, when predicted faster)")
    p.add_argument("--max-vpp", type=int, default=2, metavar="V", help="largest V tried when --vpp is not given "
                                                                        "(default 2; 1: no interleaving)")
    p.add_argument("--ep", type=int, default=None,
                   help="MoE models: expert-parallel size (the trainer's --expert-model-parallel-size; default: chosen "
                        "among the divisors of the experts that megatron-core's expert grid allows)")
    p.add_argument("--etp", type=int, default=None,
                   help="MoE models: expert tensor-parallel size (--expert-tensor-parallel-size; default: 1 or TP, "
                        "chosen)")
    p.add_argument("--moe-imbalance", type=float, default=None, metavar="F",
                   help="MoE models: the busiest EP rank's routed tokens over the mean (>= 1), e.g. as the trainer's "
                        "'expert load imbalance' log measured it; multiplies the experts' time and sizes their "
                        "activations (default: measured (--moe-profile), else unknown: time at 1.0, activations at "
                        "the no-drop worst case)")
    p.add_argument("--moe-profile", default=None, metavar="PROFILE",
                   help="MoE models: a profile JSON of `omnibal profile` (or the trainer's --omnibal-profile) on the "
                        "training data; its measured expert load gives the imbalance at each EP tried")
    p.add_argument("--serve-batch", type=int, nargs="+", default=[1, 32], metavar="B",
                   help="serving lines of the report: decode batches (sequences in flight) the layouts' generation "
                        "tokens/s are predicted at (default 1 32)")
    p.add_argument("--serve-context", type=int, default=None, metavar="TOKENS",
                   help="serving lines: cached tokens per sequence (default: the data's mean sample tokens)")
    p.add_argument("--sim-iterations", type=int, default=8, help="iterations simulated per setting (default 8)")
    p.add_argument("--seed", type=int, default=0)
    add_freeze_flags(p)
    add_scan_flags(p, "meta JSONs in --data")
    p.add_argument("--json", required=True, metavar="OUT", help="where to write the plan JSON")
    p.add_argument("--plot", default=None, metavar="PREFIX",
                   help="write PREFIX_stages.png (stage times) and PREFIX_timeline.png (pipeline timeline)")
    p.set_defaults(func=functools.partial(run_plan, scan_metas=scan_metas, model_from_hf=model_from_hf))
    return p


def run_plan(args, scan_metas: MetaScanner | None = None, model_from_hf: HFModelReader | None = None) -> int:
    hf_checkpoint = getattr(args, "hf_checkpoint", None)
    spec = model_from_hf(hf_checkpoint) if hf_checkpoint else get_preset(args.model)
    stats = load_stats_or_meta(args.data, "--data", spec, scan_metas, args, hf_checkpoint)
    measured = measured_profile_imbalance(args.moe_profile, spec)
    plan = make_plan(stats, dataclasses.replace(plan_config(args), model=spec, measured_imbalance=measured))
    if hf_checkpoint:  # the trainer takes the model from the folder, not from a preset name
        flags = {"--hf-checkpoint": hf_checkpoint}
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

    return PlanConfig(model=args.model, gpus=args.gpus, gpu_memory_bytes=args.gpu_memory * GIB, tp=args.tp,
                      pp=args.pp, dp=args.dp, cp=args.cp, device=args.device, samples=args.samples,
                      samples_per_group=args.samples_per_group, max_seq_length=args.max_seq_length,
                      global_batch_size=args.global_batch_size, memory_reserve=args.memory_reserve,
                      attention=args.attention, sim_iterations=args.sim_iterations, choose_for=args.choose_for,
                      min_pp=args.min_pp, seed=args.seed, freeze=Freeze.from_args(args),
                      ep=args.ep, etp=args.etp, moe_imbalance=args.moe_imbalance,
                      vpp=getattr(args, "vpp", None), max_vpp=getattr(args, "max_vpp", 2),
                      serve_batches=tuple(getattr(args, "serve_batch", (1, 32))),
                      serve_context=getattr(args, "serve_context", None))


def measured_profile_imbalance(path: str | None, spec) -> tuple[tuple[int, float], ...]:
    """(EP, imbalance) the profile at ``path`` measured (``--moe-profile``; None: none) for the model ``spec``;
    UserError naming the flag when it holds no measured expert load, or one of another number of experts."""
    if path is None:
        return ()

    try:
        meta = CostTable.load(path).meta
    except UserError as e:
        raise UserError(f"--moe-profile: {e}") from None
    measured = measured_by_ep(meta)
    if not measured:
        raise UserError(f"--moe-profile {path}: the profile holds no measured expert load (an MoE model's profile "
                        "on data: `omnibal profile` without --tiles/--llm-tokens, or the trainer's --omnibal-profile)")
    moe = spec.language.moe
    measured_experts = len(next(iter(meta["expert_load"]["tokens_per_expert"].values())))
    if moe is None or moe.num_experts != measured_experts:
        raise UserError(f"--moe-profile {path}: measured {measured_experts} experts, model {spec.name!r} has "
                        f"{moe.num_experts if moe else 'none'}")
    return measured


def build_parser(scan_metas: MetaScanner | None = None, model_from_hf: HFModelReader | None = None,
                 more_commands: Sequence[Callable] = (),
                 write_stats: StatsWriter | None = None) -> argparse.ArgumentParser:
    """The ``omnibal`` parser with the planner commands (the hooks: see :func:`add_plan_parser`; ``write_stats``:
    ``isf stats --write``, see :func:`add_stats_writing`), then ``more_commands`` (functions registering a command
    on the subparsers, e.g. omnibal_cli's ``profile``)."""

    parser = argparse.ArgumentParser(prog="omnibal", description="OmniBal-Megatron balancing tools")
    sub = parser.add_subparsers(dest="command", required=True)
    isf = add_isf_parser(sub, stats_loader=functools.partial(load_isf_stats, scan_metas=scan_metas,
                                                                  model_from_hf=model_from_hf))
    add_isf_scan_flags(isf)
    if write_stats is not None:
        add_stats_writing(isf, write_stats)
    add_partition_parser(sub)
    add_memory_parser(sub)
    add_plan_parser(sub, scan_metas, model_from_hf)
    for add in more_commands:
        add(sub)
    return parser


def isf_subcommands(isf: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The ``isf`` sub-command parsers by name (stats, search, pack)."""
    return next(a for a in isf._actions if isinstance(a, argparse._SubParsersAction)).choices


def add_isf_scan_flags(isf: argparse.ArgumentParser) -> None:
    """The scan flags (:func:`add_scan_flags`) on ``isf stats|search|pack``: meta JSONs given to ``--stats`` (and
    ``stats --write``'s data) are read by the family of ``--model`` (search and pack: also ISF in time's model),
    ``stats`` also takes ``--hf-checkpoint``."""
    subs = isf_subcommands(isf)
    p = subs["stats"]
    p.add_argument("--model", default=None,
                   help="meta JSONs and --write: the model preset whose family reads the images and videos")
    p.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                   help="meta JSONs and --write: the model (config.json), tokenizer, image and video processors of a "
                        "Hugging Face folder")
    for p in subs.values():
        add_scan_flags(p, "meta JSONs in --stats and --write" if p is subs["stats"] else "meta JSONs in --stats")


def load_isf_stats(args: argparse.Namespace, scan_metas: MetaScanner | None = None,
                   model_from_hf: HFModelReader | None = None) -> SampleStats:
    """The stats of ``omnibal isf``'s ``--stats`` (stats files or meta JSONs, read by ``--model``'s family or the
    ``--hf-checkpoint`` folder's where given; without either by 448 px tiles)."""

    hf = args.hf_checkpoint if args.isf_command == "stats" else None
    if hf and model_from_hf is None:
        raise UserError(f"--hf-checkpoint {hf}: the `omnibal` command reads Hugging Face folders")
    spec = model_from_hf(hf) if hf else get_preset(args.model) if args.model else None
    return load_stats_or_meta(args.stats, "--stats", spec, scan_metas, args, hf)


def add_stats_writing(isf: argparse.ArgumentParser, write_stats: StatsWriter) -> None:
    """``isf stats --write OUT``: the data given to ``--stats`` (meta JSONs or annotation JSONLs) scanned by the
    trainer's reader for the model of ``--hf-checkpoint``/``--model`` (its family's image rule: tiles,
    native-resolution patches; its video rule with the ``--video-*`` flags) and written to OUT as stats with each
    image's width, height and ViT items (and each video's); then summarised as usual."""
    p = isf_subcommands(isf)["stats"]
    p.add_argument("--write", metavar="OUT", default=None,
                   help="scan the data given to --stats with the trainer's reader and write per-sample stats "
                        "({vit_num, token_num, images: [{width, height, tiles|patches}], videos: [...]}) to OUT")
    summarise = p.get_default("func")

    def run(args):
        if args.write is None:
            return summarise(args)
        write_stats(args)
        # the written file is stats, read as such: the scan flags were the scan's
        return summarise(argparse.Namespace(**{**vars(args), **vars(scan_defaults()), "stats": [args.write],
                                               "model": None, "hf_checkpoint": None}))
    p.set_defaults(func=run)


def add_scan_flags(p: argparse.ArgumentParser, applies: str) -> None:
    """The trainer's image and video flags (same names and defaults: the family's rules read them as the
    trainer's, over the --hf-checkpoint folder's processor files) for a command whose ``applies`` (e.g. "meta JSONs
    in --data") are scanned by the trainer's reader; refused with stats files (``load_stats_or_meta``)."""
    p.add_argument("--min-pixels", type=int, default=None, help=f"{applies}, native-resolution images: --min-pixels")
    p.add_argument("--max-pixels", type=int, default=None, help=f"{applies}, native-resolution images: --max-pixels")
    p.add_argument("--max-num-tiles", type=int, default=6, help=f"{applies}, tiled images: --max-num-tiles")
    p.add_argument("--min-num-tiles", type=int, default=1, help=f"{applies}, tiled images: --min-num-tiles")
    add_video_flags(p, applies)


def scan_defaults() -> argparse.Namespace:
    """The scan flags at their defaults (:func:`add_scan_flags`)."""
    p = argparse.ArgumentParser(add_help=False)
    add_scan_flags(p, "")
    return p.parse_args([])


def add_video_flags(p: argparse.ArgumentParser, applies: str = "with --write") -> None:
    """The trainer's ``--video-*`` flags (same names and defaults: the family's video rule reads them as the
    trainer's, over the --hf-checkpoint folder's video processor file)."""
    p.add_argument("--video-fps", type=float, default=None, help=f"{applies}, videos: the trainer's --video-fps")
    p.add_argument("--video-min-frames", type=int, default=None, help=f"{applies}, videos: --video-min-frames")
    p.add_argument("--video-max-frames", type=int, default=None, help=f"{applies}, videos: --video-max-frames")
    p.add_argument("--video-max-pixels", type=int, default=None, help=f"{applies}, videos: --video-max-pixels")
    p.add_argument("--video-total-pixels", type=int, default=None, help=f"{applies}, videos: --video-total-pixels")
    p.add_argument("--video-folder-fps", type=float, default=24.0, help=f"{applies}, videos: --video-folder-fps")


def scan_flags_given(args: argparse.Namespace) -> list[str]:
    """The scan flags of ``args`` not at their defaults, as flags (``--video-fps`` ...)."""
    defaults = vars(scan_defaults())
    return ["--" + k.replace("_", "-") for k, v in defaults.items() if getattr(args, k) != v]


def data_files(paths, flag: str) -> list[str]:
    """The files named, a folder standing for its ``*.json`` and ``*.json.gz`` files (sorted)."""

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


def load_stats_or_meta(paths, flag: str = "--stats", spec=None, scan_metas: MetaScanner | None = None,
                       args: argparse.Namespace | None = None, hf_folder: str | None = None) -> SampleStats:
    """Per-sample stats files in the OmniBal format, or meta JSONs (a JSON object, not a list).

    Meta JSONs are read by ``scan_metas(metas, spec, hf_folder, args)`` (the ``omnibal`` command's: the trainer's
    reader with the family's image and video rules and ``args``' scan flags, see omnibal_cli.scan_metas; ``args``
    None: the flags' defaults); without it they are refused.  Stats files refuse scan flags given in ``args``
    (they were the scan's that wrote them).
    """

    args = scan_defaults() if args is None else args
    files = data_files(paths, flag)
    if not files:
        return load_stats(files)  # the loader's own "no stats files" error
    metas = [f for f in files if _is_meta(f)]
    if not metas:
        given = scan_flags_given(args)
        if given:
            raise UserError(f"{', '.join(given)}: read by the scan of meta JSONs; {flag} {files[0]} is a stats file "
                            "(write it with those flags: omnibal isf stats --write)")
        return load_stats(files)
    if len(metas) != len(files):
        raise UserError(f"{flag}: give stats files or meta JSONs, not both")
    if scan_metas is None:
        raise UserError(f"{flag} {metas[0]}: a meta JSON; the `omnibal` command reads those with the "
                        "trainer's reader")
    return scan_metas(metas, spec, hf_folder, args)


def _is_meta(path: str) -> bool:
    try:
        with open(path) as f:
            head = f.read(4096).lstrip()
    except (OSError, UnicodeDecodeError):
        return False  # the stats loader names the file and the reason (gzip files are stats, never metas)
    return head.startswith("{")


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Run the ``omnibal`` ``parser`` on ``argv`` (default: sys.argv[1:]); returns the exit status."""
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "accepts_trainer_flags", False):
        args.trainer_flags = extra  # `omnibal profile` passes the rest to the trainer's parser
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # exits 2
    command = {"isf": f"isf {getattr(args, 'isf_command', '')}", "hf": f"hf {getattr(args, 'hf_command', '')}"}.get(
        args.command, args.command)
    try:
        result = args.func(args)
    except UserError as e:  # StatsError, PlanError, LayoutError, MemoryBudgetError, ...: one line, exit 1
        return report(e, f"omnibal {command}: ")
    return result if isinstance(result, int) else 0
