"""--sequence-parallel for Qwen2.5-VL at TP 2 against the serial run: a tiny Hugging Face Qwen2.5-VL (3 ViT heads
padded to 4, window and full-attention layers sharing the region, the packed images' patches split over TP)
fine-tuned on messages JSONL with photos under --omnibal-isf; the losses equal the serial run's (slow). And the
pad segment a TP that does not divide the patches adds (in-process)."""
import pytest
import torch
import torch.nn.functional as F

from launch import run_training
from omnibal_ext.model.spec import VISION_LAYER
from omnibal_ext.model.units import build_units, get_preset

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sklearn")
import hf_tiny_qwen  # noqa: E402


@pytest.mark.slow
def test_qwen_sequence_parallel_equals_serial(tmp_path, data_cache):
    flags = hf_tiny_qwen.training_flags(tmp_path, data_cache) + [
        "--omnibal-isf", "--train-iters", "4", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
        "--lr-warmup-iters", "0", "--seed", "5"]
    serial, _ = run_training(1, flags, tmp_path, "serial")
    sp, _ = run_training(2, flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path, "sp")
    assert [r["iteration"] for r in sp] == [1, 2, 3, 4]
    for got, want in zip(sp, serial):  # replicated parameters' gradients summed over TP: same updates
        assert abs(got["lm loss"] - want["lm loss"]) <= 1e-4 * abs(want["lm loss"]), (got, want)
        assert abs(got["grad norm"] - want["grad norm"]) <= 1e-3 * abs(want["grad norm"]), (got, want)


def test_pad_segment_leaves_the_real_patches_alone(megatron_world):
    """The packed patches of an image always come in whole merged tokens (4 patches), so TP 2 never pads; TP 8 pads
    108 patches to 112. Those pads, one more segment of the window and image bounds with zero RoPE, leave the ViT
    layers' outputs on the real patches and their input gradients as the unpadded run's."""
    from megatron.vlm.layers.attention import segment_params
    from megatron.vlm.lineages.qwen.batch import vision_fields
    from megatron.vlm.lineages.qwen.modules import vision_rotary
    from megatron.vlm.parallel.sequence_parallel import padded_tokens, with_pad_segment
    from megatron.vlm.stage.build import StageBuild, build_stage

    spec = get_preset("qwen2.5-vl-tiny")
    v = spec.vision
    stage = build_stage(StageBuild(spec, range(len(build_units(spec))), seed=3)).eval()
    parts = [p for p in stage.parts if p.component.code() == VISION_LAYER]
    assert {p.component.window for p in parts} == {True, False}
    fields = vision_fields(hf_tiny_qwen.GRIDS, spec)
    n = int(fields["vision_cu_seqlens"][-1])
    x = torch.randn(n, 1, v.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def vit(padded):
        rope = F.pad(vision_rotary(fields["vision_rotary_ids"], v.head_dim, v.rotary_base),
                     (0, 0, 0, 0, 0, 0, 0, padded - n))
        params = {True: segment_params(*with_pad_segment(fields["vision_cu_window_seqlens"],
                                                         fields["vision_max_window_seqlen"], padded)),
                  False: segment_params(*with_pad_segment(fields["vision_cu_seqlens"], fields["vision_max_seqlen"],
                                                          padded))}
        h = F.pad(x, (0, 0, 0, 0, 0, padded - n))
        for part in parts:
            for block in stage.module_of(part):
                h = block(hidden_states=h, attention_mask=None, rotary_pos_emb=rope,
                          packed_seq_params=params[part.component.window])
        return h[:n]

    padded = padded_tokens(n, 8)
    assert (n, padded) == (108, 112)
    plain, with_pads = vit(n), vit(padded)
    torch.testing.assert_close(with_pads, plain, rtol=1e-6, atol=1e-6)
    w = torch.randn(plain.shape, generator=torch.Generator().manual_seed(1))
    (g_plain,), (g_pads,) = (torch.autograd.grad((y * w).sum(), x) for y in (plain, with_pads))
    torch.testing.assert_close(g_pads, g_plain, rtol=1e-6, atol=1e-6)
