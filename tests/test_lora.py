"""LoRA (--lora-*): flags, the planning model against parameters counted in a built model and by hand, and, marked
slow, training at TP2 against the serial run (with dropout and full recompute), frozen base tensors, resharded
checkpoints, and the merged HF export's logits in transformers.
"""
import argparse
import os
import warnings

import pytest
import torch
from hf_tiny import world_of_one

from omnibal_ext.errors import UserError
from omnibal_ext.memory.memory_model import FP32_ADAM, MIXED_BF16_ADAM, stage_memory
from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs
from omnibal_ext.model.layout import parse_layout
from omnibal_ext.model.lora import Lora, parse_targets
from omnibal_ext.model.trainable import Freeze, add_freeze_flags, trainable_of
from omnibal_ext.model.units import build_units, get_preset

TINY = get_preset("tiny")  # I v*4 P E t*4 L; ViT hidden 64, MLP 256; LLM hidden 64, 4 heads, 2 KV groups, MLP 192


def _args(*flags):
    p = argparse.ArgumentParser()
    add_freeze_flags(p)
    return p.parse_args(list(flags))


def test_flags_and_what_trains():
    t = trainable_of(_args("--lora-rank", "4"), TINY)
    codes = "".join(u.code if ok else "." for u, ok in zip(build_units(TINY), t.trains))
    assert codes == "IvvvvP......"  # the LLM's base (embedding, layers, head) frozen; ViT and projector train
    assert t.adapted_units == (7, 8, 9, 10) and t.frozen_prefix == 0
    t = trainable_of(_args("--lora-rank", "4", "--lora-targets", "vit.fc1", "--freeze-projector"), TINY)
    assert not any(t.trains[:6]) and all(t.trains[6:])  # ViT base frozen by LoRA, projector by its flag
    assert t.adapted_units == (1, 2, 3, 4) and t.frozen_prefix == 1  # the patch embedding runs without autograd
    assert parse_targets("llm,vit.qkv") == ["llm.qkv", "llm.proj", "llm.fc1", "llm.fc2", "vit.qkv"]
    assert Lora(4).scaling == 2.0 and Lora(4, alpha=1.0).scaling == 0.25
    assert Freeze.from_args(_args("--lora-rank", "8", "--lora-dropout", "0.1", "--lora-targets", "llm.qkv")).flags() \
        == ["--lora-rank", "8", "--lora-dropout", "0.1", "--lora-targets", "llm.qkv"]
    for flags, match in [(("--lora-rank", "4", "--lora-targets", "llm.gate"), "llm.gate: not a LoRA target"),
                         (("--lora-rank", "-1",), "--lora-rank -1"),
                         (("--lora-dropout", "0.1",), "need --lora-rank"),
                         (("--lora-rank", "4", "--lora-dropout", "1.0"), "--lora-dropout 1.0")]:
        with pytest.raises(UserError, match=match):
            trainable_of(_args(*flags), TINY)


def test_trainer_refuses_bad_lora_flags():
    from megatron.training.arguments import parse_flags
    from megatron.training.flags import ArgumentError

    internvit = ["--model", "internvl-6b-20b", "--tensor-model-parallel-size", "2"]  # 25 ViT heads: padded at TP2
    with pytest.raises(ArgumentError, match="vit.qkv.*padded"):
        parse_flags(internvit + ["--lora-rank", "4", "--lora-targets", "vit.qkv"], world_size=2)
    parse_flags(internvit + ["--lora-rank", "4", "--lora-targets", "vit.fc1"], world_size=2)
    with pytest.raises(ArgumentError, match="transformer_engine"):
        parse_flags(["--lora-rank", "4", "--transformer-impl", "transformer_engine"])


def _adapter_params_by_hand(rank: int, tp: int) -> tuple[float, float]:
    """Per TP rank, (LLM layer, ViT layer) adapter parameters of the tiny model with all eight targets: column
    base (qkv, fc1) A [r, in] whole + B [out / tp, r]; row base (proj, fc2) A [r, in / tp] + B [out, r] whole."""
    h, q, kv, f = 64, 64, 2 * 2 * 16, 192  # LLM: hidden, query width, k+v width (2 groups x 16), MLP
    llm = (rank * h + (q + kv) * rank / tp) + (rank * q / tp + h * rank) \
        + (rank * h + 2 * f * rank / tp) + (rank * f / tp + h * rank)  # SwiGLU fc1: gate and up rows
    vh, vf = 64, 256
    vit = (rank * vh + 3 * vh * rank / tp) + (rank * vh / tp + vh * rank) + (rank * vh + vf * rank / tp) \
        + (rank * vf / tp + vh * rank)
    return llm, vit


