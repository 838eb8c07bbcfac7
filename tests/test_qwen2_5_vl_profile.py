"""The trainer's profiler on Qwen2.5-VL (world of one): the family's micro-batch (QwenBatcher at the profiled
shape) through a copy of the model holding a window- and a full-attention ViT layer, its bytes against the
memory model."""
import dataclasses

import pytest
import torch

from megatron.training.flags import build_parser
from megatron.training.specs import run_config
from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs
from omnibal_ext.model.units import build_units, get_preset

SPEC = get_preset("qwen2.5-vl-tiny")
BUDGET_GIB = "0.0045"  # 4.6 MiB: below what stage 0 of the balanced layouts needs without recompute


def _profile(shape):
    from megatron.training.profiling import profile_units

    args = build_parser().parse_args(["--seed", "1"])
    return profile_units(run_config(args, 1), SPEC, shape, 250, torch.device("cpu"), warmup=0, repeats=1)


def test_profile_batch_has_the_shape():
    """QwenBatcher's micro-batch at a shape: its patches, merged image tokens and LLM tokens are the shape's."""
    from megatron.vlm.lineages.qwen.data import profile_batch

    shape = MicroBatchShape(vision_items=96, llm_tokens=120, dtype_bytes=4)
    batch = profile_batch(SPEC, shape, 250, torch.device("cpu"), pad_to_multiple=7).fields()
    assert batch["pixel_values"].shape[0] == 96 == int(batch["vision_cu_seqlens"][-1])
    assert int((batch["tokens"] == 250).sum()) == 96 // 4
    assert batch["tokens"].shape == (1, 126) and int(batch["cu_seqlens"][-2]) == 120
    assert batch["image_grid_thw"].tolist() == [[1, 8, 12]]


def _images_shape(patches: int, images: int) -> MicroBatchShape:
    """A micro-batch of ``images`` equal images of ``patches`` patches in all, with the sums of squared image and
    window lengths of the grids the profiler's micro-batch gives them (``profile_images``)."""
    from megatron.vlm.lineages.qwen.data import profile_images

    grids = profile_images(SPEC, MicroBatchShape(patches, 120, vision_attn_tokens_sq=patches**2 / images))
    full, window = SPEC.vision.segments_sq([r for r, _ in grids], [c for _, c in grids])
    return MicroBatchShape(vision_items=patches, llm_tokens=120, dtype_bytes=4,
                           vision_attn_tokens_sq=float(full.sum()), vision_window_tokens_sq=float(window.sum()))


def test_profile_prices_qwen_units_as_the_memory_model(megatron_world):
    """Every unit profiled (window and full-attention ViT layers apart); sent bytes equal the memory model's (on
    the CPU's kernels), and so do the kept activations of the patch embedding, the merger and both ViT layer kinds
    with and without recompute: one image (its full-attention output is the out-projection input), 4x the patches,
    and two images with ragged windows (each segment's output kept beside their concatenation). Selective
    recompute keeps 4 bytes more (megatron-core's checkpoint saves an int32 tensor), in the LLM layer too. The LLM
    layer without recompute exactly one attention output fewer (its one-sample row keeps its output once, as the
    out-projection input; a shape that does not name its samples stands for rows of several)."""
    from omnibal_ext.model.cost_model import DEVICES

    small, large, two = _images_shape(96, 1), _images_shape(384, 1), _images_shape(96, 2)
    assert two.vision_window_tokens_sq < 96 * 16  # 6 x 8 patches: ragged 4 x 4 windows
    measured = {s: _profile(s) for s in (small, large, two)}
    assert [u.name for u in measured[small].units] == [u.name for u in build_units(SPEC)]
    exact = ("qwen_vit_embed", "qwen_vit_window_layer", "qwen_vit_full_layer", "qwen_merger")
    for s, costs in measured.items():
        model = {u.kind: u for u in analytic_costs(SPEC, s, 1, DEVICES["cpu"], attention="flash").units}
        for got in costs.units:
            kind, want = got.kind, model[got.kind]
            if kind != "llm_head":  # the head sends nothing on; its profile counts the per-token loss
                assert got.send_bytes == want.send_bytes, (kind, got.send_bytes, want.send_bytes)
            if kind in exact:
                assert got.act_bytes == pytest.approx(want.act_bytes, rel=1e-12), (kind, got.act_bytes, want.act_bytes)
            if kind in ("qwen_vit_window_layer", "qwen_vit_full_layer", "llm_layer"):
                assert got.act_bytes_full == want.act_bytes_full, (kind, got.act_bytes_full, want.act_bytes_full)
                assert got.act_bytes_selective == pytest.approx(want.act_bytes_selective + 4, rel=1e-12), \
                    (kind, got.act_bytes_selective, want.act_bytes_selective)
            if kind == "llm_layer":  # exact but for the one output a one-sample row does not keep twice
                lm = SPEC.language
                one_output = s.llm_tokens * lm.num_attention_heads * lm.kv_channels * s.dtype_bytes
                assert got.act_bytes == want.act_bytes - one_output, (kind, got.act_bytes, want.act_bytes, one_output)


