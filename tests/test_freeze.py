"""Freezing (--freeze-vit, --freeze-projector, --freeze-llm, --unfreeze-*) and per-module learning rates.

Planning side against numbers computed here from the unit list and the unfrozen costs; the trainer in process
(which parameters train, the LR of every param group against the schedule's formula) and, marked slow, at
PP2: frozen tensors bit-identical across checkpoints, optimizer state for the trained ones only, a resume under
other freeze flags.
"""
import dataclasses
import math

import pytest
import torch

from omnibal_ext.errors import UserError
from omnibal_ext.memory.memory_model import FP32_ADAM, MIXED_BF16_ADAM, stage_memory
from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs
from omnibal_ext.model.layout import parse_layout
from omnibal_ext.model.trainable import Freeze
from omnibal_ext.model.units import build_units, get_preset

TINY = get_preset("tiny")  # I v*4 P E t*4 L


def codes_of(freeze, spec=TINY):
    units = build_units(spec)
    t = freeze.trainable(units)
    return "".join(u.code if ok else "." for u, ok in zip(units, t.trains)), t.frozen_prefix


def test_qwen_units_take_the_vit_projector_and_llm_roles():
    """Qwen2.5-VL's units (patch embedding, window and full-attention ViT layers, merger) are the ViT, its layers
    and the projector: what each freeze flag trains, written out by unit name (the window/full alternation does not
    change which layers --unfreeze-vit-layers picks: the last two are vit.layer.2 (window) and vit.layer.3 (full))."""
    qwen = get_preset("qwen2.5-vl-tiny")
    units = build_units(qwen)
    assert [u.name for u in units] == ["vit.embed", "vit.layer.0", "vit.layer.1", "vit.layer.2", "vit.layer.3",
                                       "projector", "llm.embed", "llm.layer.0", "llm.layer.1", "llm.layer.2",
                                       "llm.layer.3", "llm.head"]
    assert [u.kind for u in units][:6] == ["qwen_vit_embed", "qwen_vit_window_layer", "qwen_vit_full_layer",
                                           "qwen_vit_window_layer", "qwen_vit_full_layer", "qwen_merger"]
    vit = {"vit.embed", "vit.layer.0", "vit.layer.1", "vit.layer.2", "vit.layer.3"}
    llm = {"llm.embed", "llm.layer.0", "llm.layer.1", "llm.layer.2", "llm.layer.3", "llm.head"}
    every = vit | {"projector"} | llm
    cases = [  # (flags, the units that train, units of the frozen prefix)
        (Freeze(vit=True), every - vit, 5),
        (Freeze(vit=True, unfreeze_vit_layers=-2), every - {"vit.embed", "vit.layer.0", "vit.layer.1"}, 3),
        (Freeze(vit=True, unfreeze_vit_layers=1), every - {"vit.embed", "vit.layer.0"}, 2),
        (Freeze(projector=True), every - {"projector"}, 0),
        (Freeze(llm=True, unfreeze_lm_head=True), vit | {"projector", "llm.head"}, 0),
        (Freeze(vit=True, llm=True), {"projector"}, 5),
    ]
    for freeze, trains, prefix in cases:
        t = freeze.trainable(units)
        assert {u.name for u, ok in zip(units, t.trains) if ok} == trains, freeze
        assert t.frozen_prefix == prefix, freeze


def test_roles_and_unfreeze_slices():
    assert codes_of(Freeze(vit=True)) == ("....." + "PEttttL", 5)
    assert codes_of(Freeze(vit=True, unfreeze_vit_layers=-2)) == ("...vvPEttttL", 3)  # the last two
    assert codes_of(Freeze(vit=True, unfreeze_vit_layers=1)) == ("..vvvPEttttL", 2)  # layers [1:]: v0 stays frozen
    assert codes_of(Freeze(vit=True, llm=True)) == (".....P......", 5)
    assert codes_of(Freeze(llm=True, unfreeze_lm_head=True)) == ("IvvvvP.....L", 0)
    assert codes_of(Freeze(projector=True)) == ("Ivvvv.EttttL", 0)
    with pytest.raises(UserError, match="nothing would train"):
        Freeze(vit=True, projector=True, llm=True).trainable(build_units(TINY))
    with pytest.raises(UserError, match="needs --freeze-vit"):
        Freeze(unfreeze_vit_layers=-1).trainable(build_units(TINY))
    with pytest.raises(UserError, match="tied"):
        Freeze(llm=True, unfreeze_lm_head=True).trainable(build_units(TINY), tie_word_embeddings=True)


