"""``omnibal``: the command line of OmniBal-Megatron (installed as the ``omnibal`` console script).

It sits above both the planners (``omnibal_ext``, which imports nothing of the trainer) and the trainer
(``megatron``, ``pretrain_vlm``):

* ``omnibal isf|partition|memory|plan``  the planner commands (``omnibal_ext.cli``), given the trainer's
                                     readers: meta JSONs as ``--stats``/``--data``
                                     (:func:`scan_metas`), ``omnibal isf stats --write`` (any family's
                                     data: :func:`write_scanned_stats`) and ``omnibal plan --hf-checkpoint``
                                     (:func:`model_from_hf`);
* ``omnibal profile``                measure the units on this machine (runs the trainer's profiler);
* ``omnibal hf import|export``       Hugging Face folders to and from trainer checkpoints
                                     (``megatron.vlm.hf``);
* ``omnibal generate``               answers to conversations on the training layout (``megatron.vlm.inference``);
* ``omnibal serve``                  an OpenAI-compatible server of a model on the training layout, and
  ``omnibal eval``                   a local task asked of it (``megatron.vlm.inference.commands``).
* ``omnibal data to-energon``        a meta JSON or annotation JSONL into Energon shards
                                     (``megatron.vlm.data.energon.convert``).

Bad input prints one line ``omnibal <command>: error: ...`` on stderr and exits with status 1 (argparse's own usage errors: 2).
"""
from __future__ import annotations

import argparse
import sys

from megatron.training import known_warnings

known_warnings.silence()  # first: the imports below load megatron-core, which warns as it loads

from megatron.vlm.inference.commands import add_eval_parser, add_serve_parser  # noqa: E402
from omnibal_ext import cli as planner_cli
from omnibal_ext.errors import UserError

import megatron.vlm.families  # noqa: F401  (registers the built-in families: tensor-free, the planner path)


PUBLISHED_TILES = dict(image_size=448, tokens_per_tile=256, max_num_tiles=6)  # the tiles of OmniBal's published stats


def scan_metas(metas, spec=None, hf_folder: str | None = None, args: argparse.Namespace | None = None):
    """SampleStats of the meta JSONs ``metas`` (one source each), scanned once by the trainer's reader as
    :func:`write_scanned_stats` scans (``omnibal plan --data``, ``omnibal isf --stats``): the family of ``spec``
    (its tokenizer and processors from ``hf_folder`` where given) reads the images by its image rule and the
    videos by its video rule with ``args``' scan flags (``omnibal_ext.cli.add_scan_flags``; None: their
    defaults); without a model, 448 px tiles (``PUBLISHED_TILES``) and no videos."""
    from omnibal_ext.data.stats import stats_of_records

    args = planner_cli.scan_defaults() if args is None else args
    return stats_of_records(list(zip(metas, scan_records(metas, spec, hf_folder, args))))


def data_reader(spec, hf_folder: str | None, args: argparse.Namespace):
    """(tokenizer, ReaderConfig, ViT item key of the stats: "tiles" or "patches") of the trainer's reader for the
    model ``spec`` (None: the 448 px tiles of ``PUBLISHED_TILES``): its family's image rule, its video rule with
    the ``--video-*`` flags of ``args`` as the trainer applies them (a family without one refuses video records,
    and the flags, naming them), the tokenizer of ``hf_folder`` where it has one, else the byte-level tokenizer
    or OMNIBAL_TOKENIZER."""
    import os

    from megatron.vlm.data.images import MediaOverrides, TileImages
    from megatron.vlm.data.records import ReaderConfig
    from megatron.vlm.data.tokenizer import build_tokenizer
    from megatron.vlm.data.video_sampling import VideoOverrides
    from megatron.vlm.stage.components import runtime_family
    from megatron.vlm.hf.convert import has_tokenizer
    from omnibal_ext.model.units import family_of

    media = MediaOverrides(max_num_tiles=args.max_num_tiles, min_num_tiles=args.min_num_tiles,
                           min_pixels=args.min_pixels, max_pixels=args.max_pixels, video=VideoOverrides.from_args(args))
    video_flags = media.video.given()
    videos = None
    if spec is None:
        images, image_tokens = TileImages(**dict(PUBLISHED_TILES, max_num_tiles=args.max_num_tiles),
                                          min_num_tiles=args.min_num_tiles), None
    else:
        data = runtime_family(spec).data
        images, image_tokens = data.image_rule(media, spec, hf_folder), data.image_tokens
        if family_of(spec).capabilities.video and data.video_rule is not None:
            videos = data.video_rule(media, spec, hf_folder)
    if videos is None and video_flags:
        who = "no model (--model or --hf-checkpoint)" if spec is None else f"model family {spec.family}"
        raise UserError(f"{', '.join(video_flags)}: {who} reads no videos; drop the flag")
    folder = hf_folder if hf_folder and has_tokenizer(hf_folder) else os.environ.get("OMNIBAL_TOKENIZER")
    tokenizer = build_tokenizer(folder, **({"image_tokens": image_tokens} if image_tokens else {}))
    return tokenizer, ReaderConfig(images=images, videos=videos), images.unit


