"""The trainer's profiler on Qwen2.5-VL (world of one): the family's micro-batch (QwenBatcher at the profiled
shape) through a copy of the model holding a window- and a full-attention ViT layer, its bytes against the
memory model."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs
from omnibal_ext.model.units import build_units, get_preset

SPEC = get_preset("qwen2.5-vl-tiny")
BUDGET_GIB = "0.0045"  # 4.6 MiB: below what stage 0 of the balanced layouts needs without recompute


def _profile(shape):
    from megatron.training.profiling import profile_units

    args = SimpleNamespace(tensor_model_parallel_size=1, bf16=False, seed=1)
    return profile_units(args, SPEC, shape, 250, torch.device("cpu"), warmup=0, repeats=1)


def test_profile_batch_has_the_shape():
    """QwenBatcher's micro-batch at a shape: its patches, merged image tokens and LLM tokens are the shape's."""
    from megatron.vlm.families.qwen2_5_vl.data import profile_batch

    shape = MicroBatchShape(vision_items=96, llm_tokens=120, dtype_bytes=4)
    batch = profile_batch(SPEC, shape, 250, torch.device("cpu"), pad_to_multiple=7)
    assert batch["pixel_values"].shape[0] == 96 == int(batch["vision_cu_seqlens"][-1])
    assert int((batch["tokens"] == 250).sum()) == 96 // 4
    assert batch["tokens"].shape == (1, 126) and int(batch["cu_seqlens"][-2]) == 120
    assert batch["image_grid_thw"].tolist() == [[1, 8, 12]]


def test_profile_prices_qwen_units_as_the_memory_model(megatron_world):
    """Every unit profiled (window and full-attention ViT layers apart); sent bytes and the bytes a fully
    recomputed layer keeps equal the memory model's; the kept activations of the layers within 25% of it, and
    when the patches grow 4x the ViT layers' grow as the model's do (within 5%)."""
    small, large = (MicroBatchShape(vision_items=n, llm_tokens=120, dtype_bytes=4) for n in (96, 384))
    small_costs, large_costs = _profile(small), _profile(large)
    assert [u.name for u in small_costs.units] == [u.name for u in build_units(SPEC)]
    model = {s: {u.kind: u for u in analytic_costs(SPEC, s, 1, attention="flash").units} for s in (small, large)}
    measured = {s: {u.kind: u for u in c.units} for s, c in ((small, small_costs), (large, large_costs))}
    layers = ("qwen_vit_window_layer", "qwen_vit_full_layer", "llm_layer")
    for s in (small, large):
        for kind, got in measured[s].items():
            want = model[s][kind]
            if kind != "llm_head":  # the head sends nothing on; its profile counts the per-token loss
                assert got.send_bytes == want.send_bytes, (kind, got.send_bytes, want.send_bytes)
            if kind in layers:
                assert got.act_bytes_full == want.act_bytes_full, (kind, got.act_bytes_full, want.act_bytes_full)
                assert got.act_bytes == pytest.approx(want.act_bytes, rel=0.25), (kind, got.act_bytes, want.act_bytes)
    for kind in layers[:2]:
        got = measured[large][kind].act_bytes / measured[small][kind].act_bytes
        want = model[large][kind].act_bytes / model[small][kind].act_bytes
        assert got == pytest.approx(want, rel=0.05), (kind, got, want)


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
