"""The decode-step cost model (``omnibal_ext.model.decode_cost``) against closed forms: a memory-bound step reads
every weight of the LLM's units and the keys and values of the context once; TP halves it; pipelining keeps one group
per stage in flight; MoE reads only the experts its tokens touch; and ``omnibal plan`` reports what its layouts serve
at."""
from __future__ import annotations

import json

import pytest

from omnibal_ext.model.cost_model import DEVICES, unit_param_counts
from omnibal_ext.model.decode_cost import DecodeLoad, decode_estimate, touched_experts, unit_decode_seconds
from omnibal_ext.model.layout import default_layout, parse_layout
from omnibal_ext.model.units import build_units, get_preset

H200 = DEVICES["h200-141g"]


def llm_params(spec) -> int:
    return sum(n for u, n in zip(build_units(spec), unit_param_counts(spec)) if u.code in "EtL")


def test_batch_one_reads_the_weights_and_the_cache():
    """qwen3-vl-8b at batch 1 is memory bound: the step is (LLM weights + keys and values of the context) in bf16 over
    the memory bandwidth, within the norms' few replicated weights."""
    spec = get_preset("qwen3-vl-8b")
    lm, context = spec.language, 2048
    kv = lm.num_layers * context * 2 * lm.kv_groups * lm.kv_channels
    want = 2.0 * (llm_params(spec) + kv) / H200.mem_bytes_per_s
    got = sum(unit_decode_seconds(spec, H200, 1, DecodeLoad(1, context)))
    assert got == pytest.approx(want, rel=1e-3)
    # the ViT and projector take no part in a decode step
    assert all(s == 0 for u, s in zip(build_units(spec), unit_decode_seconds(spec, H200, 1, DecodeLoad(1, 0)))
               if u.code not in "EtL")


def test_tensor_parallelism_splits_the_reads_and_adds_its_all_reduces():
    spec = get_preset("qwen3-vl-8b")
    one = sum(unit_decode_seconds(spec, H200, 1, DecodeLoad(1, 1024)))
    two = sum(unit_decode_seconds(spec, H200, 2, DecodeLoad(1, 1024)))
    assert one / 2 < two < one / 2 + 3 * spec.language.num_layers * 12e-6  # two all-reduces a layer, ~10 us each


def test_a_large_batch_is_compute_bound_and_serves_more_tokens():
    spec = get_preset("qwen3-vl-8b")
    layout = default_layout(spec, 1)
    small, large = (decode_estimate(spec, H200, 1, layout, DecodeLoad(b, 1024)) for b in (1, 512))
    assert large.tokens_per_s > 50 * small.tokens_per_s and large.s_per_token > small.s_per_token
    flops = sum(2.0 * 512 * n for u, n in zip(build_units(spec), unit_param_counts(spec)) if u.code in "tL")
    assert large.s_per_token >= flops / (H200.matmul_flops_per_s * 0.5)


def test_pipelining_keeps_a_group_per_stage_in_flight():
    """PP 2 with the LLM split evenly: two groups of half the batch; per token two ticks of the slower stage, so at a
    memory-bound batch (each stage reads half the weights per tick) the pipeline serves what one stage does."""
    spec = get_preset("qwen3-vl-8b")
    flat = decode_estimate(spec, H200, 1, default_layout(spec, 1), DecodeLoad(16, 1024))
    piped = decode_estimate(spec, H200, 1, default_layout(spec, 2), DecodeLoad(16, 1024))
    assert piped.groups == 2 and flat.groups == 1
    assert piped.s_per_token == pytest.approx(2 * max(piped.stage_step_s))
    assert piped.tokens_per_s == pytest.approx(flat.tokens_per_s, rel=0.15)
    # the ViT's stage sits decode steps out: a layout with the ViT alone on stage 0 decodes on one stage
    vit_alone = parse_layout("Iv*27P|Et*36L", spec, 2)
    assert decode_estimate(spec, H200, 1, vit_alone, DecodeLoad(16, 1024)).groups == 1


def test_moe_reads_the_experts_its_tokens_touch():
    assert touched_experts(128, 8, 1) == pytest.approx(8)
    assert touched_experts(128, 8, 10_000) == pytest.approx(128)
    spec = get_preset("qwen3-vl-30b-a3b")
    one = sum(unit_decode_seconds(spec, H200, 1, DecodeLoad(1, 0)))
    lm = spec.language
    dense = llm_params(spec) - lm.num_layers * lm.moe.num_experts * 3 * lm.hidden_size * lm.moe.ffn_hidden_size
    active = dense + lm.num_layers * lm.moe.topk * 3 * lm.hidden_size * lm.moe.ffn_hidden_size
    assert one == pytest.approx(2.0 * active / H200.mem_bytes_per_s, rel=1e-3)
    assert sum(unit_decode_seconds(spec, H200, 1, DecodeLoad(1, 0), ep=2)) < one


def test_plan_reports_what_its_layouts_serve_at(tmp_path, capsys):
    from omnibal_ext.cli import build_parser, run

    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps([{"vit_num": 1 + i % 3, "token_num": 300 + 37 * i} for i in range(64)]))
    out = tmp_path / "plan.json"
    assert run(build_parser(), ["plan", "--data", str(stats), "--model", "internvl3-2b", "--gpus", "8",
                                "--gpu-memory", "80", "--pp", "2", "--max-vpp", "1", "--serve-batch", "1", "8",
                                "--json", str(out)]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    rows = plan["serving"]
    assert {r["batch"] for r in rows} == {1, 8} and "baseline" in {r["setting"] for r in rows}
    assert all(r["tokens_per_s"] > 0 and r["ms_per_token"] > 0 and r["ttft_ms"] > 0 for r in rows)
    assert "serving (generation on the layout" in text and "tokens/s" in text
    assert run(build_parser(), ["plan", "--data", str(stats), "--model", "internvl3-2b", "--gpus", "8",
                                "--gpu-memory", "80", "--serve-batch", "0", "--json", str(out)]) == 1
    assert "--serve-batch" in capsys.readouterr().err
