"""Context parallelism for Qwen2.5-VL: the host split (``QwenBatcher.split_cp``: whole images per CP rank, the
3-D RoPE ids in the padded unsplit layout) against the unsplit micro-batch and a brute-force balance, the planner's
per-rank ViT shapes against a closed form, and (slow) CP2 and TP2-SP x CP2 training against the serial run."""
import itertools

import pytest
import torch

from omnibal_ext.model.shape import MicroBatchShape
from omnibal_ext.model.units import get_preset, unit_components

IMG, PAD = 290, 0  # hf_tiny_qwen's image token id, the pad id


def _qwen_batcher():
    from megatron.vlm.lineages.qwen.data import PatchImages, QwenBatcher
    from megatron.vlm.lineages.qwen.image_processing import ImageProcessorConfig

    spec = get_preset("qwen2.5-vl-tiny")
    exact = ImageProcessorConfig(min_pixels=1, max_pixels=64 * 28 * 28)  # sizes in multiples of 28 px kept as they are
    return spec, QwenBatcher(spec, IMG, PatchImages(exact))


def _sample(k, images, text=5, seed=0):
    """A sample of ``text`` tokens, then per image (rows, cols in patches) its merged tokens and 2 text tokens;
    pixel rows numbered over the micro-batch (``k``: the first row's number) so the split's rows can be traced."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 200, (text,), generator=g).tolist()
    patches = 0
    for r, c in images:
        ids += [IMG] * (r * c // 4) + torch.randint(1, 200, (2,), generator=g).tolist()
        patches += r * c
    ids = torch.tensor(ids)
    rows = torch.arange(k, k + patches, dtype=torch.float32)[:, None].expand(-1, 1176).clone()
    return {"input_ids": ids, "labels": ids + 1, "image_flags": torch.ones(patches, dtype=torch.int64),
            "pixel_values": rows, "image_sizes": torch.tensor([(c * 14, r * 14) for r, c in images],
                                                              dtype=torch.int64).reshape(-1, 2)}


def _samples(images_per_sample):
    out, k = [], 0
    for i, images in enumerate(images_per_sample):
        out.append(_sample(k, images, text=3 + 2 * i, seed=i))
        k += sum(r * c for r, c in images)
    return out


MICRO_BATCHES = {
    "3-images-uneven": [[(4, 6)], [(8, 10), (2, 2)]],  # 24, 80 and 4 patches over the ranks
    "fewer-images-than-ranks": [[(6, 4)], []],  # one image, a text-only sample
    "no-image": [[], []],  # the dummy image alone
}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("cp,sp_tp", [(2, 1), (3, 1), (2, 2)])
@pytest.mark.parametrize("name", list(MICRO_BATCHES))
def test_split_reconstructs_the_unsplit_micro_batch(name, cp, sp_tp, packed):
    pytest.importorskip("transformers")
    import hf_tiny_qwen

    spec, batcher = _qwen_batcher()
    images = MICRO_BATCHES[name]
    whole = batcher.make(_samples(images), PAD, packed)
    parts = [batcher.split_cp(whole, cp, r, PAD, None, sp_tp) for r in range(cp)]
    grids = [(1, r, c) for sample in images for r, c in sample]
    patches = [t * h * w for t, h, w in grids]

    # images: whole, in contiguous runs, every rank's merged tokens known to all; the largest run's predicted ViT
    # time as small as the best contiguous cut's (brute force over the cut points)
    from omnibal_ext.model.sample_time import grid_vit_time_units

    counts = parts[0]["vision_rank_tokens"]
    assert all(p["vision_rank_tokens"] == counts for p in parts)
    assert sum(counts) == sum(patches) // 4 == int((whole["tokens"] == IMG).sum())
    times = grid_vit_time_units(spec, grids).tolist()
    best = min(max(sum(times[a:e]) for a, e in zip((0,) + cut, cut + (len(times),)))
               for cut in itertools.combinations_with_replacement(range(len(times) + 1), cp - 1))
    owned_times, start = [], 0
    for p, n in zip(parts, counts):
        k = len(p["image_grid_thw"]) if n else 0
        owned_times.append(sum(times[start:start + k]))
        start += k
    assert start == len(times) and max(owned_times) == best
    owned = [p for p, n in zip(parts, counts) if n]
    rebuilt = {k: torch.cat([p[k] for p in owned]) if owned else torch.zeros(0) for k in
               ("pixel_values", "image_grid_thw")}
    if grids:
        assert rebuilt["image_grid_thw"].tolist() == [list(g) for g in grids]
        assert torch.equal(rebuilt["pixel_values"], whole["pixel_values"])
        # the ViT fields of the ranks' images, shifted by the patches before them: those transformers' vision model
        # derives for all the images at once
        want = {k: v.long() if isinstance(v, torch.Tensor) else v
                for k, v in hf_tiny_qwen.transformers_vit_fields(grids, spec).items()}
        offset, merged, index, inverse, rotary, windows, full = 0, 0, [], [], [], [0], [0]
        for p in owned:
            index.append(p["vision_patch_index"] + offset)
            inverse.append(p["vision_merged_inverse"] + merged)
            rotary.append(p["vision_rotary_ids"])
            windows += (p["vision_cu_window_seqlens"][1:] + offset).tolist()
            full += (p["vision_cu_seqlens"][1:] + offset).tolist()
            offset += len(p["pixel_values"])
            merged += len(p["pixel_values"]) // 4
        assert torch.equal(torch.cat(index), want["vision_patch_index"])
        assert torch.equal(torch.cat(inverse), want["vision_merged_inverse"])
        assert torch.equal(torch.cat(rotary), want["vision_rotary_ids"])
        assert windows == want["vision_cu_window_seqlens"].tolist()
        assert full == want["vision_cu_seqlens"].tolist()
    for p, n in zip(parts, counts):  # a rank without images runs one all-zero 2 x 2-patch image
        if n == 0:
            assert p["image_grid_thw"].tolist() == [[1, 2, 2]] and not p["pixel_values"].any()
            assert p["pixel_values"].shape == (4, 1176)

    # mrope ids: the padded unsplit layout (each segment padded to 2 x cp x sp_tp), the unsplit ids at real tokens
    old, new = whole["cu_seqlens"].tolist(), parts[0]["cu_seqlens"].tolist()
    ids = [p["mrope_position_ids"] for p in parts]
    assert all(torch.equal(i, ids[0]) for i in ids) and ids[0].shape == (3, 1, new[-1])
    flat = whole["mrope_position_ids"].reshape(3, -1)
    m = 2 * cp * sp_tp
    for (a, e), (na, ne) in zip(zip(old[:-1], old[1:]), zip(new[:-1], new[1:])):
        assert ne - na == -(-(e - a) // m) * m
        assert torch.equal(ids[0][:, 0, na:na + e - a], flat[:, a:e])

    # image features: the ranks' merged outputs gathered in rank order, each rank's image tokens pick theirs; put
    # back in unsplit order (rank r holds chunks r and 2 cp - 1 - r of every segment) they are every feature in order
    feats = torch.arange(sum(counts))
    picked = {}
    for r, p in enumerate(parts):
        local = p["tokens"].reshape(-1)
        slots = torch.nonzero(local == IMG).flatten()
        assert len(slots) == len(p["image_feature_index"])
        for slot, f in zip(slots.tolist(), feats[p["image_feature_index"]].tolist()):
            picked[(r, slot)] = f
    order = []
    for na, ne in zip(new[:-1], new[1:]):
        c = (ne - na) // (2 * cp)
        before = na // cp  # this segment's start in every rank's local tokens
        for i in range(2 * cp):
            r, half = (i, 0) if i < cp else (2 * cp - 1 - i, 1)
            order += [picked[(r, s)] for s in range(before + half * c, before + (half + 1) * c) if (r, s) in picked]
    assert order == feats.tolist()


def test_planner_vit_per_cp_rank():
    """The ViT's per-rank work at CP 2 (ceil(patches / 2) and the attention squares halved) against the CP 1 figures
    of that share, in closed form; the LLM side as every family's."""
    spec = get_preset("qwen2.5-vl-7b")
    v = spec.vision
    n, full_sq, window_sq = 3001, 2.0e6, 3001 * 40.0
    at = {cp: MicroBatchShape(n, 4096, vision_attn_tokens_sq=full_sq, vision_window_tokens_sq=window_sq, cp=cp)
          for cp in (1, 2)}
    half = MicroBatchShape(1501, 4096, vision_attn_tokens_sq=full_sq / 2, vision_window_tokens_sq=window_sq / 2)
    width = v.num_attention_heads * v.head_dim
    for comp in unit_components(spec):
        if comp.code not in "IvP":
            continue
        flops, core = comp.flops(at[2], 1)
        assert (flops, core) == comp.flops(half, 1), comp.kind
        assert comp.act_bytes(at[2], 1, False, "flash") == comp.act_bytes(half, 1, False, "flash"), comp.kind
        if comp.kind == "qwen_vit_full_layer":
            assert core == 4.0 * full_sq / 2 * width
            assert flops == 2.0 * 1501 * (4 * v.hidden_size * width + 3 * v.hidden_size * v.ffn_hidden_size) + core
        if comp.kind == "qwen_vit_window_layer":
            assert core == 4.0 * window_sq / 2 * width


