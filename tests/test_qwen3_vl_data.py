"""Qwen3-VL's data side against transformers (the oracle, used only here).

Pixels bit-identical to ``Qwen2VLImageProcessorPil`` configured from a Qwen3-VL ``preprocessor_config.json``
(the published values, written here); positions equal to ``Qwen3VLModel.get_rope_index`` on random token layouts;
the ViT fields equal to what ``Qwen3VLVisionModel.forward`` computes (and its output unchanged when ours are passed
in); a record read with the folder's tokenizer and chat template equal, token for token and pixel for pixel, to
what ``Qwen3VLProcessor`` returns for the same conversation in transformers' structured form; the micro-batch's
``mm_token_type_ids`` under packing, SP padding and the CP split. Tiny images and configs: seconds.
"""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLModel  # noqa: E402
from transformers import vision_utils as ref_vision  # noqa: E402
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as ref_image  # noqa: E402

from megatron.vlm.stage.batches import StageInputs  # noqa: E402
from megatron.vlm.parallel.context_parallel import padded_layout  # noqa: E402
from megatron.vlm.lineages.qwen.data import PatchImages  # noqa: E402
from megatron.vlm.lineages.qwen.image_processing import ImageProcessorConfig  # noqa: E402
from megatron.vlm.lineages.qwen.qwen3_vit.data import (QWEN3_VL_DATA, VISION_KEYS, Qwen3Batcher,  # noqa: E402
                                                 processor_config, vision_fields)
from megatron.vlm.lineages.qwen.qwen3_vit.image_processing import (PUBLISHED, folder_config,  # noqa: E402
                                                             preprocess_image, resized_grid)
from megatron.vlm.lineages.qwen.qwen3_vit.positions import (IMAGE, ImageTokenError, mm_token_type_ids,  # noqa: E402
                                                      position_ids)
from omnibal_ext.data.native import native_patches  # noqa: E402
from omnibal_ext.errors import UserError  # noqa: E402

IMG, VID, VSTART, VEND = 60, 61, 62, 63  # token ids of the tiny position configs

# Qwen/Qwen3-VL-2B/4B/8B/32B-Instruct's preprocessor_config.json (the same in all four)
PUBLISHED_FILE = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                  "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                  "image_processor_type": "Qwen2VLImageProcessorFast"}


def spec(patch=16, merge=2, temporal=2, position_grid_side=4):
    """The parts of a model spec the data side reads (no Qwen3-VL preset needed; ``tiny_vl``'s 4 x 4 position
    table)."""
    vision = SimpleNamespace(patch_size=patch, spatial_merge_size=merge, temporal_patch_size=temporal, in_channels=3,
                             position_grid_side=position_grid_side)
    return SimpleNamespace(name="qwen3-vl-test", vision=vision)


def photo(height: int, width: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A synthetic photo: gradients plus noise, uint8, in ``mode``."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    base = 255 * (0.5 * y + 0.3 * x * np.array([1.0, 0.4, 0.7]) + 0.2 * np.sin(9 * x + 4 * y))
    image = Image.fromarray(np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8), "RGB")
    if mode == "RGBA":
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L"))
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def published_folder(path, settings=PUBLISHED_FILE):
    path.mkdir(exist_ok=True)
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path