@pytest.mark.parametrize("tp", [1, 2])
def test_memory_model_lora_bytes_closed_form(tp):
    """Static bytes of a LoRA run = frozen weights x param bytes + adapter parameters (by hand, per TP rank) x the
    trained bytes per parameter; the adapters the planner counts equal those of the built model at TP1."""
    lora = Lora(4, targets=tuple(parse_targets("llm,vit")))
    units = build_units(TINY)
    t = Freeze(lora=lora).trainable(units, False, TINY)
    raw = analytic_costs(TINY, MicroBatchShape(4, 256), tp=tp)
    got = t.apply(raw)
    llm, vit = _adapter_params_by_hand(4, tp)
    layout = parse_layout("Iv*4PEt*2|t*2L", TINY, 2)
    for precision, dp, dist_opt in ((FP32_ADAM, 1, False), (MIXED_BF16_ADAM, 4, True)):
        mem = stage_memory(got, layout, None, pp=2, tp=tp, dp=dp, num_microbatches=4,
                           distributed_optimizer=dist_opt, precision=precision)
        trained = precision.bytes_per_param(dp, dist_opt)
        frozen = [sum(u.param_count for u in raw.units[s]) / tp * precision.param_bytes
                  for s in (slice(0, 9), slice(9, 12))]
        projector = raw.units[5].param_count / tp
        want0 = frozen[0] + projector * (trained - precision.param_bytes) + (4 * vit + 2 * llm) * trained
        want1 = frozen[1] + 2 * llm * trained
        assert mem[0].static_bytes == pytest.approx(want0, rel=1e-12)
        assert mem[1].static_bytes == pytest.approx(want1, rel=1e-12)
    # the adapted layers' backward: input gradient + the adapters' share of the weight gradient
    for r, g in zip(raw.units[7:11], got.units[7:11]):
        assert g.bwd_s == pytest.approx(r.bwd_s * (0.5 + 0.5 * g.lora_params / r.param_count))
    if tp == 1:
        assert sum(u.lora_params for u in got.units) == _built_adapter_params(lora)


def _built_adapter_params(lora) -> int:
    """Adapter parameters of a whole tiny model built with ``lora`` (megatron-core's layers, TP1)."""
    from megatron.vlm.stage.build import StageBuild, build_stage

    with world_of_one():
        units = build_units(TINY)
        stage = build_stage(StageBuild(TINY, range(len(units)), lora=lora,
                                       trainable=Freeze(lora=lora).trainable(units, False, TINY).trains))
        trained = {n for n, p in stage.named_parameters() if p.requires_grad}
        assert trained == {n for n, _ in stage.named_parameters() if "lora_" in n or n.startswith("projector.")}
        return sum(p.numel() for n, p in stage.named_parameters() if "lora_" in n)


def test_hf_model_loads_into_a_lora_stage(tmp_path):
    """An HF model loaded into a stage with adapters on every linear (none in the HF folder: fresh, B = 0) gives
    transformers' logits (1e-5): the adapters start as no-ops and the loader leaves them alone."""
    pytest.importorskip("transformers")
    import hf_tiny

    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.load import load_hf_into_stage
    from megatron.vlm.hf.logits import gather_vocab, image_token_id, logits_stage, make_batch

    model = hf_tiny.make_tiny(tmp_path, seed=2, vit="ln-bias", text="llama", vit_heads=4)
    batch = hf_tiny.inputs()
    lora = Lora(4, targets=tuple(parse_targets("llm,vit")))
    with world_of_one():
        src = HFSource.open(str(tmp_path))
        stage = logits_stage(src.spec, range(len(build_units(src.spec))), image_token_id(src), lora=lora)
        load_hf_into_stage(stage, src)
        adapters = [p for n, p in stage.named_parameters() if "lora_" in n]
        assert len(adapters) == 2 * 4 * (src.spec.vision.num_layers + src.spec.language.num_layers)
        assert all(torch.count_nonzero(p) > 0 for n, p in stage.named_parameters() if n.endswith("lora_a"))
        with torch.no_grad():
            got = gather_vocab(stage(make_batch(src, batch)), src.spec.language.vocab_real)
    assert (got - hf_tiny.hf_logits(model, batch)).abs().max() <= 1e-5

