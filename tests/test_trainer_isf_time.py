"""The trainer's --omnibal-isf plans in predicted time for Qwen2.5-VL: its groups are ISF in time run one sample at
a time (tests/isf_reference.py) with the thresholds it found, on the times of the stats ``omnibal isf stats
--write`` writes of the same data (each image's patch grid recovered by ``patch_grid`` there, read from the scan
in the trainer), and the time DistRatio it prints is the definition's over those groups; InternVL data is still
grouped by counts."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sklearn")
import hf_tiny_qwen  # noqa: E402
from isf_reference import dist_ratio, reference_isf  # noqa: E402

from megatron.training.flags import ArgumentError, build_parser  # noqa: E402
from megatron.training.isf import isf_groups, isf_subset_groups, isf_times  # noqa: E402
from megatron.training.specs import run_config  # noqa: E402
from megatron.vlm.data import RecordDataset, TileImages  # noqa: E402
from megatron.vlm.data.tokenizer import build_tokenizer  # noqa: E402
from megatron.vlm.lineages.qwen.data import IMAGE_TOKENS, image_rule  # noqa: E402
from omnibal_ext.data.isf import ISFParams  # noqa: E402
from omnibal_ext.data.metrics import step_balance_time  # noqa: E402
from omnibal_ext.data.search import SearchConfig, run_isf, step_matrix_epoch0  # noqa: E402
from omnibal_ext.data.stats import load_stats  # noqa: E402
from omnibal_ext.model.cost_model import get_device  # noqa: E402
from omnibal_ext.model.sample_time import ISF_TIME_DEVICE, sample_time_units  # noqa: E402
from omnibal_ext.model.units import get_preset  # noqa: E402

MAX_PIXELS = 28 * 28 * 40
DP, K, SEED = 2, 4, 5


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def config_for(token_multiple: int = 1, **flags):
    """The run configuration ISF reads: DP ranks, K samples per group, seed SEED, tokens counted to
    ``token_multiple``, with the flags ``flags`` (``omnibal_isf_qv=8``: ``--omnibal-isf-qv 8``)."""
    argv = ["--micro-batch-size", str(K), "--seed", str(SEED), "--omnibal-isf",
            "--omnibal-isf-token-multiple", str(token_multiple)]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return run_config(build_parser().parse_args(argv), DP)


def isf_of(config, spec, dataset):
    """The trainer's ISF groups (``isf_groups``) as (groups, order, params as a dict, mean group)."""
    found = isf_groups(config, spec, dataset)
    return found.groups, found.order, found.params.to_dict(), found.mean_group

def qwen_data(tmp_path):
    """A tiny Hugging Face folder (config, tokenizer, image limits) and a messages JSONL of photos of several
    sizes, one or two per sample, and text-only samples."""
    folder = tmp_path / "hf"
    folder.mkdir()
    hf_tiny_qwen.write_tokenizer(folder)
    hf_tiny_qwen.hf_config().save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": MAX_PIXELS}))
    (tmp_path / "images").mkdir()
    pics = hf_tiny_qwen.photos(tmp_path / "images")
    rng = np.random.default_rng(0)
    lines = []
    for k in range(48):
        n = int(rng.integers(0, 3))
        chosen = [pics[int(i)] for i in rng.integers(0, len(pics), n)]
        answer = " ".join(s for _, s in chosen) + "x" * int(rng.integers(1, 60))
        lines.append({"messages": [{"role": "user", "content": "<image>" * n + "Say?"},
                                   {"role": "assistant", "content": answer}],
                      "images": [f"images/{name}" for name, _ in chosen]})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder, path