def reference(processor, image):
    out = processor(images=[image], return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


# ---------------------------------------------------------------- image preprocessing

@pytest.fixture(scope="module")
def published(tmp_path_factory):
    folder = published_folder(tmp_path_factory.mktemp("qwen3vl") / "hf")
    return folder_config(str(folder))[0], Qwen2VLImageProcessorPil.from_pretrained(str(folder))


def test_published_file_is_read_as_transformers_reads_it(published):
    ours, ref = published
    assert ours == PUBLISHED
    assert (ours.min_pixels, ours.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)
    assert (ours.patch_size, ours.merge_size, ours.temporal_patch_size) == (ref.patch_size, ref.merge_size,
                                                                            ref.temporal_patch_size)
    assert ours.image_mean == tuple(ref.image_mean) and ours.image_std == tuple(ref.image_std)
    default = Qwen2VLImageProcessorPil()  # what transformers would use without the file: Qwen2-VL's
    assert default.patch_size == 14 and PUBLISHED.patch_size == 16 and tuple(default.image_mean) != PUBLISHED.image_mean


# odd sizes, a tiny one (grown to the 65536 px minimum), elongated ones (the 16.7 Mpx maximum: the budget test)
@pytest.mark.parametrize("height,width", [(257, 391), (33, 47), (480, 640), (1001, 97), (32, 6400)])
def test_pixels_bit_identical(published, height, width):
    ours, ref = published
    image = photo(height, width, seed=height * 7 + width)
    ref_pixels, ref_grid = reference(ref, image)
    rows, grid = preprocess_image(image, ours)
    assert rows.dtype == np.float32 and rows.shape == (grid[1] * grid[2], 3 * 2 * 16 * 16)
    assert np.array_equal(rows, ref_pixels) and np.array_equal(np.array([grid]), ref_grid)
    assert resized_grid(height, width, ours) == grid == PatchImages(ours).grid(width, height)
    assert PatchImages(ours).items(width, height, 1) * 2 ** 2 // 4 == rows.shape[0]


@pytest.mark.parametrize("mode", ["RGBA", "L", "LA", "P"])
def test_pixels_bit_identical_other_modes(published, mode):
    ours, ref = published
    image = photo(301, 203, seed=5, mode=mode)
    if mode == "P":
        image.info["transparency"] = 7
    ref_pixels, ref_grid = reference(ref, image)
    rows, grid = preprocess_image(image, ours)
    assert np.array_equal(rows, ref_pixels) and np.array_equal(np.array([grid]), ref_grid)


def test_pixel_budget_as_min_max_pixels_and_flags(tmp_path):
    settings = {**PUBLISHED_FILE, "size": None, "min_pixels": 40000, "max_pixels": 90000}
    folder = published_folder(tmp_path / "hf", settings)
    ours, ref = folder_config(str(folder))[0], Qwen2VLImageProcessorPil.from_pretrained(str(folder))
    assert (ours.min_pixels, ours.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge) == (40000, 90000)
    for height, width in ((700, 500), (90, 130)):
        image = photo(height, width, seed=width)
        ref_pixels, ref_grid = reference(ref, image)
        rows, grid = preprocess_image(image, ours)
        assert np.array_equal(rows, ref_pixels) and np.array_equal(np.array([grid]), ref_grid)
    flags = SimpleNamespace(min_pixels=None, max_pixels=32 * 32 * 60)
    assert processor_config(flags, spec(), str(folder)).max_pixels == 32 * 32 * 60
    with pytest.raises(UserError, match="--min-pixels/--max-pixels"):
        processor_config(SimpleNamespace(min_pixels=10 ** 6, max_pixels=None), spec(), str(folder))


def test_folder_without_the_file_or_its_keys_is_refused(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(UserError, match=r"hf/preprocessor_config\.json: no such file.*Qwen2-VL's"):
        folder_config(str(tmp_path / "hf"))
    no_args = SimpleNamespace(min_pixels=None, max_pixels=None)
    with pytest.raises(UserError, match=r"preprocessor_config\.json: no such file"):
        QWEN3_VL_DATA.image_rule(no_args, spec(), str(tmp_path / "hf"))
    for key in ("patch_size", "image_mean", "image_std"):
        folder = published_folder(tmp_path / key, {k: v for k, v in PUBLISHED_FILE.items() if k != key})
        with pytest.raises(UserError, match=rf"{key}/preprocessor_config\.json: no {key}; .*Qwen2-VL's defaults"):
            folder_config(str(folder))
    nested = tmp_path / "nested"  # processor_config.json's image_processor entry, as transformers reads it first
    nested.mkdir()
    (nested / "processor_config.json").write_text(json.dumps({"image_processor": PUBLISHED_FILE}))
    assert folder_config(str(nested)) == (PUBLISHED, f"{nested}/processor_config.json: image_processor")
    qwen2 = published_folder(tmp_path / "q2", {**PUBLISHED_FILE, "patch_size": 14})
    with pytest.raises(UserError, match=r"q2/preprocessor_config\.json: patch_size 14, but the model's ViT "
                                        r"\(qwen3-vl-test\) has 16"):
        processor_config(no_args, spec(), str(qwen2))


def test_no_folder_uses_the_published_settings_and_says_so(capsys):
    config = processor_config(SimpleNamespace(min_pixels=None, max_pixels=None), spec(), None)
    assert config == PUBLISHED
    assert "no --hf-checkpoint folder, so the published Qwen3-VL image processor settings: patch 16" \
        in capsys.readouterr().out
    with pytest.raises(UserError, match="patch_size 16, but the model's ViT .* has 8"):
        processor_config(SimpleNamespace(min_pixels=None, max_pixels=None), spec(patch=8), None)


def test_native_stats_patches_equal_the_image_rule():
    """omnibal_ext's stats derivation with Qwen3-VL's patch and budget gives the reader's patch counts."""
    rng = random.Random(0)
    sizes = [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(2000)]
    sizes = [(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200]
    h, w = np.array(sizes).T
    got = native_patches(h, w, PUBLISHED.min_pixels, PUBLISHED.max_pixels, patch=16, merge=2)
    rule = PatchImages(PUBLISHED)
    assert got.tolist() == [rule.items(int(b), int(a), 1) for a, b in sizes]
    for a, b in sizes[:300]:
        _, gh, gw = rule.grid(int(b), int(a))
        assert (gh * 16, gw * 16) == ref_image.smart_resize(int(a), int(b), 32, PUBLISHED.min_pixels,
                                                            PUBLISHED.max_pixels)


# ---------------------------------------------------------------- M-RoPE positions

@pytest.fixture(scope="module")
def tiny_vl():
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4,
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    return Qwen3VLModel(config).eval()


def random_layout(rng):
    """A sample as the processor writes it: text runs (0..6 tokens, none between two images' blocks too), images
    ``<|vision_start|>`` + merged tokens + ``<|vision_end|>`` with random grids (even sides, 2..12 patches)."""
    ids, grids = rng.integers(0, 50, size=int(rng.integers(0, 6))).tolist(), []
    for _ in range(int(rng.integers(0, 4))):
        grid = (1, 2 * int(rng.integers(1, 7)), 2 * int(rng.integers(1, 7)))
        grids.append(grid)
        ids += [VSTART] + [IMG] * (grid[1] * grid[2] // 4) + [VEND]
        ids += rng.integers(0, 50, size=int(rng.integers(0, 7))).tolist()
    return (ids or [5]), grids


def reference_rope(model, ids, grids):
    input_ids = torch.tensor([ids])
    types = (input_ids == IMG).int()
    grid = torch.tensor(grids) if grids else None
    pos, delta = model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid)
    return pos[:, 0], int(delta.reshape(-1)[0])


def test_positions_match_get_rope_index_on_random_layouts(tiny_vl):
    rng = np.random.default_rng(0)
    seen_images = set()
    for _ in range(60):
        ids, grids = random_layout(rng)
        seen_images.add(len(grids))
        ref_pos, ref_delta = reference_rope(tiny_vl, ids, grids)
        pos, delta = position_ids(mm_token_type_ids(ids, IMG, VID), grids)
        assert pos.shape == (3, len(ids)) and pos.dtype == np.int64
        assert torch.equal(torch.from_numpy(pos), ref_pos), (ids, grids)
        assert delta == ref_delta
    assert seen_images == {0, 1, 2, 3}


def test_positions_spell_out_the_rule(tiny_vl):
    """text 2, an image of 4 x 6 patches (2 x 3 merged), text after it: the numbers written out."""
    ids = [7, 8, VSTART] + [IMG] * 6 + [VEND, 9]
    pos, delta = position_ids(mm_token_type_ids(ids, IMG), [(1, 4, 6)])
    assert pos.tolist() == [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
                            [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
                            [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]
    assert delta == 8 - 11
    assert torch.equal(torch.from_numpy(pos), reference_rope(tiny_vl, ids, [(1, 4, 6)])[0])
    with pytest.raises(ImageTokenError, match=r"^f\.jsonl:2: 6 image placeholder tokens but .* need 8"):
        position_ids(mm_token_type_ids(ids, IMG), [(1, 4, 8)], where="f.jsonl:2")
    with pytest.raises(UserError, match="video input is not implemented"):
        position_ids(mm_token_type_ids([VSTART, VID, VID, VEND], IMG, VID), [])


# ---------------------------------------------------------------- ViT fields

def test_vision_fields_are_what_the_vision_model_computes(tiny_vl):
    visual = tiny_vl.visual
    grids = [(1, 6, 10), (1, 4, 4), (2, 4, 6)]
    grid = torch.tensor(grids)
    ours = vision_fields(grids, spec())
    assert set(ours) == set(VISION_KEYS)
    assert torch.equal(ours["image_grid_thw"], grid)
    assert torch.equal(ours["vision_rotary_ids"], ref_vision.get_vision_position_ids(grid, 2))
    ref_cu, ref_max = ref_vision.get_vision_attention_seqlens(grid, visual.config)
    index, weight = ref_vision.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=4, mode="bilinear", align_corners=True, spatial_merge_size=2)
    assert torch.equal(ours["vision_pos_index"], index) and torch.allclose(ours["vision_pos_weight"], weight)
    assert torch.equal(ours["vision_cu_seqlens"], ref_cu) and ours["vision_max_seqlen"] == 60
    x = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = visual(x, grid).pooler_output
        got = visual(x, grid, position_ids=ours["vision_rotary_ids"],
                     cu_seqlens=ours["vision_cu_seqlens"]).pooler_output
        one_segment = torch.tensor([0, len(x)], dtype=torch.int32)  # attention across images: not the same
        wrong = visual(x, grid, cu_seqlens=one_segment).pooler_output
    assert torch.equal(got, expected) and not torch.allclose(wrong, expected)


# ---------------------------------------------------------------- micro-batches

def sample(grids, text=(3, 2), seed=0):
    """A reader-like sample: text, then per image its block (start, merged tokens, end) and text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (text[0],), generator=g).tolist()
    for _, h, w in grids:
        ids += [VSTART] + [IMG] * (h * w // 4) + [VEND] + torch.randint(1, 50, (text[1],), generator=g).tolist()
    ids = torch.tensor(ids)
    patches = sum(t * h * w for t, h, w in grids)
    return {"input_ids": ids, "labels": ids + 1, "image_flags": torch.ones(patches, dtype=torch.int64),
            "pixel_values": torch.randn(patches, 1536, generator=g),
            "image_sizes": torch.tensor([(w * 16, h * 16) for _, h, w in grids], dtype=torch.int64).reshape(-1, 2)}


EXACT = ImageProcessorConfig(min_pixels=1, max_pixels=32 * 32 * 64, patch_size=16)  # sizes of 32 px kept
MICRO_BATCH = [[(1, 4, 6)], [], [(1, 8, 2), (1, 2, 2)]]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_micro_batch_fields_match_the_references(tiny_vl, packed):
    samples = [sample(g, seed=k) for k, g in enumerate(MICRO_BATCH)]
    batch = Qwen3Batcher(spec(), IMG, PatchImages(EXACT)).make(samples, 0, packed, pad_to_multiple=4)
    tokens = batch["tokens"]
    assert tokens.shape[1] % 4 == 0  # SP padding
    types = batch["mm_token_type_ids"]
    assert types.dtype == torch.int64 and types.shape == tokens.shape
    assert torch.equal(types, ((tokens == IMG) & (batch["segment_ids"] >= 0)).long())
    assert batch["image_grid_thw"].tolist() == [list(g) for s in MICRO_BATCH for g in s]
    for k, s in enumerate(samples):  # every sample's positions are get_rope_index's, from 0
        where = (batch["segment_ids"] == k).nonzero()
        row, cols = int(where[0, 0]), where[:, 1]
        assert torch.equal(types[row, cols], (s["input_ids"] == IMG).long())
        ref_pos, _ = reference_rope(tiny_vl, s["input_ids"].tolist(), MICRO_BATCH[k])
        assert torch.equal(batch["mrope_position_ids"][:, row, cols], ref_pos)
    batcher = Qwen3Batcher(spec(), IMG, PatchImages(EXACT))
    everything = batcher.micro_batch(batch, StageInputs.everything()).fields()
    assert set(batch) >= set(everything) - {"iteration"} and "vision_patch_index" not in batch
    vit_only = batcher.micro_batch(batch, StageInputs.reading({"pixels"})).fields()
    llm_only = batcher.micro_batch(batch, StageInputs.reading({"packing"})).fields()
    assert set(VISION_KEYS) <= set(vit_only) and "mm_token_type_ids" not in vit_only
    assert {"mm_token_type_ids", "mrope_position_ids"} <= set(llm_only) and "vision_cu_seqlens" not in llm_only


def test_text_only_micro_batch_runs_the_dummy_image():
    batch = Qwen3Batcher(spec(), IMG, PatchImages(EXACT)).make([sample([]), sample([], seed=1)], 0, True)
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2]] and batch["pixel_values"].shape == (4, 1536)
    assert not batch["mm_token_type_ids"].any()


@pytest.mark.parametrize("cp,sp_tp", [(2, 1), (2, 2), (3, 1)])
def test_cp_split_keeps_token_types_with_their_tokens(cp, sp_tp):
    from omnibal_ext.model.units import get_preset

    batcher = Qwen3Batcher(get_preset("qwen3-vl-tiny"), IMG, PatchImages(EXACT))  # spec()'s sizes; CP's time model
    whole = batcher.make([sample(g, seed=k) for k, g in enumerate(MICRO_BATCH)], 0, True)
    parts = [batcher.split_cp(whole, cp, r, 0, IMG, sp_tp) for r in range(cp)]
    flat = whole["mm_token_type_ids"].reshape(-1)
    for r, p in enumerate(parts):
        src, _ = padded_layout(whole["cu_seqlens"].tolist(), cp, sp_tp, r)
        assert p["mm_token_type_ids"].shape == p["tokens"].shape
        assert torch.equal(p["mm_token_type_ids"], (p["tokens"] == IMG).long())
        assert torch.equal(p["mm_token_type_ids"].reshape(-1)[src >= 0], flat[src[src >= 0]])
        assert "vision_patch_index" not in p
    # the ranks' whole images' ViT fields, put together, are the unsplit ones
    owned = [p for p, n in zip(parts, parts[0]["vision_rank_tokens"]) if n]
    offset, rotary, cu = 0, [], [0]
    for p in owned:
        rotary.append(p["vision_rotary_ids"])
        cu += (p["vision_cu_seqlens"][1:] + offset).tolist()
        offset += len(p["pixel_values"])
    assert torch.equal(torch.cat(rotary), whole["vision_rotary_ids"])
    assert cu == whole["vision_cu_seqlens"].tolist()


def test_profile_batch_is_a_qwen3_micro_batch():
    from omnibal_ext.model.shape import MicroBatchShape

    shape = MicroBatchShape(vision_items=96, llm_tokens=64, llm_attn_tokens_sq=64 * 32, vision_attn_tokens_sq=96 * 48)
    batch = QWEN3_VL_DATA.profile_batch(spec(), shape, IMG, "cpu").fields()
    assert batch["pixel_values"].shape == (96, 1536) and batch["tokens"].shape == (1, 64)
    assert set(VISION_KEYS) <= set(batch) and "vision_patch_index" not in batch
    assert int(batch["mm_token_type_ids"].sum()) == 96 // 4 == int((batch["tokens"] == IMG).sum())
    assert batch["image_grid_thw"].tolist() == [[1, 6, 8]] * 2 and batch["vision_cu_seqlens"].tolist() == [0, 48, 96]


# ---------------------------------------------------------------- a record, read as transformers' processor reads it

# a Qwen3-VL-style ChatML template: content as a string or transformers' structured list; no default system message
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_record_equals_the_processor_with_the_folders_tokenizer_and_template(tmp_path, tiny_vl):
    import hf_tiny_qwen
    from transformers import AutoTokenizer, Qwen3VLProcessor

    from megatron.vlm.data.records import RecordDataset
    from megatron.vlm.data.tokenizer import build_tokenizer

    folder = published_folder(tmp_path / "hf")
    names = hf_tiny_qwen.write_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    pics = {"a.png": photo(203, 331, seed=1, mode="RGBA"), "b.jpg": photo(97, 450, seed=2), "c.png": photo(
        300, 300, seed=3, mode="L")}
    (tmp_path / "images").mkdir()
    for name, im in pics.items():
        im.save(tmp_path / "images" / name)
    conversation = [("Compare <image> with\n<image>.", "Same birds."), ("And this <image>?", "A cat.")]
    record = {"messages": [m for q, a in conversation for m in ({"role": "user", "content": q},
                                                               {"role": "assistant", "content": a})],
              "images": [f"images/{n}" for n in pics]}
    (tmp_path / "train.jsonl").write_text(json.dumps(record) + "\n")

    tokenizer = build_tokenizer(str(folder), image_tokens=QWEN3_VL_DATA.image_tokens)
    rule = QWEN3_VL_DATA.image_rule(SimpleNamespace(min_pixels=None, max_pixels=None), spec(), str(folder))
    dataset = RecordDataset(str(tmp_path / "train.jsonl"), tokenizer, rule)
    ours = dataset[0]
    batch = Qwen3Batcher(spec(), tokenizer.img_context_id, dataset.config.images).make([ours], tokenizer.pad_id,
                                                                                            True)

    class ImagesOnly(Qwen3VLProcessor):
        """transformers' processor without its video processor (which needs torchvision, absent here)."""

        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" and arg is None else super().check_argument_for_proper_class(
                name, arg)

    processor = ImagesOnly(image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(folder)),
                                 tokenizer=AutoTokenizer.from_pretrained(str(folder)), chat_template=TEMPLATE)

    def structured(text):
        parts = text.split("<image>")
        content = [{"type": "text", "text": parts[0]}] if parts[0] else []
        for p in parts[1:]:
            content += [{"type": "image"}] + ([{"type": "text", "text": p}] if p else [])
        return content

    messages = [{"role": m["role"], "content": structured(m["content"]) if m["role"] == "user" else m["content"]}
                for m in record["messages"]]
    text = processor.apply_chat_template(messages, tokenize=False)
    ref = processor(text=[text], images=[Image.open(tmp_path / "images" / n) for n in pics], return_tensors="pt")

    assert torch.equal(ours["input_ids"], ref["input_ids"][0])
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(batch["mm_token_type_ids"], ref["mm_token_type_ids"].long())
    assert tokenizer.img_context_id == names["<|image_pad|>"] == processor.image_token_id
    ref_pos, _ = tiny_vl.get_rope_index(ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
                                        image_grid_thw=ref["image_grid_thw"])
    assert torch.equal(batch["mrope_position_ids"], ref_pos)
    # the answers (and their <|im_end|>) carry the loss, shifted; the prompt and the images do not
    end = [tokenizer.im_end_id]
    assert ours["labels"][ours["labels"] != -100].tolist() == tokenizer.encode("Same birds.") + end + \
        tokenizer.encode("A cat.") + end
    # ISF's stats: each image's patches and grid as the processor's, the sample's tokens
    stats = dataset.sample_stats()
    assert stats.images.patches.tolist() == ref["image_grid_thw"].prod(-1).tolist()
    assert stats.tokens.tolist() == [ref["input_ids"].shape[1]] and stats.vit.tolist() == [len(ref["pixel_values"])]
    rows, cols = dataset.image_grids()
    assert np.array_equal(np.stack([rows, cols], 1), ref["image_grid_thw"][:, 1:].numpy())