def scan_records(paths, spec, hf_folder: str | None, args: argparse.Namespace) -> list[list[dict]]:
    """The stats records (``megatron.vlm.data.stats.image_stats_records``) of each meta JSON or annotation JSONL
    of ``paths``, scanned (validated) by :func:`data_reader`'s reader."""
    from megatron.vlm.data.records import scan_annotations
    from megatron.vlm.data.stats import image_stats_records

    tokenizer, config, unit = data_reader(spec, hf_folder, args)
    return [image_stats_records(scan_annotations(path, tokenizer, config, progress=True), unit) for path in paths]


def write_scanned_stats(args) -> int:
    """``omnibal isf stats --stats DATA... --write OUT``: each meta JSON or annotation JSONL of ``args.stats``
    scanned (validated) by the trainer's reader with the model's family data side (``--hf-checkpoint``: its
    config, tokenizer and image processor; ``--model``: a preset with the byte-level tokenizer or
    OMNIBAL_TOKENIZER; neither: the 448 px tiles of ``PUBLISHED_TILES``), its videos by the family's video rule
    with the ``--video-*`` flags as the trainer applies them (a family without one refuses video records, and
    the flags), written to OUT as ``[{"vit_num", "token_num", "images": [{"width", "height", "tiles" | "patches"}],
    "videos": [{"frames", "width", "height", "patches", "temporal"}]}]`` (``videos`` where the data has any);
    returns the samples."""
    from megatron.vlm.data.stats import write_json
    from omnibal_ext.cli import data_files
    from omnibal_ext.model.units import get_preset

    hf = args.hf_checkpoint
    spec = model_from_hf(hf) if hf else get_preset(args.model) if args.model else None
    records = [r for part in scan_records(data_files(args.stats, "--stats"), spec, hf, args) for r in part]
    write_json(records, args.write)
    print(f"wrote the stats of {len(records)} samples to {args.write}")
    return len(records)


def load_stats_or_meta(paths, flag: str = "--stats", spec=None, args: argparse.Namespace | None = None,
                       hf_folder: str | None = None):
    """Stats files or meta JSONs (read by :func:`scan_metas`): ``omnibal_ext.cli.load_stats_or_meta``."""
    return planner_cli.load_stats_or_meta(paths, flag, spec, scan_metas, args, hf_folder)


def model_from_hf(folder: str):
    """The ModelSpec of a Hugging Face folder's config.json (``omnibal plan --hf-checkpoint``)."""
    import os

    from megatron.vlm.hf.configs import read_config, spec_from_config

    spec, _ = spec_from_config(read_config(folder), "hf:" + os.path.basename(os.path.normpath(folder)),
                               os.path.join(folder, "config.json"))
    return spec


