"""Shared helpers of the measured benchmarks: run the trainer under torchrun, read its JSON log,
summarise the steady state, write JSON and print tables.

Timing on a small CPU machine: run PP=2 x DP=1 (two processes, one core each, OMP_NUM_THREADS=1).
More processes than cores time-share the cores, which hides pipeline imbalance (an idle stage gives
its core to a busy one); use ``--dp``/``--tp`` only on machines with a core per process.  Other
load on the machine adds noise: the benchmarks alternate their runs and take medians.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# the published OmniBal stats of ai2d, chartqa and docvqa, shipped gzip-compressed (see its README.md)
STATS_DIR = ROOT / "data" / "omnibal_stats"

from omnibal_ext.plan import trainer_argv  # noqa: E402  (after ROOT is on the path)

import megatron.vlm.families  # noqa: E402,F401  (registers the built-in families)

# The fixed heterogeneous tiny VLM of the measured benchmarks: a ViT layer costs more than an LLM layer
# (as InternViT-6B's 3200-wide layers over 1025 tokens per tile against InternLM2-20B's per-token cost),
# so Megatron's default layout (whole ViT on stage 0) is unbalanced.  32 px tiles, 8 px patches:
# 17 ViT tokens and 4 LLM image tokens per tile.  At a packed micro-batch of 4 stats-matched samples
# (~16 tiles, ~550 LLM tokens) a ViT layer (192 wide, MLP 768) costs about 1.4x an LLM layer
# (64 wide, 4 heads, 2 KV groups, SwiGLU 192) on a CPU core (17.8 vs 13.1 ms forward + backward).
HETERO_MODEL = {
    "--vision-num-layers": 6, "--vision-hidden-size": 192, "--vision-num-attention-heads": 4,
    "--vision-ffn-hidden-size": 768,
    "--num-layers": 6, "--hidden-size": 64, "--num-attention-heads": 4, "--num-query-groups": 2,
    "--ffn-hidden-size": 192,
}
ITER_KEY = "elapsed time per iteration (ms)"

# The paper's 6B+20B ablation as its authors ran it.  Their published run configuration for the
# table's balanced rows (ModelTC/EasyLLM, scripts/megatron-lm/table2_data_model_memory_balanced_0906.yaml)
# sets tensor parallel 4 and pipeline 4 (DP 8 on the paper's 128 GPUs) and a global batch of 128
# micro-batches of one packed group each: 16 micro-batches per pipeline per iteration.  Our planner's
# micro-batch is a group of K samples, so those 16 micro-batches per pipeline are 16 * DP * K samples.
PAPER_GPUS = 128
PAPER_TP, PAPER_PP = 4, 4
PAPER_MICROBATCHES_PER_PIPELINE = 16
PAPER_SAMPLES_PER_GROUP = 4  # K (assumed: the paper's groups are packed, their sample count varies)
PAPER_GLOBAL_BATCH = (PAPER_MICROBATCHES_PER_PIPELINE * (PAPER_GPUS // (PAPER_TP * PAPER_PP))
                      * PAPER_SAMPLES_PER_GROUP)  # samples per iteration (512)


def planner_inputs():
    """(precision, distributed optimizer) the trainer plans with in the measured benchmarks on CPU
    (megatron/training/setup.py: fp32 parameters, gradients and Adam state; the benchmarks do not pass
    --use-distributed-optimizer)."""
    from omnibal_ext.memory.memory_model import FP32_ADAM

    return FP32_ADAM, False


def hetero_spec():
    """The ModelSpec of HETERO_MODEL (the trainer's own flag handling)."""
    from megatron.training.flags import build_parser
    from megatron.training.specs import model_spec_from_flags

    return model_spec_from_flags(build_parser().parse_args(trainer_argv(HETERO_MODEL)))


def stats_files(stats_dir: str | os.PathLike | None = None) -> list[str]:
    """The stats files (``*.json`` and ``*.json.gz``, sorted) of ``stats_dir`` (default: the shipped ones)."""
    folder = Path(stats_dir or STATS_DIR)
    files = sorted(str(p) for pattern in ("*.json", "*.json.gz") for p in folder.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no stats files (*.json, *.json.gz) in {folder}")
    return files


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and to ``bind(0)`` (Linux's default where unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A port free now on 127.0.0.1, for a rendezvous the caller's processes bind soon after.

    Drawn at random below the ephemeral range: a port from ``bind(0)`` is ephemeral, so the many gloo connections
    of other runs on the machine can take it between this check and the bind (EADDRINUSE); these cannot."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(20000, 32768) if p not in ephemeral] or list(range(20000, 32768))
    for port in random.SystemRandom().sample(candidates, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port among 64 drawn in 20000-32767")


# set by an in-process process group (a test, a notebook); a child must pick its own
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def trainer_env(threads: int = 1) -> dict:
    """This process's environment for a trainer child: project on PYTHONPATH, no inherited rendezvous."""
    e = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = str(threads)
    e.setdefault("PYTHONWARNINGS", "ignore")
    return e


@dataclass
class RunResult:
    """One trainer run: its iteration records, the final memory record (or None) and its output."""

    name: str
    flags: list[str]
    records: list[dict]
    memory: dict | None
    output: str
    wall_s: float
    returncode: int
    layout_flag: str | None = None  # "> model ... layout X," of the run
    recompute_flag: str | None = None  # "> omnibal recompute: plan X" (adaptive runs)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error_tail(self, chars: int = 3000) -> str:
        return self.output[-chars:]


def launch_ranks(cmd: list[str], nproc: int, workdir: Path, env: dict, timeout: float) -> tuple[int, str]:
    """``python *cmd`` as ``nproc`` ranks of one world on this host (the environment torchrun gives its workers:
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without torchrun's agent: it costs
    a Python process importing torch per launch.  As torchrun does, the first rank to fail stops the others.
    Returns (the first nonzero exit code or 0, the ranks' stdout and stderr in rank order)."""
    port = str(free_port())
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(nproc)]
    procs = [subprocess.Popen([sys.executable, "-u", *cmd], cwd=workdir, stdout=f, stderr=subprocess.STDOUT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r, f in enumerate(logs)]
    deadline, failed = time.monotonic() + timeout, 0
    try:
        while any(p.poll() is None for p in procs):
            failed = next((p.returncode for p in procs if p.returncode), 0)
            if failed:  # a rank failed: the others would wait on it
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        failed = failed or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for f in logs:
        f.seek(0)
        out.append(f.read())
        f.close()
    return failed, "".join(out)


SERVING_LINE = re.compile(r"^omnibal serve: (\S+) at (http://\S+)/v1 ", re.M)


@dataclass
class Served:
    """A running ``omnibal serve``: its base ``url``, the model ``name`` it serves, its ranks' processes and logs."""

    url: str
    name: str
    procs: list[subprocess.Popen]
    logs: list[Path]

    def output(self, chars: int = 3000) -> str:
        return "\n".join(log.read_text()[-chars:] for log in self.logs)

    def stop(self, timeout: float = 120) -> list[int]:
        """SIGTERM every rank (as torchrun forwards a Ctrl-C); their exit codes."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        return [p.wait(timeout=timeout) for p in self.procs]


@contextlib.contextmanager
def serving(flags: list[str], workdir: str | os.PathLike, nproc: int = 2, timeout: float = 900, threads: int = 1):
    """``omnibal serve --port 0 *flags`` as ``nproc`` ranks of one world on this host (started as torchrun starts
    them, its logs in ``workdir``); yields a ``Served`` once rank 0 listens, and kills what is left on exit."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env, port = trainer_env(threads), str(free_port())
    logs = [workdir / f"serve.rank{r}.log" for r in range(nproc)]
    files = [open(log, "w") for log in logs]
    procs = [subprocess.Popen([sys.executable, "-u", str(ROOT / "omnibal_cli.py"), "serve", "--port", "0", *flags],
                              cwd=workdir, stdout=f, stderr=subprocess.STDOUT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r, f in enumerate(files)]
    served = Served("", "", procs, logs)
    deadline = time.monotonic() + timeout
    try:
        while not (found := SERVING_LINE.search(logs[0].read_text())):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"omnibal serve did not start:\n{served.output()}")
            time.sleep(0.2)
        served.name, served.url = found.group(1), found.group(2)
        yield served
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()


def run_trainer(flags: list[str], workdir: str | os.PathLike, name: str, nproc: int = 2, timeout: int = 3600,
                check: bool = True, threads: int = 1, torchrun_flags: tuple[str, ...] = (),
                env: dict | None = None) -> RunResult:
    """``pretrain_vlm.py --json-log workdir/name.jsonl *flags`` on ``nproc`` ranks (``env``: extra environment
    variables): under torchrun with ``torchrun_flags`` (restarts), else the ranks started directly
    (``launch_ranks``: no agent process)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.jsonl"
    if log.exists():
        log.unlink()
    cmd = [str(ROOT / "pretrain_vlm.py"), "--json-log", str(log), *flags]
    env = {**trainer_env(threads), **(env or {})}
    t0 = time.perf_counter()
    if torchrun_flags:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *torchrun_flags,
                               *cmd], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, out = proc.returncode, proc.stdout + proc.stderr
    else:
        returncode, out = launch_ranks(cmd, nproc, workdir, env, timeout)
    result = read_run(name, flags, workdir, returncode, out, time.perf_counter() - t0)
    if check and returncode != 0:
        raise RuntimeError(f"trainer run {name} failed ({returncode}):\n{result.error_tail()}")
    return result


def read_run(name: str, flags: list[str], workdir: str | os.PathLike, returncode: int, output: str,
             wall_s: float) -> RunResult:
    """The RunResult of the finished run ``name`` (its log ``workdir/name.jsonl``, its output, which is also written
    to ``workdir/name.out``)."""
    workdir = Path(workdir)
    (workdir / f"{name}.out").write_text(output)
    log = workdir / f"{name}.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    records = [r for r in lines if not r.get("prefix")]
    memory = next((r for r in lines if r.get("prefix") == "memory "), None)
    m = re.search(r"> model .*?layout (\S+),", output)
    rc = re.search(r"> omnibal recompute: plan (\S+) for a budget", output)
    return RunResult(name, list(flags), records, memory, output, wall_s, returncode,
                     m.group(1) if m else None, rc.group(1) if rc else None)


def steady(records: list[dict], warmup: int) -> list[dict]:
    """The iterations after ``warmup`` (all but the last one if there are no more)."""
    if not records:
        raise ValueError("no iteration records")
    w = min(warmup, len(records) - 1)
    return records[w:]


def steady_ms(records: list[dict], warmup: int) -> float:
    """Median ms per iteration after ``warmup`` iterations."""
    return float(np.median([r[ITER_KEY] for r in steady(records, warmup)]))


def alternate_runs(variants: dict[str, list[str]], repeats: int, workdir, prefix: str, nproc: int,
                   warmup: int) -> dict[str, list[RunResult]]:
    """Each variant's flags run ``repeats`` times, the variants alternating within each repeat (so a
    change in the shared machine's load hits all of them alike); runs are named prefix_variant_repeat."""
    runs: dict[str, list[RunResult]] = {name: [] for name in variants}
    for rep in range(repeats):
        for name, flags in variants.items():
            r = run_trainer(flags, workdir, f"{prefix}_{name}_{rep}", nproc=nproc)
            runs[name].append(r)
            print(f"  {name} run {rep}: median {steady_ms(r.records, warmup):.1f} ms/iter, layout {r.layout_flag}"
                  + (f", plan {r.recompute_flag}" if r.recompute_flag else ""), flush=True)
    return runs


def pooled_steady(runs: list[RunResult], warmup: int) -> list[dict]:
    """The steady iterations of all ``runs`` together."""
    return [r for run in runs for r in steady(run.records, warmup)]


def pooled_ms(runs: list[RunResult], warmup: int) -> float:
    """Median ms per iteration over the steady iterations of all ``runs`` together."""
    return float(np.median([r[ITER_KEY] for r in pooled_steady(runs, warmup)]))


def rates(st: list[dict]) -> dict:
    """Speed of steady iterations ``st``: ``ms_per_iter`` their median, ``samples_per_s`` /
    ``tokens_per_s`` / ``images_per_s`` samples (real LLM tokens, ViT tiles) over their summed time."""
    secs = np.array([r[ITER_KEY] / 1e3 for r in st])
    return {"ms_per_iter": float(np.median(secs) * 1e3),
            "samples_per_s": float(sum(r["global batch size"] for r in st) / secs.sum()),
            "tokens_per_s": float(sum(r["tokens/s"] * r[ITER_KEY] / 1e3 for r in st) / secs.sum()),
            "images_per_s": float(sum(r["images/s"] * r[ITER_KEY] / 1e3 for r in st) / secs.sum())}


def pooled_rates(runs: list[RunResult], warmup: int) -> dict:
    """``rates`` of several runs of one variant together, and how many runs."""
    return {"runs": len(runs), **rates(pooled_steady(runs, warmup))}


def summarize(records: list[dict], warmup: int) -> dict:
    """Steady-state and whole-run numbers of one run.

    ms_per_iter: median ms/iteration after the warm-up; samples_per_s / tokens_per_s / images_per_s:
    samples (real LLM tokens, ViT tiles) of the steady iterations over their summed time;
    tokens_seen / samples_seen / tiles_seen: totals over ALL iterations (tokens and tiles from the
    log's per-second rates times the iteration time); pad/dist ratios: means over all iterations.
    """
    st = steady(records, warmup)
    secs = np.array([r[ITER_KEY] / 1e3 for r in st])
    tokens = np.array([r["tokens/s"] * r[ITER_KEY] / 1e3 for r in st])
    tiles = np.array([r["images/s"] * r[ITER_KEY] / 1e3 for r in st])
    samples = np.array([r["global batch size"] for r in st], dtype=float)
    # per iteration the trainer logs count / elapsed and elapsed: their product is the integer count
    all_tokens = sum(round(r["tokens/s"] * r[ITER_KEY] / 1e3) for r in records)
    all_tiles = sum(round(r["images/s"] * r[ITER_KEY] / 1e3) for r in records)
    mean = lambda k: float(np.mean([r[k] for r in records if r.get(k) is not None])) if any(  # noqa: E731
        r.get(k) is not None for r in records) else None
    return {
        "iterations": len(records), "steady_iterations": len(st), **rates(st),
        "ms_per_iter_mean": float(secs.mean() * 1e3), "ms_per_iter_min": float(secs.min() * 1e3),
        "samples_per_iter": float(samples.mean()), "tokens_per_iter": float(tokens.mean()),
        "tiles_per_iter": float(tiles.mean()),
        "samples_seen": int(records[-1]["consumed samples"]), "tokens_seen": int(round(all_tokens)),
        "tiles_seen": int(round(all_tiles)), "epoch_s": float(sum(r[ITER_KEY] for r in records) / 1e3),
        "pad_ratio": mean("pad ratio"), "dist_ratio_llm": mean("dist ratio llm"),
        "dist_ratio_vit": mean("dist ratio vit"), "final_loss": records[-1].get("lm loss"),
    }


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


def write_json(path: str | os.PathLike, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=_json_default))


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table: ``columns`` = (header, key, format spec); missing values print as '-'."""
    cells = []
    for r in rows:
        line = []
        for _, key, spec in columns:
            v = r.get(key)
            line.append("-" if v is None else (format(v, spec) if spec else str(v)))
        cells.append(line)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (h, _, _) in enumerate(columns)]
    out = ["  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(out)


def mib(x) -> str:
    return "[" + ", ".join(f"{b / 2**20:.2f}" for b in x) + "]" if x is not None else "-"


@dataclass
class DataSet:
    """A built stats-matched dataset and what the benchmarks need to know about it."""

    meta: str
    num_samples: int
    tokens: np.ndarray  # per sample, LLM tokens
    tiles: np.ndarray  # per sample, ViT tiles
    seq_length: int  # --seq-length that fits every sample
    info: dict = field(default_factory=dict)


MAX_SAMPLE_TOKENS = 512  # the stats-matched data's tail is cut here (see megatron/vlm/data/synthetic.py)


def build_data(out_dir: str | os.PathLike, num_samples: int, tile_size: int, tokens_per_tile: int,
               stats_dir=None, seed: int = 0, max_tokens: int | None = MAX_SAMPLE_TOKENS) -> DataSet:
    """Build (or reuse) the stats-matched synthetic dataset of ``num_samples`` samples."""
    from megatron.vlm.data.synthetic import LengthRule, build_stats_matched_dataset, sample_plan

    files = stats_files(stats_dir)
    rule = LengthRule(tokens_per_tile_model=tokens_per_tile, max_tokens=max_tokens)
    folder = Path(out_dir) / f"stats_matched_{num_samples}_{tile_size}px_seed{seed}_max{max_tokens}"
    meta = build_stats_matched_dataset(files, str(folder), num_samples, tile_size,
                                       tokens_per_tile_model=tokens_per_tile, seed=seed, max_tokens=max_tokens)
    plan = sample_plan(files, num_samples, rule, seed)
    seq = int(-(-int(plan["tokens"].max()) // 64) * 64)
    return DataSet(meta, num_samples, plan["tokens"], plan["tiles"], seq,
                   {"stats_files": [os.path.basename(f) for f in files], "text_scale": rule.text_scale, "max_tokens": max_tokens,
                    "tokens_mean": float(plan["tokens"].mean()), "tokens_max": int(plan["tokens"].max()),
                    "tiles_mean": float(plan["tiles"].mean())})


# Videos of the video and image mix (``write_video_mix``): small H.264 files (width, height px), 1-8 s at 6-30 fps.
# Without a Hugging Face folder the Qwen2-VL video processor's defaults hold: every frame is enlarged to at least
# 128 x 28 x 28 px (about 560 patches, 140 LLM tokens per temporal patch), so the mix samples 1 frame per second,
# 2 to 6 frames (1 to 3 temporal patches): VIDEO_FLAGS.
VIDEO_SIZES = ((64, 48), (96, 64), (112, 84))
VIDEO_SECONDS = (1, 2, 3, 4, 6, 8)
VIDEO_FPS = (6, 12, 24, 30)
VIDEO_FLAGS = {"--video-fps": 1, "--video-min-frames": 2, "--video-max-frames": 6}
VIDEO_TEXT_BYTES = 160  # most text bytes of a video sample (its video is up to 420 LLM tokens)
VIDEO_SEQ_LENGTH = 768  # --seq-length the mix's samples are written within (checked by the trainer's scan)


def write_video_mix(folder: str | os.PathLike, num_samples: int, image_px: int, stats_dir=None, seed: int = 0,
                    video_share: float = 0.25, num_videos: int = 24) -> str:
    """Write (or reuse) a ``messages`` JSONL of ``num_samples`` samples mixing H.264 videos and images; returns its
    path.  Samples follow the stats-matched plan (``synthetic.sample_plan``: ``vit_num`` square ``image_px`` px
    images, the plan's text length in bytes), except a seeded ``video_share`` of them, which hold one video (of a
    pool of ``num_videos`` written with PyAV: VIDEO_SIZES x VIDEO_SECONDS x VIDEO_FPS, seeded) and the same text.
    The trainer's scan gives the samples' real tokens and ViT items (``trainer_isf_data``)."""
    from PIL import Image

    from megatron.vlm.data.synthetic import LengthRule, sample_plan
    from megatron.vlm.data.video_synthetic import write_coded_video

    folder = Path(folder) / f"video_mix_{num_samples}_{image_px}px_seed{seed}_share{video_share}"
    path = folder / "train.jsonl"
    if path.exists():
        return str(path)
    plan = sample_plan(stats_files(stats_dir), num_samples, LengthRule(max_tokens=MAX_SAMPLE_TOKENS), seed)
    rng = np.random.default_rng([seed, 11])
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    (tmp / "images").mkdir()
    (tmp / "videos").mkdir()
    for p in range(16):
        Image.fromarray(rng.integers(0, 256, (image_px, image_px, 3), dtype=np.uint8)).save(tmp / f"images/{p:02d}.png")
    for v in range(num_videos):
        width, height = VIDEO_SIZES[v % len(VIDEO_SIZES)]
        seconds, fps = int(rng.choice(VIDEO_SECONDS)), int(rng.choice(VIDEO_FPS))
        write_coded_video(str(tmp / f"videos/{v:02d}.mp4"), seconds * fps, fps, width, height)
    is_video = rng.random(num_samples) < video_share
    text_bytes = LengthRule(max_tokens=MAX_SAMPLE_TOKENS).text_tokens(plan["vit_num"], plan["token_num"]) - 22
    lines = []
    for i in range(num_samples):
        free = max(1, int(min(text_bytes[i], VIDEO_TEXT_BYTES) if is_video[i] else text_bytes[i]))
        answer = "".join(rng.choice(list("abcdefgh "), size=1 + free // 4))
        question = "".join(rng.choice(list("abcdefgh "), size=max(1, free - len(answer))))
        record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        if is_video[i]:
            record["messages"][0]["content"] = "<video>" + question
            record["videos"] = [f"videos/{int(rng.integers(num_videos)):02d}.mp4"]
        elif plan["vit_num"][i]:
            k = int(plan["vit_num"][i])
            record["messages"][0]["content"] = "<image>" * k + question
            record["images"] = [f"images/{int(j):02d}.png" for j in rng.integers(0, 16, size=k)]
        lines.append(json.dumps(record) + "\n")
    (tmp / "train.jsonl").write_text("".join(lines))
    tmp.rename(folder)
    return str(path)


def trainer_isf_data(flags: list[str], world: int) -> tuple[np.ndarray, np.ndarray, int, dict]:
    """(tokens int64 [N], ViT items int64 [N], ISF groups, ViT segment sums) of the training set of the trainer
    flags ``flags`` for ``world`` processes, as the trainer finds them: its argument checks, tokenizer, dataset
    scan (the family's image and video rules) and ISF plan (``megatron/training/isf.py``: in predicted time for a
    native-resolution family), run in this process without a process group.  The segment sums
    {"vit_full_sq", "vit_window_sq", "videos"}: the whole set's squared full-attention and window segment lengths
    (patches^2; a video one segment per temporal patch, ``sample_time.sample_work``) and its video count."""
    from megatron.training import isf, setup
    from megatron.training.arguments import parse_config
    from megatron.training.tokenizer_setup import setup_tokenizer
    from omnibal_ext.model.sample_time import sample_work

    config = parse_config(flags, world)
    tokenizer, spec = setup_tokenizer(config)
    dataset = setup.build_dataset(config, spec, tokenizer, config.data.data_path)
    tokens, items = dataset.sample_lengths()
    stats = dataset.sample_stats()
    work = sample_work(stats, spec, grids=dataset.image_grids())
    sums = {"vit_full_sq": float(work.vit_full_sq.sum()), "vit_window_sq": float(work.vit_window_sq.sum()),
            "videos": 0 if stats.videos is None else int(len(stats.videos.patches))}
    return tokens, items, len(isf.search_isf(config, spec, dataset).grouping), sums
