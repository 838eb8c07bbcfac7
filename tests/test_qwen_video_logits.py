"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 on video, against transformers on tiny random checkpoints: one image and two
videos (temporal grids 3 and 2; Qwen2.5-VL's ``second_per_grid_ts`` 0.5 and 2/3 with ``tokens_per_second`` 3, so the
temporal ids are truncated products; Qwen3-VL's and Qwen3.5's timestamp text before each temporal patch's own
``<|vision_start|>``..``<|vision_end|>``), the inputs built as the processors return them (their video processors
need torchvision). Logits within 1e-5 at TP1 at every pipeline cut in one process, and under torchrun at TP2 x PP2
with the ViT split over the stages (the families in one launch, slow); inputs a family does not implement are
refused."""
import pytest
import torch

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen as q25  # noqa: E402
import hf_tiny_qwen3_5 as q35  # noqa: E402
import hf_tiny_qwen3_vl as q3  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402

TOL = 1e-5
IMAGE = (1, 6, 10)
VIDEOS = ((3, 6, 6), (2, 4, 6))  # patches (t, h, w): merged 3 x 3 (ragged 2 x 2 windows) and 2 x 3
SECONDS = (0.5, 2 / 3)
TOKENS_PER_SECOND = 3
Q25_VIDEO_ID = q25.VOCAB - 1
QWEN3_5_EPS = 0.1  # the tiny Qwen3.5's rms_norm_eps here (FAMILIES)


def text(g, n):
    return torch.randint(0, q25.VISION_START, (n,), generator=g).tolist()


def qwen2_5_inputs(seed=1):
    """text, video 0, text, image, text, video 1, text: what Qwen2.5-VL's processor returns."""
    g = torch.Generator().manual_seed(seed)
    ids = text(g, 3)
    blocks = [("video", VIDEOS[0]), ("image", IMAGE), ("video", VIDEOS[1])]
    for kind, (t, h, w) in blocks:
        pad = Q25_VIDEO_ID if kind == "video" else q25.IMAGE_ID
        ids += [q25.VISION_START] + [pad] * (t * h * w // 4) + [q25.VISION_END] + text(g, 2)
    ids = torch.tensor([ids])
    dim = 3 * 2 * 14 * 14
    return {"input_ids": ids, "pixel_values": torch.randn(IMAGE[0] * IMAGE[1] * IMAGE[2], dim, generator=g),
            "image_grid_thw": torch.tensor([IMAGE]),
            "pixel_values_videos": torch.randn(sum(t * h * w for t, h, w in VIDEOS), dim, generator=g),
            "video_grid_thw": torch.tensor(VIDEOS), "second_per_grid_ts": torch.tensor(SECONDS),
            "mm_token_type_ids": (ids == q25.IMAGE_ID).long() + 2 * (ids == Q25_VIDEO_ID).long()}


def qwen3_inputs(seed=1):
    """text, image, text, video 0, text, video 1: what Qwen3-VL's processor returns, each temporal patch of a video
    after its timestamp text (here random text ids) in its own vision_start .. vision_end."""
    g = torch.Generator().manual_seed(seed)
    ids = text(g, 3) + [q3.VISION_START] + [q3.IMAGE_ID] * (IMAGE[1] * IMAGE[2] // 4) + [q3.VISION_END]
    for t, h, w in VIDEOS:
        ids += text(g, 2)
        for _ in range(t):
            ids += text(g, 4) + [q3.VISION_START] + [q3.VIDEO_ID] * (h * w // 4) + [q3.VISION_END]
    ids = torch.tensor([ids + text(g, 3)])
    dim = 3 * 2 * q3.PATCH * q3.PATCH
    return {"input_ids": ids, "pixel_values": torch.randn(IMAGE[1] * IMAGE[2], dim, generator=g),
            "image_grid_thw": torch.tensor([IMAGE]),
            "pixel_values_videos": torch.randn(sum(t * h * w for t, h, w in VIDEOS), dim, generator=g),
            "video_grid_thw": torch.tensor(VIDEOS),
            "mm_token_type_ids": (ids == q3.IMAGE_ID).long() + 2 * (ids == q3.VIDEO_ID).long()}


def make_qwen2_5(folder):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hf_tiny import perturb

    config = q25.hf_config()
    config.vision_config.tokens_per_second = TOKENS_PER_SECOND
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    perturb(model, 0)
    model.save_pretrained(str(folder))
    return q25.eager(model)


FAMILIES = {"qwen2_5_vl": (make_qwen2_5, qwen2_5_inputs, "Iv*2|v*2PEt*2L"),
            "qwen3_vl": (lambda folder: q3.make_tiny(folder), qwen3_inputs, "Iv*2|v*2PEt*3L"),
            # Qwen3.5: Qwen3-VL's ViT (no DeepStack), processor and token ids, its hybrid LLM (PP 2: the ViT split;
            # the LLM's cuts are tests/test_qwen3_5_model.py's). rms_norm_eps 0.1: on these 150 tokens the gated
            # norm turns transformers' own fp32 rounding into up to 4e-5 of the logits at eps 1e-5 (seeds 0 .. 6),
            # 2e-6 .. 4e-6 at 0.1 (test_the_qwen3_5_oracle_is_exact_to_the_tolerance); the image tests keep 1e-5
            "qwen3_5": (lambda folder: q35.make_tiny(folder, seed=q35.SEEDS[0], eps=QWEN3_5_EPS), qwen3_inputs,
                        "Iv|vPEt*5L")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{family: (folder, transformers model, inputs, PP2 layout)}."""
    out = {}
    for name, (make, inputs, layout) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, make(folder), inputs(), layout)
    return out


def hf_logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits[0].float()


def test_video_logits_match_transformers_at_every_pipeline_cut(megatron_world, tiny):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits
    from omnibal_ext.model.units import build_units

    for name, (folder, model, batch, _) in tiny.items():
        src = HFSource.open(str(folder))
        want = hf_logits(model, batch)
        got = chained_logits(src, batch)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= TOL, name
        for cut in range(1, len(build_units(src.spec))):
            assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, (name, cut)
        # the videos' timing matters: transformers gives other logits with other second_per_grid_ts (Qwen2.5-VL)
        # or with the video tokens taken as text (both)
        if name == "qwen2_5_vl":
            other = {**batch, "second_per_grid_ts": torch.tensor([1.0, 1.0])}
            assert (hf_logits(model, other) - want).abs().max() > 1e-3
            assert (chained_logits(src, other) - hf_logits(model, other)).abs().max() <= TOL


def test_the_qwen3_5_oracle_is_exact_to_the_tolerance(tiny):
    """transformers' fp32 logits of the tiny Qwen3.5 on the video input are within 1e-5 / 2 of the exact ones
    (``hf_tiny_qwen3_5.oracle_error``: float64, the delta rule in float64): the 1e-5 comparisons judge our rounding."""
    _, model, batch, _ = tiny["qwen3_5"]
    assert q35.oracle_error(model, batch) <= TOL / 2


def test_inputs_not_implemented_are_refused(megatron_world, tiny):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import make_batch

    q3_folder, _, q3_batch, _ = tiny["qwen3_vl"]
    src = HFSource.open(str(q3_folder))
    with pytest.raises(UserError, match="second_per_grid_ts"):  # a Qwen2.5-VL input only
        make_batch(src, {**q3_batch, "second_per_grid_ts": torch.tensor(SECONDS)})
    with pytest.raises(UserError, match="video_second"):
        make_batch(src, {**q3_batch, "video_second": torch.tensor(1.0)})
    folder, _, batch, _ = tiny["qwen2_5_vl"]
    src = HFSource.open(str(folder))
    with pytest.raises(UserError, match="mm_token_type_ids"):  # video tokens marked as image tokens
        make_batch(src, {**batch, "mm_token_type_ids": (batch["mm_token_type_ids"] > 0).long()})
    with pytest.raises(UserError, match="pixel_values_videos"):  # rows short of the grids
        make_batch(src, {**batch, "pixel_values_videos": batch["pixel_values_videos"][:-1]})
    with pytest.raises(UserError, match="attention_mask"):
        make_batch(src, {**batch, "attention_mask": torch.zeros_like(batch["input_ids"])})


@pytest.mark.slow
def test_video_hf_logits_script_tp2_pp2_under_torchrun(tiny, tmp_path):
    """TP 2 (3 ViT heads padded to 4) x PP 2 with the ViT split over the stages, the families in one launch; then TP 2
    and PP 2 alone."""
    names = list(tiny)
    got = hf_check.torchrun_logits(
        [(tiny[name][0], ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--pipeline-layout", tiny[name][3]]) for name in names],
        [tiny[name][2] for name in names], tmp_path, nproc=4)
    for name, logits in zip(names, got):
        _, model, batch, layout = tiny[name]
        diff = (logits - hf_logits(model, batch)).abs().max().item()
        print(f"{name} TP2 x PP2 {layout}: max |diff| {diff:.3g}")
        assert diff <= TOL, name
    # TP 2 alone and PP 2 alone (the ViT split), all four cases in one 2-process launch
    cases = [(name, flags) for name in names
             for flags in (["--tensor-model-parallel-size", "2"],
                           ["--pipeline-model-parallel-size", "2", "--pipeline-layout", tiny[name][3]])]
    got = hf_check.torchrun_logits([(tiny[name][0], flags) for name, flags in cases],
                                   [tiny[name][2] for name, _ in cases], tmp_path / "two", nproc=2)
    for (name, flags), logits in zip(cases, got):
        _, model, batch, _ = tiny[name]
        diff = (logits - hf_logits(model, batch)).abs().max().item()
        print(f"{name} {' '.join(flags)}: max |diff| {diff:.3g}")
        assert diff <= TOL, (name, flags)