def test_qwen_isf_groups_in_time_as_omnibal_ext_does(tmp_path, world, capsys):
    from omnibal_cli import main as omnibal
    from omnibal_cli import model_from_hf

    folder, data = qwen_data(tmp_path)
    spec = model_from_hf(str(folder))
    args = config_for()
    dataset = RecordDataset(str(data), build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS),
                            image_rule(args.data.media, spec, str(folder)))
    groups, order, params, _ = isf_of(args, spec, dataset)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("> ISF:")][0]

    # independently: the written stats, each image's grid recovered from its size and patch count
    out = tmp_path / "stats.json"
    assert omnibal(["isf", "stats", "--stats", str(data), "--hf-checkpoint", str(folder), "--write", str(out)]) == 0
    stats = load_stats([str(out)])
    times = sample_time_units(stats, spec, get_device(ISF_TIME_DEVICE))
    assert len(np.unique(times[0])) > 3  # images of several sizes
    cfg = SearchConfig(dp_size=DP, samples_per_group=K, seed=SEED, time_budget_s=math.inf)
    assert params["vit_time"] is not None and params["llm_time"] is not None
    assert [g.tolist() for g in groups] == reference_isf(stats.patches, stats.tokens, params, SEED, times)
    assert sorted(order.tolist()) == list(range(len(groups)))
    # under CP ISF counts every sample padded to the multiple (2 x CP): its tokens and LLM times
    groups_cp, _, params_cp, _ = isf_of(config_for(token_multiple=4), spec, dataset)
    padded = -(-stats.tokens // 4) * 4
    assert not np.array_equal(padded, stats.tokens)
    times_cp = sample_time_units(dataclasses.replace(stats, tokens=padded), spec, get_device(ISF_TIME_DEVICE))
    assert [g.tolist() for g in groups_cp] == reference_isf(stats.patches, padded, params_cp, SEED, times_cp)
    assert not all(np.array_equal(a, b) for a, b in zip(times_cp, times))  # the padded tokens cost LLM time
    capsys.readouterr()

    # by counts the same data groups otherwise (what the time plan changes)
    counts = run_isf(stats.patches, stats.tokens, cfg)
    assert [g.tolist() for g in counts.grouping.groups()] != [g.tolist() for g in groups]

    # the time DistRatio printed: the definition's, of the groups' summed sample times over the steps served
    vt, lt = (np.array([t[g].sum() for g in groups], dtype=np.float64) for t in times)
    steps = step_matrix_epoch0(len(groups), DP, order, SEED)
    assert (f"in time: dist ratio llm {dist_ratio(lt[steps]):.4f} vit {dist_ratio(vt[steps]):.4f} "
            f"total {dist_ratio((vt + lt)[steps]):.4f}, ") in line

    # fixed caps (as `omnibal plan` prints them): hard count caps, the time thresholds searched under them
    qv, qt = int(stats.patches.max()) + 8, int(stats.tokens.max()) + 40
    fixed = config_for(omnibal_isf_qv=qv, omnibal_isf_qt=qt)
    groups_fixed, _, params_fixed, _ = isf_of(fixed, spec, dataset)
    assert [g.tolist() for g in groups_fixed] == reference_isf(stats.patches, stats.tokens, params_fixed, SEED, times)
    assert params_fixed["qv"] <= qv and params_fixed["qt"] <= qt and params_fixed["vit_time"] is not None
    assert max(int(stats.tokens[g].sum()) for g in groups_fixed) <= qt < params["qt"]
    capsys.readouterr()

    # the regroup of a DP change groups a subset in time with the run's caps
    tokens, _ = dataset.sample_lengths()
    items, trainer_times = isf_times(args, dataset, spec, tokens)
    assert all(np.array_equal(a, b) for a, b in zip(trainer_times, times))
    ids = np.arange(10, 40)
    sub, _ = isf_subset_groups(tokens, items, ids, ISFParams(**params), 3, SEED, trainer_times)
    want = reference_isf(items[ids], tokens[ids], params, SEED, tuple(t[ids] for t in trainer_times))
    assert [g.tolist() for g in sub] == [ids[g].tolist() for g in want]
    assert max(int(trainer_times[1][g].sum()) for g in sub) <= params["llm_time"]


def test_qwen_isf_applies_a_plans_time_thresholds_without_a_search(tmp_path, world, monkeypatch):
    """`omnibal plan` on the data's stats; the trainer given its flags (what --omnibal-plan applies) groups with the
    plan's thresholds as given, the groups the plan made, and searches nothing."""
    import omnibal_ext.data.search_time as search_time
    from megatron.training.flags import build_parser
    from megatron.training.validation import check_isf_flags
    from omnibal_cli import main as omnibal
    from omnibal_cli import model_from_hf
    from omnibal_ext.plan import PlanConfig, make_plan
    from omnibal_ext.plan.data_level import isf_for_ranks
    from omnibal_ext.plan.trainer_flags import trainer_argv

    folder, data = qwen_data(tmp_path)
    spec = model_from_hf(str(folder))
    dataset = RecordDataset(str(data), build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS),
                            image_rule(config_for().data.media, spec, str(folder)))
    out = tmp_path / "stats.json"
    assert omnibal(["isf", "stats", "--stats", str(data), "--hf-checkpoint", str(folder), "--write", str(out)]) == 0
    stats = load_stats([str(out)])
    config = PlanConfig(model=spec, gpus=DP, tp=1, pp=1, dp=DP, device="h100-80g", gpu_memory_bytes=80 * 2**30,
                        samples_per_group=K, global_batch_size=K * DP, sim_iterations=1, max_vpp=1, seed=SEED)
    plan = make_plan(stats, config)
    params = ISFParams(**plan.isf["params"])
    assert params.timed and plan.trainer_flags["--omnibal-isf-time-device"] == "h100-80g"
    flags = {"--hf-checkpoint": str(folder), **{k: v for k, v in plan.trainer_flags.items() if k != "--model"}}
    args = build_parser().parse_args(trainer_argv(flags) + ["--seed", str(SEED)])  # as `omnibal plan --hf-checkpoint`
    check_isf_flags(args)

    # independently: ISF in time with the plan's params on the samples' times on the plan's device, no search
    times = sample_time_units(stats, spec, get_device("h100-80g"))
    want = reference_isf(stats.patches, stats.tokens, params.to_dict(), SEED, times)
    planned = isf_for_ranks(stats.in_vision_items("patch"), DP, config, 1, 1).grouping.groups()

    def no_search(*a, **k):
        raise AssertionError("the trainer searched thresholds although the plan gives them")
    monkeypatch.setattr(search_time, "search_params_time", no_search)
    groups, order, got, _ = isf_of(run_config(args, DP), spec, dataset)
    assert got == params.to_dict()
    assert [g.tolist() for g in groups] == want == [g.tolist() for g in planned]
    assert sorted(order.tolist()) == list(range(len(groups)))
    # without the time thresholds the trainer searches (as it does without a plan)
    searched = build_parser().parse_args(trainer_argv({k: v for k, v in flags.items()
                                                       if "time" not in k and "iters" not in k}))
    with pytest.raises(AssertionError, match="searched thresholds"):
        isf_groups(run_config(searched, DP), spec, dataset)


