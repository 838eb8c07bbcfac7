"""Qwen3-VL with DeepStack features crossing pipeline stages, against transformers (``hf_tiny_qwen3_vl``: DeepStack
at the first and last ViT layer, so features cross every cut between ViT layer 0 and LLM layer 1).

* logits of the model cut at every unit boundary (and at two at once) in one process, stages chained as the pipeline
  chains them (each stage's output, with the live features packed in by ``megatron.vlm.stage.side.pack``, is the next
  stage's input), within 1e-5 of transformers (fp32, eager), tied and untied;
* ``scripts/hf_logits.py`` at PP2 under torchrun with features crossing from a ViT stage into the next stage's ViT
  and LLM layers (``Iv*2|v*2PEt*3L``) and into LLM layers past the boundary (``Iv*4PEt|t*3L``) (slow);
* the receiving stage sizes the features from host fields every stage gets (``DataSide.side_rows``): training
  micro-batches with and without images and under context parallelism, against the images' merged tokens counted
  from the pixel stage's own fields.
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen3_vl as q  # noqa: E402

from omnibal_ext.model.units import build_units, family_of, get_preset  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"untied"|"tied": (folder, transformers model)}."""
    return hf_check.untied_and_tied(tmp_path_factory, q.make_tiny)


def _live(spec, cut):
    from megatron.vlm.stage.side import live_at

    return [s.name for s in live_at(family_of(spec).side_tensors(spec), cut)]


def test_logits_with_features_crossing_every_cut(megatron_world, tiny):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    batch = q.inputs()
    for name, (folder, model) in tiny.items():
        src = HFSource.open(str(folder))
        want = q.hf_logits(model, batch)
        names = [u.name for u in build_units(src.spec)]
        # the features of ViT layers 0 and 3 (units 1, 4) are read by LLM layers 0 and 1 (units 7, 8)
        crossing = [c for c in range(1, len(names)) if _live(src.spec, c)]
        assert crossing == list(range(2, 9)) and _live(src.spec, 5) == ["deepstack.0", "deepstack.1"]
        for cuts in [[c] for c in crossing] + [[2, 8], [3, 6, 8]]:
            diff = (chained_logits(src, batch, cuts) - want).abs().max().item()
            assert diff <= TOL, (name, [names[c] for c in cuts], diff)


@pytest.mark.slow
def test_hf_logits_script_pp2_with_deepstack_crossing(tiny, tmp_path):
    """PP 2: feature 0 from a ViT stage into ViT and LLM layers of the next; both features into LLM layers past the
    boundary; tied (embedding and head on different stages) and untied."""
    from megatron.vlm.hf.configs import read_config, spec_from_config

    batch = q.inputs()
    runs = [("Iv*2|v*2PEt*3L", 3, ["deepstack.0"], "untied"), ("Iv*2|v*2PEt*3L", 3, ["deepstack.0"], "tied"),
            ("Iv*4PEt|t*2L", 8, ["deepstack.1"], "untied"),  # read by the first layer past the cut
            ("Iv*4PE|t*3L", 7, ["deepstack.0", "deepstack.1"], "tied")]  # both, the second one layer further
    for layout, cut, live, name in runs:
        assert _live(spec_from_config(read_config(str(tiny[name][0])))[0], cut) == live
    got = hf_check.torchrun_logits([(tiny[name][0], ["--pipeline-model-parallel-size", "2", "--pipeline-layout",
                                                     layout]) for layout, _, _, name in runs], batch, tmp_path)
    for (layout, _, _, name), logits in zip(runs, got):
        diff = (logits - q.hf_logits(tiny[name][1], batch)).abs().max().item()
        print(f"{name} {layout}: max |diff| {diff:.3g}")
        assert diff <= TOL, (name, layout, diff)


# --------------------------------------------------------------------------------------------------
# side rows from the training micro-batches
# --------------------------------------------------------------------------------------------------
SPEC = get_preset("qwen3-vl-tiny")
IMAGE_ID = 7