def test_omnibal_plan_runs_at_cp2(tmp_path):
    """`omnibal plan --model qwen2.5-vl-7b --cp 2`: a plan whose trainer flags carry CP 2 and whose sizes multiply
    to the GPUs; the same data at CP 1 plans too (its micro-batch shapes at CP 1)."""
    import json

    import numpy as np

    from omnibal_cli import main

    from omnibal_ext.data.native import derive_native_stats, records_of
    from omnibal_ext.data.stats import from_arrays

    rng = np.random.default_rng(0)
    tiles = rng.choice([1, 3, 4, 5], 600)
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(records_of(derive_native_stats(
        from_arrays(tiles, 256 * tiles + rng.integers(50, 400, 600)), max_num=4))))
    docs = {}
    for cp in (1, 2):
        out = tmp_path / f"plan{cp}.json"
        assert main(["plan", "--data", str(stats), "--model", "qwen2.5-vl-7b", "--gpus", "16", "--gpu-memory", "80",
                     "--cp", str(cp), "--global-batch-size", "64", "--sim-iterations", "2", "--max-vpp", "1",
                     "--json", str(out)]) == 0
        docs[cp] = json.loads(out.read_text())
    flags = docs[2]["trainer_flags"]
    assert flags["--context-parallel-size"] == 2
    assert flags["--tensor-model-parallel-size"] * flags["--pipeline-model-parallel-size"] * docs[2]["dp"] * 2 == 16
    assert "--context-parallel-size" not in docs[1]["trainer_flags"]