def test_internvl_isf_groups_stay_by_counts(tmp_path, world, capsys):
    from megatron.vlm.data.digits import build_digits_dataset

    meta = build_digits_dataset(str(tmp_path / "digits"), num_samples=80, seed=0, tile_size=32)
    dataset = RecordDataset(meta, build_tokenizer(None), TileImages(image_size=32, tokens_per_tile=4, max_num_tiles=6))
    spec = get_preset("tiny")
    args = config_for()
    assert isf_times(args, dataset, spec, dataset.sample_lengths()[0]) is None
    groups, order, params, _ = isf_of(args, spec, dataset)
    tokens, tiles = dataset.sample_lengths()
    assert "vit_time" not in params and len(np.unique(tiles)) > 3
    assert [g.tolist() for g in groups] == reference_isf(tiles, tokens, params, SEED)  # by counts
    assert sorted(order.tolist()) == list(range(len(groups)))
    assert "in time" not in capsys.readouterr().out
    # time thresholds (a plan in time) for a family grouped by counts: refused, naming the flags
    timed = config_for(omnibal_isf_qv=99, omnibal_isf_qt=9999, omnibal_isf_vit_time=5, omnibal_isf_llm_time=5)
    with pytest.raises(ArgumentError, match="--omnibal-isf-vit-time/--omnibal-isf-llm-time: tiny's ViT items cost"):
        isf_groups(timed, spec, dataset)


def test_step_balance_time_sums_each_rank_samples_times():
    times = (np.array([5, 1, 2, 7, 0]), np.array([10, 20, 30, 40, 50]))
    got = step_balance_time([[0, 1], [2, 3, 4]], times)
    llm, vit = np.array([30.0, 120.0]), np.array([6.0, 9.0])  # each rank's sums
    assert got["dist_ratio_llm_time"] == pytest.approx((120 - llm).sum() / (120 * 2))
    assert got["dist_ratio_vit_time"] == pytest.approx((9 - vit).sum() / (9 * 2))


