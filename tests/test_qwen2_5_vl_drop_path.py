"""Qwen2.5-VL's ViT drop path (--vision-drop-path-rate), per image over the packed patch rows.

Oracles: the model without the flag (rate 0 is it, bit for bit; evaluation never drops), and batching: an image's
drop decisions come from (seed, iteration, sample id, image index) only, so its merged features in a micro-batch
with another sample equal those of a micro-batch holding its sample alone, and another sample id draws another mask.
"""
from __future__ import annotations

import dataclasses

import torch

from omnibal_ext.model.spec import PROJECTOR
from omnibal_ext.model.units import build_units, get_preset

IMAGE_ID = 263
SPEC = get_preset("qwen2.5-vl-tiny")
GRIDS = [(8, 8), (4, 8)]  # (rows, cols) in patches of sample 0's and sample 1's image


def samples(ids=(0, 1), grids=GRIDS):
    v, g = SPEC.vision, torch.Generator().manual_seed(0)
    p, m = v.patch_size, v.spatial_merge_size
    patch_dim = v.in_channels * v.temporal_patch_size * p * p
    out = []
    for k, (sid, (rows, cols)) in enumerate(zip(ids, grids)):
        image_tokens = rows * cols // (m * m)
        ids_ = torch.randint(0, 256, (image_tokens + 6,), generator=g)
        ids_[ids_ == IMAGE_ID] = 0
        ids_[2:2 + image_tokens] = IMAGE_ID
        out.append({"input_ids": ids_, "labels": ids_.clone(), "sample_id": sid,
                    "image_flags": torch.ones(rows * cols, dtype=torch.int64),
                    "pixel_values": torch.randn(rows * cols, patch_dim, generator=torch.Generator().manual_seed(k)),
                    "image_sizes": torch.tensor([(cols * p, rows * p)], dtype=torch.int64)})
    return out


def batch(sample_list, iteration=3):
    from megatron.vlm.lineages.qwen.data import PatchImages, QwenBatcher
    from megatron.vlm.lineages.qwen.image_processing import ImageProcessorConfig

    v = SPEC.vision
    rule = PatchImages(ImageProcessorConfig(min_pixels=1, max_pixels=64 * v.patch_size ** 2, patch_size=v.patch_size,
                                            temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size))
    batcher = QwenBatcher(SPEC, IMAGE_ID, rule)
    return dataclasses.replace(batcher.micro_batch(batcher.make(sample_list, 0, True, 1)), iteration=iteration)


def vit_stage(rate):
    """The units up to the merger (I v*4 P) as a pipeline stage: its output is the merged image features."""
    from megatron.vlm.stage.build import StageBuild, build_stage

    units = build_units(SPEC)
    last = next(u.index for u in units if u.code == PROJECTOR)
    return build_stage(StageBuild(SPEC, range(0, last + 1), pp=2, img_context_id=IMAGE_ID, seed=3,
                                  vision_drop_path_rate=rate)).train()


def test_rate_zero_is_the_model_without_it_and_a_rate_drops(megatron_world):
    both = batch(samples())
    plain, zero, some = vit_stage(0.0), vit_stage(0.0), vit_stage(0.6)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), some.parameters()))
    a, b, c = (m(both).detach() for m in (plain, zero, some))
    assert torch.equal(a, b)
    assert (c - a).abs().max() > 1e-3 * a.abs().max()  # honoured, not ignored
    with torch.no_grad():
        assert torch.equal(plain.eval()(both), some.eval()(both))  # no drop path in evaluation


def test_mask_is_per_image_whatever_the_batch(megatron_world):
    m = SPEC.vision.spatial_merge_size
    first = GRIDS[0][0] * GRIDS[0][1] // (m * m)  # merged tokens of sample 0's image
    some = vit_stage(0.6)
    differs = False
    for iteration in range(4):
        together = some(batch(samples(), iteration)).detach()
        alone = some(batch(samples(ids=(0,), grids=GRIDS[:1]), iteration)).detach()
        torch.testing.assert_close(together[:first], alone, rtol=1e-5, atol=1e-6)
        other = some(batch(samples(ids=(0, 7)), iteration)).detach()  # sample 1 renamed: its own mask only
        torch.testing.assert_close(other[:first], together[:first], rtol=0, atol=0)
        differs |= not torch.allclose(other[first:], together[first:])
    assert differs  # another sample id draws another mask