LORA_BASE = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0",
             "--lr", "5e-3", "--seed", "5", "--eval-interval", "0", "--lora-rank", "4",
             "--lora-targets", "llm,vit.fc1,vit.fc2"]


def _assert_close(got, want, rel):
    assert len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


@pytest.mark.slow
def test_tp2_with_dropout_and_recompute_equals_serial_base_frozen(tmp_path, data_cache):
    """LoRA on the LLM's four linears and the ViT's MLP with --lora-dropout 0.2 at TP2 under full recompute (which
    replays the masks) gives the serial run's losses within 1e-5; every base tensor of the adapted models is
    bit-identical in the checkpoints of iterations 1 and 4 and equal to the serial run's, the adapters changed
    and equal the serial run's."""
    from launch import checkpoint_tensors, run_training

    flags = LORA_BASE + ["--data-cache-dir", str(data_cache), "--lora-dropout", "0.2"]
    serial, _ = run_training(1, flags + ["--save", str(tmp_path / "serial")], tmp_path, "serial")
    tp2, out = run_training(2, flags + ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
                                        "--save", str(tmp_path / "tp2"), "--save-interval", "1"], tmp_path, "tp2")
    assert "LoRA adapters on 8 of them" in out
    _assert_close([r["lm loss"] for r in tp2], [r["lm loss"] for r in serial], 1e-5)
    assert serial[-1]["lm loss"] < serial[0]["lm loss"]
    first = checkpoint_tensors(tmp_path / "tp2" / "iter_0000001")
    last = checkpoint_tensors(tmp_path / "tp2" / "iter_0000004")
    ref = checkpoint_tensors(tmp_path / "serial" / "iter_0000004")
    adapters = {k for k in last if "lora" in k}
    assert len(adapters) == 2 * (4 * 4 + 4 * 2) and adapters <= set(ref)
    frozen = [k for k in last if k.startswith(("llm.", "vit.layer.")) and k not in adapters]
    assert len(frozen) > 40 and all(torch.equal(first[k], last[k]) and torch.equal(last[k], ref[k]) for k in frozen)
    assert all(not torch.equal(first[k], last[k]) for k in adapters)
    assert any(not torch.equal(first[k], last[k]) for k in last if k.startswith("projector."))  # trains
    for k in adapters:  # Adam's steps amplify last-bit differences of near-zero gradients: compared as a whole
        assert (last[k] - ref[k]).norm() <= 1e-3 * ref[k].norm(), k


@pytest.mark.slow
def test_tp2_sequence_parallel_equals_serial_and_its_checkpoint_resumes_at_tp1(tmp_path, data_cache):
    """Without dropout: TP2 with sequence parallelism (the adapters' h all-gathered / reduce-scattered, replicated
    adapter weights' gradients summed over TP) gives the serial run's losses (1e-5) and its checkpoint of iteration
    2, resharded to TP1 (adapters, their Adam state), continues to the serial run's third loss."""
    from launch import run_training

    flags = LORA_BASE + ["--data-cache-dir", str(data_cache), "--train-iters", "3"]
    serial, _ = run_training(1, flags, tmp_path, "serial")
    tp2, _ = run_training(2, flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--exit-interval", "2",
                                      "--save", str(tmp_path / "tp2")], tmp_path, "tp2")
    resumed, out = run_training(1, flags + ["--load", str(tmp_path / "tp2")], tmp_path, "resumed")
    assert "resharded" in out and [r["iteration"] for r in tp2 + resumed] == [1, 2, 3]
    _assert_close([r["lm loss"] for r in tp2 + resumed], [r["lm loss"] for r in serial], 1e-5)