def test_frozen_costs_and_static_bytes():
    """Frozen prefix: forward only, nothing kept; frozen below a trained unit: half the backward, activations
    kept; static bytes: weights only for frozen units (per-parameter bytes of the precision, by hand)."""
    raw = analytic_costs(TINY, MicroBatchShape(4, 256))
    t = Freeze(vit=True, llm=True).trainable(build_units(TINY))
    got = t.apply(raw)
    for i, (r, g) in enumerate(zip(raw.units, got.units)):
        assert g.fwd_s == r.fwd_s and g.param_count == r.param_count
        if i < 5:
            assert (g.bwd_s, g.act_bytes, g.act_bytes_full, g.frozen) == (0.0, 0.0, 0.0, True)
        elif i == 5:
            assert g == r
        else:
            assert g.bwd_s == pytest.approx(0.5 * r.bwd_s) and g.act_bytes == r.act_bytes and g.frozen
    layout = parse_layout("Iv*4PEt*2|t*2L", TINY, 2)
    for precision, dp, dist_opt in ((FP32_ADAM, 1, False), (MIXED_BF16_ADAM, 4, True)):
        mem = stage_memory(got, layout, None, 2, 1, dp, 4, dist_opt, precision)
        per_trained = precision.param_bytes + precision.grad_bytes + precision.optimizer_bytes / (dp if dist_opt else 1)
        for s, rng in enumerate(layout.stage_slices()):
            want = sum(raw.units[i].param_count * (per_trained if t.trains[i] else precision.param_bytes) for i in rng)
            assert mem[s].static_bytes == pytest.approx(want)
        # a frozen prefix keeps no activations: stage 0 holds the projector's and the LLM's only
        assert mem[0].act_bytes_per_mb == pytest.approx(sum(raw.units[i].act_bytes for i in range(5, 9)))


def test_partition_cli_takes_the_freeze_flags(tmp_path):
    from omnibal_ext.model.cli import main

    out = main(["--model", "internvl-6b-20b", "--pp", "4", "--json", str(tmp_path / "p.json"), "--freeze-ViT"])
    assert out["freeze"] == ["--freeze-vit"]
    layers = out["layers"]
    assert all(u["frozen"] and u["bwd_s"] == 0 for u in layers if u["name"].startswith("vit."))
    plain = main(["--model", "internvl-6b-20b", "--pp", "4", "--json", str(tmp_path / "q.json")])
    # the ViT is cheaper when frozen, so the searched layout puts more units before the LLM's first stage
    assert out["layouts"]["searched"]["bottleneck_s"] < plain["layouts"]["searched"]["bottleneck_s"]
    assert out["layouts"]["searched"]["flag"] != plain["layouts"]["searched"]["flag"]


def test_trainer_flags_and_aliases():
    from megatron.training.arguments import parse_flags
    from megatron.training.specs import run_config

    args = parse_flags(["--freeze-ViT", "--freeze-LM", "--unfreeze-lm-head", "--unfreeze-vit-layers", "-1"])
    assert (args.freeze_vit, args.freeze_llm, args.unfreeze_vit_layers, args.unfreeze_lm_head) == (True, True, -1, True)
    config = run_config(args, 1)
    assert "".join("x" if t else "." for t in config.model.trainable.trains) == "....xx.....x"
    for bad in (["--unfreeze-lm-head"], ["--freeze-vit", "--freeze-projector", "--freeze-llm"], ["--vision-lr", "-1"]):
        with pytest.raises(UserError):
            parse_flags(bad)


