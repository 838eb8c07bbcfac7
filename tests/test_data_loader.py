"""The micro-batch loader: stage inputs, worker processes, determinism and resume (in-process, CPU)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from megatron.vlm.stage.batches import MicroBatches, StageInputs
from megatron.vlm.data import ByteTokenizer, RecordDataset, TileImages
from omnibal_ext.data.sampler import GroupBatchSampler, random_groups

TOK = ByteTokenizer()
SIZE, TPT = 28, 4
N = 40


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """N samples: one image, two images, or text only, of varied image sizes."""
    folder = tmp_path_factory.mktemp("loader_data")
    rng = np.random.default_rng(0)
    names = []
    for k in range(8):
        w, h = (int(x) for x in rng.integers(20, 120, 2))
        name = f"im{k}.jpg"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
        names.append(name)
    with open(folder / "ann.jsonl", "w") as f:
        for i in range(N):
            rec = {"conversations": [{"from": "human", "value": f"question {i} " * (1 + i % 4)},
                                     {"from": "gpt", "value": f"answer {i}" * (1 + i % 3)}]}
            if i % 5 == 1:
                rec["image"] = [names[i % 8], names[(i + 3) % 8]]
                rec["conversations"][0]["value"] = "<image> and <image>: " + rec["conversations"][0]["value"]
            elif i % 5 != 4:
                rec["image"] = names[i % 8]
            f.write(json.dumps(rec) + "\n")
    with open(folder / "meta.json", "w") as f:
        json.dump({"set": {"root": ".", "annotation": "ann.jsonl"}}, f)
    return RecordDataset(str(folder / "meta.json"), TOK, TileImages(SIZE, TPT, max_num_tiles=4))


def loader(dataset, workers=0, inputs=None, packed=False, k=3, seed=1):
    sampler = GroupBatchSampler(random_groups(len(dataset), k, seed=seed), dp_size=1, dp_rank=0, seed=seed,
                                microbatches=2)
    return MicroBatches(dataset, sampler, TOK.pad_id, packed=packed, image_tokens=(TOK.img_context_id, TPT),
                        inputs=inputs, num_workers=workers, prefetch_factor=2)


def take(batches, n):
    return [next(batches) for _ in range(n)]


def assert_same(a: list, b: list):
    """Micro-batches equal field by field (``MicroBatch.fields``)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = x.fields(), y.fields()
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], torch.Tensor):
                assert torch.equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key


def inputs_of_kinds(kinds) -> StageInputs:
    """What a stage holding InternVL units of these kinds reads (through the family's runtime components)."""
    from megatron.vlm.stage.components import units_inputs
    from omnibal_ext.model.units import build_units, get_preset

    spec = get_preset("tiny")
    return units_inputs(spec, [next(u for u in build_units(spec) if u.kind == k) for k in kinds])


def test_stage_inputs_from_unit_kinds():
    llm_only = inputs_of_kinds(["llm_layer", "llm_layer", "llm_head"])
    assert llm_only == StageInputs(pixels=False, tokens=False, labels=True, packing=True)
    vit = inputs_of_kinds(["vit_embed", "vit_layer"])
    assert vit == StageInputs(pixels=True, tokens=False, labels=False, packing=False)
    assert stage_fields(vit) == {"pixel_values", "image_flags", "sample_tokens", "sample_tiles", "sample_answers",
                                 "sample_ids", "tile_keys"}
    embed = inputs_of_kinds(["vit_layer", "projector", "llm_embed", "llm_layer"])
    assert embed == StageInputs(pixels=False, tokens=True, labels=False, packing=True)
    assert stage_fields(inputs_of_kinds(["vit_layer"])) == {"sample_tokens", "sample_tiles", "sample_answers",
                                                            "sample_ids", "tile_keys"}
    assert stage_fields(llm_only) == {"labels", "cu_seqlens", "max_seqlen", "segment_ids", "position_ids",
                                      "sample_tokens", "sample_tiles", "sample_answers", "sample_ids", "tile_keys"}


def stage_fields(inputs) -> set[str]:
    """The fields of a micro-batch of one text-only sample that a stage reading ``inputs`` gets."""
    from megatron.vlm.data.collate import collate_packed
    from megatron.vlm.stage.micro_batch import MicroBatch

    sample = {"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([2, 3]),
              "pixel_values": torch.zeros(1, 3, 2, 2), "image_flags": torch.tensor([0])}
    return set(MicroBatch.of(collate_packed([sample], 0), inputs=inputs).fields()) - {"iteration"}