@pytest.mark.slow
def test_merged_hf_export_logits_equal_ours(tmp_path, data_cache):
    """A tiny HF InternVL imported (a checkpoint without adapters: they start fresh), trained with LoRA on the LLM
    and the ViT's fc1 at TP2, exported with the adapters merged: transformers' logits on the export equal our model's
    with the adapters (unmerged, loaded from the checkpoint) within 1e-5, and the merge changed the weights."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import hf_tiny
    from transformers import InternVLForConditionalGeneration

    from launch import run_training
    from omnibal_cli import main as omnibal

    hf = tmp_path / "hf"
    model, image_id = hf_tiny.make_tiny_with_tokenizer(hf, seed=4, vit="ln-bias", text="qwen2", vit_heads=3)
    assert omnibal(["hf", "import", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "imported")]) == 0
    flags = ["--hf-checkpoint", str(hf), "--load", str(tmp_path / "imported"), "--tensor-model-parallel-size", "2",
             "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
             "--lr-warmup-iters", "0", "--eval-interval", "0", "--seq-length", "256", "--max-num-tiles", "2",
             "--data-cache-dir", str(data_cache), "--save", str(tmp_path / "ckpt"), "--lora-rank", "4",
             "--lora-alpha", "16", "--lora-targets", "llm,vit.fc1"]
    _, out = run_training(2, flags, tmp_path, "lora")
    assert "holds no LoRA adapters" in out
    assert omnibal(["hf", "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    merged = InternVLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    q = merged.model.language_model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q, model.model.language_model.layers[0].self_attn.q_proj.weight)
    batch = hf_tiny.inputs_with_image_id(image_id)
    want = hf_tiny.hf_logits(merged, batch)
    got = _our_logits_with_adapters(tmp_path / "ckpt", tmp_path / "out", batch)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.slow
def test_qwen_merged_hf_export_logits_equal_ours(tmp_path, data_cache):
    """A tiny HF Qwen2.5-VL trained from --hf-checkpoint with LoRA on the LLM and the ViT's SwiGLU MLP (with bias) at
    TP2 (its 3 ViT heads are padded to 4 there: no adapters on vit.qkv/vit.proj), exported with the adapters merged:
    transformers' logits on the export equal our model's with the adapters (unmerged) within 1e-5, and the merge
    changed the ViT's MLP weights."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("sklearn")
    import hf_tiny_qwen
    from transformers import Qwen2_5_VLForConditionalGeneration

    from launch import run_training
    from omnibal_cli import main as omnibal

    flags = hf_tiny_qwen.training_flags(tmp_path, data_cache, seed=4) + [
        "--tensor-model-parallel-size", "2", "--train-iters", "2", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-2", "--lr-warmup-iters", "0", "--save", str(tmp_path / "ckpt"),
        "--lora-rank", "4", "--lora-alpha", "16", "--lora-targets", "llm,vit.fc1,vit.fc2"]
    _, out = run_training(2, flags, tmp_path, "lora")
    assert "LoRA adapters" in out
    assert omnibal(["hf", "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "hf"))
    merged = hf_tiny_qwen.eager(Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval())
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert not torch.equal(getattr(merged.model.visual.blocks[0].mlp, name).weight,
                               getattr(base.model.visual.blocks[0].mlp, name).weight), name
    assert torch.equal(merged.model.visual.blocks[0].attn.qkv.weight, base.model.visual.blocks[0].attn.qkv.weight)
    batch = hf_tiny_qwen.inputs_with_token_ids(hf_tiny_qwen.SPECIAL_IDS)
    want = hf_tiny_qwen.hf_logits(merged, batch)
    got = _our_logits_with_adapters(tmp_path / "ckpt", tmp_path / "out", batch)
    assert (got - want).abs().max() <= 1e-5


def _our_logits_with_adapters(ckpt, exported, batch) -> torch.Tensor:
    """Our model at TP1 with the checkpoint's LoRA adapters (not merged), loaded from ``ckpt``; [s, real vocab]."""
    from megatron.core import dist_checkpointing

    from megatron.training.checkpointing import find_checkpoint
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import gather_vocab, image_token_id, logits_stage, make_batch
    from omnibal_ext.model.units import spec_from_dict

    with world_of_one():
        path = find_checkpoint(str(ckpt)).path
        run = dist_checkpointing.load_common_state_dict(path)["run"]
        lora = Lora(run["lora"]["rank"], run["lora"]["alpha"], targets=tuple(run["lora"]["targets"]))
        spec = spec_from_dict(run["model"])
        src = HFSource.open(str(exported))
        stage = logits_stage(spec, range(len(build_units(spec))), image_token_id(src), lora=lora)
        request = stage.sharded_state_dict()
        with warnings.catch_warnings():  # megatron-core 0.16's torch_dist loader calls torch's deprecated APIs
            warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
            warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
            loaded = dist_checkpointing.load(request, path)  # with the checkpoint's common state
        stage.load_state_dict({k: loaded[k] for k in request})
        with torch.no_grad():
            return gather_vocab(stage(make_batch(src, batch)), spec.language.vocab_real)


def _family_case(family, folder):
    """(transformers model saved to ``folder``, its class, inputs, logits function) of a tiny HF model of ``family``
    (Qwen2.5-VL: 3 ViT heads, windows and full attention, eager attention in transformers)."""
    if family == "internvl":
        import hf_tiny as tiny
        from transformers import InternVLForConditionalGeneration as cls

        return tiny.make_tiny(folder, seed=6, vit="rms-qknorm", text="qwen2", vit_heads=4), cls, tiny.inputs(), \
            tiny.hf_logits
    import hf_tiny_qwen as tiny
    from transformers import Qwen2_5_VLForConditionalGeneration as cls

    return tiny.make_tiny(folder, seed=6), cls, tiny.inputs(), lambda model, batch: tiny.hf_logits(tiny.eager(model),
                                                                                                  batch)


@pytest.mark.parametrize("family", ["internvl", "qwen2_5_vl"])
def test_export_merges_adapters_of_every_linear(tmp_path, family):
    """Adapters on all eight linears with random B, saved as a checkpoint (global layouts: the ViT's per-head QKV
    and out-projection, gated fc1 halves; Qwen's ViT: biased SwiGLU fc1) and exported: transformers' logits on the
    merged folder equal our model's with the adapters (1e-5), for both families."""
    pytest.importorskip("transformers")
    from megatron.core import dist_checkpointing

    from megatron.training.checkpointing import TRACKER, describe_run, iteration_dir
    from megatron.training.checkpointing.save import InProcessTorchDistSave
    from megatron.vlm.hf.convert import HFSource
    from megatron.training.hf_checkpoints import export_hf
    from megatron.vlm.hf.load import load_hf_into_stage
    from megatron.vlm.hf.logits import gather_vocab, image_token_id, logits_stage, make_batch

    model, cls, batch, hf_logits = _family_case(family, tmp_path / "hf")
    lora = Lora(4, alpha=6.0, targets=tuple(parse_targets("llm,vit")))
    ckpt = tmp_path / "ckpt"
    with world_of_one():
        src = HFSource.open(str(tmp_path / "hf"))
        stage = logits_stage(src.spec, range(len(build_units(src.spec))), image_token_id(src), lora=lora)
        load_hf_into_stage(stage, src)
        adapted = sum(n.endswith("lora_b") for n, _ in stage.named_parameters())
        assert adapted == 4 * (src.spec.vision.num_layers + src.spec.language.num_layers)  # ViT targets included
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in stage.named_parameters():
                if name.endswith("lora_b"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            ours = gather_vocab(stage(make_batch(src, batch)), src.spec.language.vocab_real)
        run = {**describe_run(src.spec, hf=src.meta()), "lora": lora.to_dict()}
        os.makedirs(iteration_dir(str(ckpt), 1))
        dist_checkpointing.save({"model": stage.sharded_state_dict(), "run": run, "iteration": 1},
                                iteration_dir(str(ckpt), 1),  # in this process: megatron's writer forks and hangs here
                                sharded_strategy=InProcessTorchDistSave("torch_dist", 1))
    (ckpt / TRACKER).write_text("1")
    export_hf(str(ckpt), str(tmp_path / "out"))
    merged = cls.from_pretrained(str(tmp_path / "out")).eval()
    want = hf_logits(merged, batch)
    assert (ours - hf_logits(model, batch)).abs().max() > 1e-3  # the adapters change the model
    assert (ours - want).abs().max() <= 1e-5