def _training(tmp_path, data_cache, isf: bool, micro_batch: int = 1) -> list[str]:
    import hf_tiny_qwen

    # random: ``micro_batch`` samples per micro-batch (one: 1 image over 2 ranks, one rank running the dummy, or 2
    # images of different sizes); ISF: packs of several images of different sizes; the serial run groups as the CP2
    # run does (each sample's tokens counted padded to 2 x CP = 4)
    sizes = ["--omnibal-isf", "--omnibal-isf-token-multiple", "4", "--micro-batch-size", "4"] if isf \
        else ["--micro-batch-size", str(micro_batch)]
    return hf_tiny_qwen.training_flags(tmp_path, data_cache) + sizes + [
        "--train-iters", "3", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "0", "--seed", "5"]


def _assert_same_run(got, want):
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert abs(g["lm loss"] - w["lm loss"]) <= 1e-4 * abs(w["lm loss"]), (g, w)
        assert abs(g["grad norm"] - w["grad norm"]) <= 1e-3 * abs(w["grad norm"]), (g, w)


@pytest.mark.slow
@pytest.mark.parametrize("isf", [False, True], ids=["random", "isf"])
def test_qwen_cp2_equals_serial(tmp_path, data_cache, isf):
    from launch import run_training

    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    flags = _training(tmp_path, data_cache, isf)
    serial, _ = run_training(1, flags, tmp_path, "serial")
    cp, _ = run_training(2, flags + ["--context-parallel-size", "2"], tmp_path, "cp2")
    _assert_same_run(cp, serial)


@pytest.mark.slow
def test_qwen_cp2_with_tp2_sequence_parallel_equals_serial(tmp_path, data_cache):
    """4 processes: TP2 --sequence-parallel x CP2, two samples per micro-batch (2 to 4 images over the CP ranks;
    segments padded to 2 x CP x TP = 8; each rank's ViT patches padded for TP on their own): the serial run's losses
    and gradient norms.  (Random batching: ISF in time groups by the cost model at the run's TP.)"""
    from launch import run_training

    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    flags = _training(tmp_path, data_cache, isf=False, micro_batch=2)
    serial, _ = run_training(1, flags, tmp_path, "serial")
    both, _ = run_training(4, flags + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                       "--sequence-parallel"], tmp_path, "cp2sp2")
    _assert_same_run(both, serial)