def _schedule_lr(peak, low, it, warmup, decay, style):
    """Megatron's LR at step ``it`` (samples): linear warm-up from 0, then ``style`` decay from peak to low."""
    if warmup and it <= warmup:
        return peak * it / warmup
    ratio = (it - warmup) / (decay - warmup)
    if style == "constant":
        return peak
    if style == "linear":
        return low + (peak - low) * (1 - ratio)
    return low + (peak - low) * 0.5 * (math.cos(math.pi * ratio) + 1)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_per_module_lr_follows_the_schedule(megatron_world, style):
    """--vision-lr and --projector-lr: each parameter's group has its own peak, the minimum scaled alike, and
    every group follows the schedule (checked at several iterations against the formula, by the parameters'
    roles); frozen units are in no group."""
    from megatron.training import setup, training
    from megatron.training.arguments import parse_config

    config = parse_config(["--lr", "1e-3", "--min-lr", "1e-4", "--vision-lr", "2e-4", "--projector-lr", "5e-3",
                           "--lr-decay-style", style, "--lr-warmup-iters", "3", "--train-iters", "10",
                           "--freeze-vit", "--unfreeze-vit-layers", "-2"])
    plan = setup.build_run_plan(config, config.model.spec, torch.device("cpu"))
    model = training.build_model(plan, 5, torch.device("cpu"))
    optimizer, scheduler = training.build_optimizer(plan, model)
    stage = model[0].module
    trained = {id(p): p for p in stage.parameters() if p.requires_grad}
    in_groups = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_groups == set(trained)
    frozen_vit = [p for name, p in stage.named_parameters() if not p.requires_grad]
    assert frozen_vit and all(p.vlm_role in "Iv" for p in frozen_vit)
    peaks = {"I": 2e-4, "v": 2e-4, "P": 5e-3}
    gbs = config.optim.global_batch_size
    warmup, decay = 3 * gbs, 10 * gbs
    for it in range(1, 11):
        scheduler.step(increment=gbs)
        for g in optimizer.param_groups:
            roles = {p.vlm_role for p in g["params"]}
            if not roles:
                continue
            (peak,) = {peaks.get(r, 1e-3) for r in roles}
            want = _schedule_lr(peak, 1e-4 * peak / 1e-3, it * gbs, warmup, decay, style)
            assert g["lr"] == pytest.approx(want, rel=1e-9, abs=1e-15), (it, roles, g["lr"], want)
    assert {p.vlm_role for g in optimizer.param_groups for p in g["params"]} == set("vPEtL")


@pytest.mark.slow
def test_pp2_frozen_vit_and_llm_checkpoints_and_resume(tmp_path, data_cache):
    """--freeze-vit --freeze-llm at PP2 (stage 1: frozen LLM layers and head below the trained projector): every
    ViT and LLM tensor of the checkpoints of iterations 1 and 6 bit-identical, the projector's changed, optimizer
    state for the projector only; resumed with --freeze-vit only, the LLM gets fresh optimizer state (logged)
    and trains."""
    from torch.distributed.checkpoint import FileSystemReader

    from launch import checkpoint_tensors, run_training

    base = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--lr-warmup-iters", "0", "--eval-interval", "0", "--data-cache-dir", str(data_cache), "--seed", "3"]
    ckpt = tmp_path / "ckpt"
    records, out = run_training(2, base + ["--train-iters", "6", "--freeze-vit", "--freeze-llm", "--save", str(ckpt),
                                           "--save-interval", "5"], tmp_path, "frozen")
    assert "frozen I v*4 E t*4 L" in out
    run_training(2, base + ["--train-iters", "1", "--freeze-vit", "--freeze-llm", "--save", str(tmp_path / "first")],
                 tmp_path, "first")
    first, last = checkpoint_tensors(tmp_path / "first" / "iter_0000001"), checkpoint_tensors(ckpt / "iter_0000006")
    assert first.keys() == last.keys()
    changed = sorted(k for k in first if not torch.equal(first[k], last[k]))
    assert changed and all(k.startswith("projector.") for k in changed)
    assert {k for k in first if k.startswith("projector.")} == set(changed)
    assert sum(k.startswith(("vit.", "llm.")) for k in first) > 50
    meta = FileSystemReader(str(ckpt / "iter_0000006")).read_metadata().state_dict_metadata
    opt_params = {".".join(k.split(".")[3:]) for k in meta if k.startswith("optimizer.state.exp_avg")}
    assert opt_params == {k for k in first if k.startswith("projector.")}
    resumed, out = run_training(2, base + ["--train-iters", "8", "--lr-decay-iters", "6", "--freeze-vit", "--load",
                                           str(ckpt), "--save", str(tmp_path / "resumed")], tmp_path, "resumed")
    assert "fresh optimizer state" in out and "llm.layer.0." in out
    assert [r["iteration"] for r in resumed] == [7, 8]
    after = checkpoint_tensors(tmp_path / "resumed" / "iter_0000008")
    assert not torch.equal(after["llm.head.output.weight"], last["llm.head.output.weight"])
    assert all(torch.equal(after[k], last[k]) for k in last if k.startswith("vit."))