@pytest.mark.slow
def test_qwen_dp2_isf_trains_the_time_plan_and_logs_its_balance(tmp_path, world, capsys):
    """DP2 with --omnibal-isf: the trainer prints the plan computed here, and each iteration's logged Dist ratios in
    time are those of the samples the sampler serves the two ranks (summed predicted times)."""
    from itertools import islice

    from launch import run_training
    from omnibal_cli import model_from_hf
    from omnibal_ext.data.sampler import GroupBatchSampler

    folder, data = qwen_data(tmp_path)
    model = hf_tiny_qwen.make_tiny(folder, seed=3)
    hf_tiny_qwen.set_token_ids(model, hf_tiny_qwen.write_tokenizer(folder))
    model.save_pretrained(str(folder))
    spec = model_from_hf(str(folder))
    args = config_for()
    dataset = RecordDataset(str(data), build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS),
                            image_rule(args.data.media, spec, str(folder)))
    groups, order, _, _ = isf_of(args, spec, dataset)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("> ISF:")][0]
    times = isf_times(args, dataset, spec, dataset.sample_lengths()[0])[1]

    iters, m = 3, 2
    flags = ["--hf-checkpoint", str(folder), "--data-path", str(data), "--omnibal-isf", "--train-iters", str(iters),
             "--micro-batch-size", str(K), "--global-batch-size", str(K * DP * m), "--eval-interval", "0",
             "--seq-length", "1024", "--data-cache-dir", str(tmp_path / "cache"), "--seed", str(SEED)]
    records, out = run_training(DP, flags, tmp_path, "qwen_isf_time")
    assert line in out and len(records) == iters
    served = [list(islice(GroupBatchSampler(groups, DP, r, seed=SEED, order=order, microbatches=m), iters * m))
              for r in range(DP)]
    for i, rec in enumerate(records):
        for key, t in (("dist ratio llm time", times[1]), ("dist ratio vit time", times[0])):
            per_step = []
            for j in range(i * m, (i + 1) * m):
                sums = np.array([t[served[r][j]].sum() for r in range(DP)], dtype=np.float64)
                per_step.append((sums.max() - sums).sum() / (sums.max() * DP))
            assert rec[key] == pytest.approx(np.mean(per_step), abs=1e-12), (i, key)
    assert max(rec["dist ratio vit time"] for rec in records) > 0  # the ranks' images differ


def test_qwen_isf_in_time_counts_videos(tmp_path, world, capsys):
    """A video and image mix (H.264 files of 2-6 s): the trainer's ISF-in-time groups equal ISF in time run on the
    times of the stats `omnibal isf stats --write` writes (each video's temporal patches its attention segments), and
    those times differ from the same patches counted as one image (quadratic per temporal patch, not per video)."""
    from omnibal_cli import main as omnibal
    from omnibal_cli import model_from_hf

    from megatron.vlm.data.video_synthetic import write_coded_video
    from megatron.vlm.lineages.qwen.data import video_rule

    folder, data = qwen_data(tmp_path)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": MAX_PIXELS, "fps": 2.0, "do_sample_frames": True}))
    rng = np.random.default_rng(1)
    lines = data.read_text().splitlines()
    for k in range(0, len(lines), 3):  # every third sample a video instead
        seconds, fps = 2 + k % 5, (6, 12, 24)[k % 3]
        write_coded_video(str(tmp_path / f"v{k}.mp4"), seconds * fps, fps, (64, 96, 128)[k % 3], 48 + 16 * (k % 2))
        lines[k] = json.dumps({"messages": [{"role": "user", "content": "<video>Say?"},
                                            {"role": "assistant", "content": "x" * int(rng.integers(1, 60))}],
                               "videos": [f"v{k}.mp4"]})
    data.write_text("\n".join(lines) + "\n")
    spec = model_from_hf(str(folder))
    args = config_for(video_folder_fps=24.0)
    media = args.data.media
    dataset = RecordDataset(str(data), build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS),
                            image_rule(media, spec, str(folder)), videos=video_rule(media, spec, str(folder)))
    groups, _, params, _ = isf_of(args, spec, dataset)
    capsys.readouterr()

    out = tmp_path / "stats.json"
    assert omnibal(["isf", "stats", "--stats", str(data), "--hf-checkpoint", str(folder), "--write", str(out)]) == 0
    stats = load_stats([str(out)])
    assert stats.videos is not None and len(stats.videos.patches) == 16 and np.all(stats.videos.temporal > 1)
    times = sample_time_units(stats, spec, get_device(ISF_TIME_DEVICE))
    assert [g.tolist() for g in groups] == reference_isf(stats.patches, stats.tokens, params, SEED, times)
    one_image = dataclasses.replace(stats, videos=dataclasses.replace(stats.videos, temporal=stats.videos.temporal * 0 + 1))
    assert np.all(sample_time_units(one_image, spec, get_device(ISF_TIME_DEVICE))[0][::3] > times[0][::3])