def build_parser() -> argparse.ArgumentParser:
    return planner_cli.build_parser(scan_metas, model_from_hf,
                                    more_commands=(add_profile_parser, add_hf_parser, add_generate_parser,
                                                   add_serve_parser, add_eval_parser, add_data_parser),
                                    write_stats=write_scanned_stats)


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal generate``: ``megatron.vlm.inference.cli`` (its parser is torch-free; the model is built when it runs)."""
    from megatron.vlm.inference.cli import add_generate_parser as add

    return add(subparsers)


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal profile --json OUT [trainer flags]``: measure every unit on this machine.

    Runs pretrain_vlm.py's profiler in this process (a world of one) for the model the trainer
    flags describe, at the micro-batch shape training would use, and writes the profile JSON. An MoE model's
    profile also holds the expert load of the first training iteration's micro-batches and its expert-parallel
    imbalance at every EP size (meta "expert_load"; not with an explicit shape, which reads no data), which
    ``omnibal plan --moe-profile`` and the calibrated cost model read.
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
            import pretrain_vlm  # the trainer's entry point (a top-level module beside this one)

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


def add_hf_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal hf import|export``: offline conversion (torch is imported only when one runs)."""
    p = subparsers.add_parser("hf", help="convert Hugging Face checkpoints to and from trainer checkpoints",
                              description="Offline conversion between a Hugging Face folder (config.json + "
                                          "*.safetensors, read by the family whose reader recognizes its config.json) "
                                          "and a trainer checkpoint (torch_dist).")
    sub = p.add_subparsers(dest="hf_command", required=True)
    imp = sub.add_parser("import", help="HF folder -> weights-only trainer checkpoint at iteration 0 "
                                        "(load it with pretrain_vlm.py --load at any TP/PP/layout)")
    imp.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="Hugging Face model folder")
    imp.add_argument("--save", required=True, metavar="CKPT", help="checkpoint folder to write")
    imp.set_defaults(func=_run_hf_import)
    exp = sub.add_parser("export", help="trainer checkpoint (any TP/PP/DP/layout) -> native HF folder that "
                                        "transformers' from_pretrained of its family loads")
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
    from megatron.training.hf_checkpoints import import_hf

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
    from megatron.training.hf_checkpoints import export_hf

    done = export_hf(args.load, args.out, args.ckpt_step, args.dtype)
    print(f"exported iteration {done['iteration']}: {done['tensors']} tensors in {', '.join(done['files'])}"
          + (f", tokenizer from {done['tokenizer']}" if done["tokenizer"] else ", no tokenizer found") + f" -> {args.out}")
    return 0


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """``omnibal data to-energon``: datasets between the trainer's formats (torch is not imported)."""
    p = subparsers.add_parser("data", help="convert training data between the trainer's formats",
                              description="Data conversion for the trainer (see docs/data.md).")
    sub = p.add_subparsers(dest="data_command", required=True)
    conv = sub.add_parser(
        "to-energon", help="meta JSON / annotation JSONL -> Energon WebDataset shards (indexed, with dataset.yaml)",
        description="Write every record of a meta JSON or annotation JSONL (images, videos, conversations and "
                    "messages records) as one Energon sample, in shards indexed with Energon's preparation API, so "
                    "that pretrain_vlm.py --data-path OUT reads it (Energon's savable loader; the same samples as "
                    "the JSONL). A meta JSON of several sources gives one folder per source and OUT/metadataset.yaml "
                    "(blend_epochized, repetitions = repeat_time).")
    conv.add_argument("--data", required=True, metavar="META", help="meta JSON or annotation JSONL")
    conv.add_argument("--out", required=True, metavar="DIR", help="the Energon dataset folder to write")
    conv.add_argument("--layout", choices=["omnibal", "bridge"], default="omnibal",
                      help="omnibal: <key>.record.json (the record, media as members img0.jpg, vid0.mp4); bridge: "
                           "Megatron-Bridge's ChatMLWebdataset (<key>.conversation.json, <key>.jpgs, "
                           "<key>.video.mp4; one video per record, no clips)")
    conv.add_argument("--split", default="train",
                      help="the split the shards belong to (<split>-shard-NNNNNN.tar; convert a validation set with "
                           "--split val into the same folder)")
    conv.add_argument("--samples-per-shard", type=int, default=1000, help="samples per tar shard")
    conv.add_argument("--workers", type=int, default=1, help="Energon's indexing worker processes")
    conv.add_argument("--skip-bad-samples", action="store_true",
                      help="leave out records that cannot be converted (listed) instead of stopping")
    conv.set_defaults(func=_run_to_energon)
    return p


def _run_to_energon(args) -> int:
    from megatron.vlm.data.energon.convert import to_energon

    done = to_energon(args.data, args.out, layout=args.layout, split=args.split,
                      samples_per_shard=args.samples_per_shard, skip_bad=args.skip_bad_samples, workers=args.workers)
    for line in done.skipped:
        print(f"skipped {line}")
    counts = ", ".join(f"{name}: {n}" for name, n in done.samples.items())
    print(f"wrote {sum(done.samples.values())} samples ({counts}) in {done.shards} shard(s), {args.layout} layout, "
          f"split {args.split!r} -> {done.path}" + (f"; {len(done.skipped)} record(s) skipped" if done.skipped else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``omnibal`` with ``argv`` (default: sys.argv[1:]); returns the exit status."""
    return planner_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