@pytest.mark.parametrize("workers", [0, 2])
def test_llm_only_stage_opens_no_image(dataset, monkeypatch, tmp_path, workers):
    """A stage without the ViT embedding never opens an image (worker processes inherit the hook and
    report through a file)."""
    log = tmp_path / "opened.txt"
    real_open = Image.open

    def counting_open(*a, **kw):
        with open(log, "a") as f:
            f.write(f"{a[0]}\n")
        return real_open(*a, **kw)

    monkeypatch.setattr(Image, "open", counting_open)
    inputs = inputs_of_kinds(["llm_layer", "llm_head"])
    got = take(loader(dataset, workers, inputs), 6)
    assert not log.exists(), log.read_text()
    full = take(loader(dataset, 0), 6)  # the hook does see a ViT stage's opens
    assert log.exists()
    for part, whole in zip(got, full):
        assert part.vision.pixel_values is None and part.text.tokens is None and whole.vision.pixel_values is not None
        part, whole = part.fields(), whole.fields()
        assert set(part) == set(whole) - {"pixel_values", "image_flags", "tokens", "image_tile_index"}
        for key in part:
            assert torch.equal(part[key], whole[key]) if isinstance(part[key], torch.Tensor) else part[key] == whole[key]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_workers_give_the_same_batches(dataset, packed):
    want = take(loader(dataset, 0, packed=packed), 12)  # more than one epoch of groups
    assert_same(take(loader(dataset, 2, packed=packed), 12), want)


def test_resume_with_workers_continues_exactly(dataset):
    whole = take(loader(dataset, 0), 14)
    first = loader(dataset, 2)
    head = take(first, 5)  # the workers have prefetched beyond these 5
    state = first.state_dict()
    assert state["position"] == 5
    assert_same(head, whole[:5])
    assert_same(take(first, 2), whole[5:7])  # state_dict did not disturb the running loader
    again = loader(dataset, 2)
    take(again, 3)  # a loader that has run (and prefetched) ahead, then loads
    again.load_state_dict(state)
    assert_same(take(again, 9), whole[5:14])
    again.reset()  # evaluation's rewind
    assert_same(take(again, 3), whole[:3])


@pytest.mark.slow
def test_workers_at_pp2_tp2_train_the_same(tmp_path, data_cache):
    """torchrun, 4 processes: PP2 x TP2 (stage 1 LLM-only, stage 0's TP rank 0 loads and broadcasts),
    --num-workers 2 gives the losses of --num-workers 0."""
    from launch import run_training

    flags = ["--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0",
             "--lr", "2e-3", "--seed", "7", "--eval-interval", "0", "--data-cache-dir", str(data_cache),
             "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    base, _ = run_training(4, flags + ["--num-workers", "0"], tmp_path, "w0")
    workers, _ = run_training(4, flags + ["--num-workers", "2"], tmp_path, "w2")
    assert [r["iteration"] for r in workers] == [1, 2, 3]
    assert [r["lm loss"] for r in workers] == [r["lm loss"] for r in base]
    # the wait for data is measured (a step always waits a little for its next batch) and is part of the step
    assert all(0 < r["data wait ms"] <= r["elapsed time per iteration (ms)"] for r in workers + base), workers + base


def test_data_wait_times_each_next_of_the_wrapped_iterator():
    """DataWait counts the time spent in ``next`` on the iterators it wraps (a loader that sleeps 30 ms per batch:
    at least 90 ms for 3 batches) and not the time between them (a 100 ms pause in the step)."""
    import time

    from megatron.training.metrics import DataWait

    def slow():
        while True:
            time.sleep(0.03)
            yield 1

    wait = DataWait()
    data = wait.timed(slow())
    t0 = time.perf_counter()
    for _ in range(3):
        next(data)
        time.sleep(0.1 / 3)  # the step's own work
    with wait.timing():  # a block the loop times itself (a broadcast of the batch)
        time.sleep(0.02)
    total = time.perf_counter() - t0
    assert 0.11 <= wait.seconds <= total - 0.09, (wait.seconds, total)


@pytest.mark.slow
def test_trainer_resume_with_workers_is_exact(tmp_path, data_cache):
    """torchrun PP2: save at iteration 3 and resume, both with --num-workers 2 (prefetched batches are
    not counted as served), against one run with --num-workers 0."""
    from launch import run_training

    flags = ["--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0",
             "--lr", "2e-3", "--seed", "7", "--eval-interval", "0", "--data-cache-dir", str(data_cache),
             "--pipeline-model-parallel-size", "2"]
    full, _ = run_training(2, flags + ["--num-workers", "0"], tmp_path, "full")
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_training(2, flags + ["--num-workers", "2", "--save", ckpt, "--exit-interval", "3"], tmp_path, "a")
    second, _ = run_training(2, flags + ["--num-workers", "2", "--load", ckpt], tmp_path, "b")
    assert [r["iteration"] for r in first + second] == [1, 2, 3, 4, 5, 6]
    assert [r["lm loss"] for r in first + second] == [r["lm loss"] for r in full]
    assert [r["consumed samples"] for r in first + second] == [r["consumed samples"] for r in full]