@pytest.mark.slow
def test_tp2_vit_activation_bytes_equal_the_model(tmp_path):
    """At TP 2 (3 ViT heads padded to 4), with and without sequence parallelism, two images with ragged windows
    (tests/sp_profile_probe.py): the kept bytes of both ViT layer kinds and the merger equal the memory model's,
    without recompute and with full recompute; selective recompute keeps 4 bytes more per layer."""
    import sp_profile_probe

    from omnibal_ext.model.cost_model import DEVICES

    shape = _images_shape(96, 2)
    measured = sp_profile_probe.launch(tmp_path, SPEC.name, shape)
    for key in ("tp", "sp"):
        model = {u.kind: u for u in analytic_costs(SPEC, shape, 2, DEVICES["cpu"], attention="flash",
                                                   sequence_parallel=key == "sp").units}
        for kind in ("qwen_vit_window_layer", "qwen_vit_full_layer", "qwen_merger"):
            got, want = measured[key][kind], model[kind]
            assert got["act_bytes"] == pytest.approx(want.act_bytes, rel=1e-12), (key, kind, got, want)
            if kind != "qwen_merger":
                assert got["act_bytes_full"] == pytest.approx(want.act_bytes_full, rel=1e-12), (key, kind, got, want)
                assert got["act_bytes_selective"] == pytest.approx(want.act_bytes_selective + 4, rel=1e-12), \
                    (key, kind, got, want)


def test_profiled_copy_keeps_every_vit_layer_kind():
    from megatron.training.profiling import vision_layers_of_every_kind

    assert vision_layers_of_every_kind(SPEC) == 2  # full attention at layer 1
    late = SPEC.replace(vision=dataclasses.replace(SPEC.vision, fullatt_block_indexes=(3,)))
    assert vision_layers_of_every_kind(late) == 4
    assert vision_layers_of_every_kind(get_preset("tiny")) == 1


@pytest.mark.slow
def test_pp2_partition_and_recompute_auto_train_as_the_layout_given(tmp_path, data_cache):
    """PP2 with --omnibal-partition auto --omnibal-recompute auto on a tiny HF Qwen2.5-VL (ISF, photos): the
    profiled, searched layout and recompute plan, given explicitly, train with the same losses."""
    import re

    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("sklearn")
    import hf_tiny_qwen
    from launch import run_training

    flags = hf_tiny_qwen.training_flags(tmp_path, data_cache) + [
        "--pipeline-model-parallel-size", "2", "--omnibal-isf", "--train-iters", "3", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "0", "--seed", "5"]
    auto, out = run_training(2, flags + ["--omnibal-partition", "auto", "--omnibal-recompute", "auto",
                                         "--omnibal-memory-budget", BUDGET_GIB], tmp_path, "auto")
    layout = re.search(r"> omnibal partition: layout (\S+);", out).group(1)
    plan = re.search(r"> omnibal recompute: plan (\S+) ", out).group(1)
    print("layout", layout, "recompute", plan)
    given, _ = run_training(2, flags + ["--pipeline-layout", layout, f"--recompute-plan={plan}"], tmp_path, "given")
    assert [r["lm loss"] for r in auto] == [r["lm loss"] for r in given]
    assert [r["grad norm"] for r in auto] == [r["grad norm"] for r in given]