def _samples(grids):
    """One sample per entry of ``grids`` (a list of (rows, cols) patch grids of that sample's images; [] for text
    only), each with its ``<|image_pad|>`` tokens (merged tokens) inside random text."""
    g = torch.Generator().manual_seed(0)
    v = SPEC.vision
    m2 = v.spatial_merge_size ** 2
    out = []
    for k, images in enumerate(grids):
        tokens = sum(r * c for r, c in images) // m2
        ids = torch.randint(10, 300, (tokens + 12,), generator=g)
        ids[3:3 + tokens] = IMAGE_ID
        patches = sum(r * c for r, c in images)
        out.append({"input_ids": ids.numpy(), "labels": ids.numpy(), "sample_id": k,
                    "pixel_values": torch.randn(patches, v.patch_dim, generator=g),
                    "image_flags": torch.ones(patches, dtype=torch.int64) if patches else
                    torch.zeros(0, dtype=torch.int64),
                    "image_sizes": torch.tensor([(c * v.patch_size, r * v.patch_size) for r, c in images],
                                                dtype=torch.int64).reshape(-1, 2)})
    return out


def _collate(inputs, cp=1, cp_rank=0):
    from megatron.vlm.stage.batches import Collate
    from megatron.vlm.stage.components import runtime_family
    from megatron.vlm.lineages.qwen.data import PatchImages
    from megatron.vlm.lineages.qwen.image_processing import ImageProcessorConfig

    v = SPEC.vision
    exact = ImageProcessorConfig(min_pixels=1, max_pixels=64 * 64 * v.patch_size ** 2, patch_size=v.patch_size,
                                 temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size)
    batcher = runtime_family(SPEC).data.batcher(SPEC, IMAGE_ID, PatchImages(exact))
    return Collate(0, True, inputs, None, cp=cp, cp_rank=cp_rank, batcher=batcher)


@pytest.mark.parametrize("grids", [[[(4, 6)], [], [(2, 2), (6, 4)]], [[], []]])
def test_side_rows_of_training_micro_batches(grids):
    """A stage reading neither pixels nor tokens (the narrowest there is) sizes the features as the images' merged
    tokens, which the pixel and token stages see: image-token ids in the tokens, patch rows / 4; one row for the
    dummy image of a text-only micro-batch."""
    from megatron.vlm.stage.batches import StageInputs
    from megatron.vlm.stage.components import runtime_family

    side_rows = runtime_family(SPEC).data.side_rows
    samples = _samples(grids)
    bare = _collate(StageInputs.reading({"labels"}))(samples)
    assert bare.vision.pixel_values is None and bare.text.tokens is None and bare.vision.image_grid_thw is None
    full = _collate(StageInputs.everything())(samples)
    image_tokens = int((full.text.tokens == IMAGE_ID).sum())
    assert image_tokens == sum(r * c for images in grids for r, c in images) // 4
    # the ViT's images (the dummy one included) make this many merged tokens
    made = full.vision.pixel_values.shape[0] // 4
    assert made == int(full.vision.image_grid_thw.prod(1).sum()) // 4
    assert side_rows(SPEC, bare, 1, 0) == max(image_tokens, 1) == made


# images of 24, 4, 24, 8 patches: whole images in contiguous runs balanced by patches, 28 | 32 (6 + 1 | 6 + 2
# merged tokens); one image: it and the other rank's dummy; none: two dummies
@pytest.mark.parametrize("grids, want", [([[(4, 6)], [(2, 2), (6, 4)], [(2, 4)]], [7, 8]),
                                         ([[(4, 4)], []], [4, 1]), ([[], []], [1, 1])])
def test_side_rows_under_context_parallelism(grids, want):
    """CP 2: every rank's rows on a stage of LLM layers (no pixels) and on one of ViT layers are the merged tokens of
    the pixel rows that rank's ViT runs (its dummy 2 x 2-patch image when it has none: one)."""
    from megatron.vlm.stage.batches import StageInputs
    from megatron.vlm.stage.components import runtime_family

    side_rows = runtime_family(SPEC).data.side_rows
    samples = _samples(grids)
    for rank in range(2):
        llm = _collate(StageInputs.reading({"tokens", "packing"}), cp=2, cp_rank=rank)(samples)
        pixels = _collate(StageInputs.reading({"pixels"}), cp=2, cp_rank=rank)(samples)
        assert llm.vision.pixel_values is None and llm.vision.image_grid_thw is None
        made = pixels.vision.pixel_values.shape[0] // 4
        assert made == int(pixels.vision.image_grid_thw.prod(1).sum()) // 4 == want[rank]
        assert side_rows(SPEC, llm, 2, rank) == side_rows(SPEC, pixels, 2, rank) == want[rank]
