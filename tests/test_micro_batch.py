"""The typed micro-batch (megatron/vlm/stage/micro_batch.py): a stage's parts from the collated fields, ``to``, pickling
(loader workers) and the TP broadcast (two gloo ranks), against the collated fields themselves."""
import dataclasses
import pickle

import pytest
import torch

from megatron.vlm.stage.batches import Collate, StageInputs
from megatron.vlm.data.collate import collate_packed
from megatron.vlm.stage.micro_batch import CPPart, MicroBatch, TileVision, broadcast_micro_batch

PAD, IMG = 0, 99


def samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for k, (n, tiles) in enumerate(((7, 1), (5, 0), (9, 2))):
        ids = torch.randint(1, 50, (n,), generator=g)
        ids[1:1 + 2 * tiles] = IMG
        out.append({"input_ids": ids, "labels": torch.randint(1, 50, (n,), generator=g),
                    "pixel_values": torch.randn(max(tiles, 1), 3, 4, 4, generator=g),
                    "image_flags": torch.tensor([1] * tiles or [0]), "sample_id": 10 + k})
    return out


def test_every_field_lands_in_its_part_and_back():
    fields = collate_packed(samples(), PAD)
    batch = MicroBatch.of(fields)
    assert batch.text.tokens is fields["tokens"] and batch.text.labels is fields["labels"]
    assert batch.packing.cu_seqlens is fields["cu_seqlens"] and batch.packing.max_seqlen == fields["max_seqlen"]
    assert isinstance(batch.vision, TileVision) and batch.vision.pixel_values is fields["pixel_values"]
    assert batch.samples.sample_answers == fields["sample_answers"] and batch.cp is None and batch.iteration == 0
    assert batch.fields().keys() == {*fields, "iteration"}


@pytest.mark.parametrize("parts", [{"pixels"}, {"tokens"}, {"packing", "labels"}])
def test_a_stage_gets_only_what_it_reads(parts):
    batch = Collate(PAD, True, StageInputs.reading(parts), (IMG, 2))(samples())
    v = batch.vision
    assert (v.pixel_values is not None) == (v.image_flags is not None) == ("pixels" in parts)
    assert (v.image_tile_index is not None) == ("tokens" in parts) and v.tile_keys is not None
    assert (batch.text is not None) == bool(parts & {"tokens", "labels"})
    if batch.text is not None:
        assert (batch.text.tokens is not None) == ("tokens" in parts)
        assert (batch.text.labels is not None) == ("labels" in parts)
    assert (batch.packing is not None) == ("packing" in parts) and batch.samples.sample_ids.tolist() == [10, 11, 12]


def test_context_parallel_part():
    batch = Collate(PAD, True, StageInputs.reading({"tokens"}), (IMG, 2), cp=2, cp_rank=1)(samples())
    assert isinstance(batch.cp, CPPart) and batch.cp.num_tiles == 4 and batch.cp.image_feature_index is not None
    vit = Collate(PAD, True, StageInputs.reading({"pixels"}), (IMG, 2), cp=2, cp_rank=1)(samples())
    assert vit.cp.num_tiles == 4 and vit.cp.image_feature_index is None and len(vit.vision.pixel_values) == 2


def test_to_keeps_host_fields_and_pickles():
    batch = dataclasses.replace(MicroBatch.of(collate_packed(samples(), PAD)), iteration=3)
    moved = batch.to("meta")
    assert moved.text.tokens.device.type == "meta" and moved.vision.pixel_values.device.type == "meta"
    assert moved.packing.cu_seqlens.device.type == "cpu" and moved.samples.sample_tiles.device.type == "cpu"
    back = pickle.loads(pickle.dumps(batch))
    assert back.iteration == 3 and all(torch.equal(a, back.fields()[k]) if isinstance(a, torch.Tensor) else
                                       a == back.fields()[k] for k, a in batch.fields().items())


def _broadcast(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batch = dataclasses.replace(MicroBatch.of(collate_packed(samples(), PAD)), iteration=7) if rank == 0 else None
    got = broadcast_micro_batch(batch, 0, None)
    want = {**MicroBatch.of(collate_packed(samples(), PAD)).fields(), "iteration": 7}
    assert got.iteration == 7 and got.fields().keys() == want.keys()  # iteration among them
    for k, v in want.items():
        assert (torch.equal(v, got.fields()[k]) and v.dtype == got.fields()[k].dtype) if isinstance(v, torch.Tensor) \
            else v == got.fields()[k], k
    dist.destroy_process_group()


@pytest.mark.slow
def test_broadcast_over_two_ranks():
    import torch.multiprocessing as mp
    from launch import benchlib

    mp.spawn(_broadcast, args=(2, benchlib.free_port()), nprocs=2)
