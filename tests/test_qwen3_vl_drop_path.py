"""Qwen3-VL's ViT drop path (--vision-drop-path-rate), per image over the packed patch rows, in the plain and the
DeepStack layers (the DeepStack mergers read the layer's output after the drop).

Oracles: the model without the flag (rate 0 is it, bit for bit; evaluation never drops), and batching: an image's
drop decisions come from (seed, iteration, sample id, image index) only, so the per-token losses of a sample packed
with another equal those of a micro-batch holding it alone (THD: samples do not attend to each other), and another
sample id draws another mask.
"""
from __future__ import annotations

import dataclasses

import torch

from omnibal_ext.model.units import build_units, get_preset

IMAGE_ID = 263
SPEC = get_preset("qwen3-vl-tiny")
GRIDS = [(8, 8), (4, 8)]  # (rows, cols) in patches of sample 0's and sample 1's image


def samples(ids=(0, 1), grids=GRIDS):
    v, g = SPEC.vision, torch.Generator().manual_seed(0)
    p, m = v.patch_size, v.spatial_merge_size
    out = []
    for k, (sid, (rows, cols)) in enumerate(zip(ids, grids)):
        image_tokens = rows * cols // (m * m)
        ids_ = torch.randint(0, 256, (image_tokens + 6,), generator=g)
        ids_[ids_ == IMAGE_ID] = 0
        ids_[2:2 + image_tokens] = IMAGE_ID
        out.append({"input_ids": ids_, "labels": torch.roll(ids_, -1), "sample_id": sid,
                    "image_flags": torch.ones(rows * cols, dtype=torch.int64),
                    "pixel_values": torch.randn(rows * cols, v.patch_dim, generator=torch.Generator().manual_seed(k)),
                    "image_sizes": torch.tensor([(cols * p, rows * p)], dtype=torch.int64)})
    return out


def batch(sample_list, iteration=3):
    from megatron.vlm.lineages.qwen.data import PatchImages
    from megatron.vlm.lineages.qwen.image_processing import ImageProcessorConfig
    from megatron.vlm.lineages.qwen.qwen3_vit.data import Qwen3Batcher

    v = SPEC.vision
    rule = PatchImages(ImageProcessorConfig(min_pixels=1, max_pixels=64 * v.patch_size ** 2, patch_size=v.patch_size,
                                            temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size))
    batcher = Qwen3Batcher(SPEC, IMAGE_ID, rule)
    return dataclasses.replace(batcher.micro_batch(batcher.make(sample_list, 0, True, 1)), iteration=iteration)


def model(rate):
    """The whole model as one stage (loss mode)."""
    from megatron.vlm.stage.build import StageBuild, build_stage

    return build_stage(StageBuild(SPEC, range(len(build_units(SPEC))), img_context_id=IMAGE_ID, seed=3,
                                  vision_drop_path_rate=rate)).train()


def loss(stage, b):
    stage.set_input_tensor(None)
    return stage(b).loss.detach().reshape(-1)


def test_rate_zero_is_the_model_without_it_and_a_rate_drops(megatron_world):
    from megatron.vlm.layers.drop_path import DropPathLayer
    from megatron.vlm.lineages.qwen.qwen3_vit.modules import DeepStackLayer

    both = batch(samples())
    plain, zero, some = model(0.0), model(0.0), model(0.6)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), some.parameters()))
    layers = [m for m in some.modules() if isinstance(m, DeepStackLayer)]
    assert len(layers) == 2 and all(isinstance(m, DropPathLayer) for m in layers)  # DeepStack layers drop too
    assert sum(isinstance(m, DropPathLayer) for m in some.modules()) == SPEC.vision.num_layers
    a, b, c = (loss(m, both) for m in (plain, zero, some))
    assert torch.equal(a, b)
    assert (c - a).abs().max() > 1e-3 * a.abs().max()  # honoured, not ignored
    with torch.no_grad():
        assert torch.equal(loss(plain.eval(), both), loss(some.eval(), both))  # no drop path in evaluation


def test_mask_is_per_image_whatever_the_batch(megatron_world):
    first = len(samples()[0]["input_ids"])  # sample 0's tokens
    some = model(0.6)
    differs = False
    for iteration in range(4):
        together = loss(some, batch(samples(), iteration))
        alone = loss(some, batch(samples(ids=(0,), grids=GRIDS[:1]), iteration))
        torch.testing.assert_close(together[:first], alone[:first], rtol=1e-5, atol=1e-6)
        other = loss(some, batch(samples(ids=(0, 7)), iteration))  # sample 1 renamed: its own mask only
        torch.testing.assert_close(other[:first], together[:first], rtol=1e-6, atol=1e-6)
        differs |= not torch.allclose(other[first:], together[first:])
    assert differs  # another sample id draws another mask
