"""Measured static bytes (megatron-core's allocations) equal the memory model's prediction.

tests/static_probe.py (a case of the worker pool of 1 or 2 ranks) builds the stage model and megatron-core's optimizer on CPU (bf16 parameters:
Float16OptimizerWithFloat16Params or DistributedOptimizer inside a ChainedOptimizer), runs one optimizer step
(so torch allocates Adam's moments) and prints static_bytes' breakdown, measured after that step, beside
omnibal_ext.memory.memory_model's static bytes; the breakdown before the step (moments not yet allocated,
counted as they will be) must equal it.
"""
import json

import pytest

import pool


def probe(flags, out_dir, nproc=1):
    run = pool.run_case("static_probe:main", [str(out_dir), *flags], nproc, out_dir, timeout=300)
    assert run.returncode == 0, run.output[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("flags, per_param", [
    (["--bf16"], {"params": 2, "grads": 4, "master": 4, "moments": 8}),
    (["--bf16", "--use-distributed-optimizer"], {"params": 2, "grads": 4, "master": 4, "moments": 8}),
    (["--use-distributed-optimizer"], {"params": 4, "grads": 4, "master": 0, "moments": 8}),
])
def test_static_bytes_match_memory_model_dp1(flags, per_param, tmp_path):
    (row,) = probe(flags, tmp_path)
    n, measured = row["params"], row["measured"]
    for kind, b in per_param.items():  # fp32 master weights of bf16 parameters are counted now
        assert measured[kind] == b * n, (kind, measured)
    # Adam's state as torch allocated it in the step: two fp32 tensors per updated tensor, one float per parameter
    assert row["moment_tensors"]["exp_avg"][1] == row["moment_tensors"]["exp_avg_sq"][1] == 4 * n
    assert row["moment_tensors"]["exp_avg"][0] > 0
    assert row["before_step"] == measured  # counted before the step as the step then allocates
    assert measured["total"] == row["predicted"]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--bf16", "--use-distributed-optimizer"], ["--bf16", "--pipeline-model-parallel-size", "2"]])
def test_static_bytes_match_memory_model_two_ranks(flags, tmp_path):
    rows = probe(flags, tmp_path, nproc=2)
    for row in rows:
        assert abs(row["measured"]["total"] - row["predicted"]) <= 1e-3 * row["predicted"], row
    if "--use-distributed-optimizer" in flags:  # DP 2: master weights and moments sharded in two
        assert rows[0]["measured"]["master"] == 2 * rows[0]["params"]


@pytest.mark.slow
def test_static_bytes_of_frozen_units_match_memory_model(tmp_path):
    """--freeze-vit --freeze-llm at PP2: frozen units hold their weights only (no gradient buffer, no optimizer
    state); stage 1 (frozen LLM layers and head) trains nothing. Measured equals the memory model exactly."""
    rows = probe(["--pipeline-model-parallel-size", "2", "--freeze-vit", "--freeze-llm"], tmp_path, nproc=2)
    for row in rows:
        assert row["measured"]["total"] == row["predicted"], row
    stage1 = rows[1]["measured"]
    assert rows[1]["trained_params"] == 0 and stage1["grads"] == stage1["moments"] == 0
    assert rows[0]["measured"]["grads"] == 4 * rows[0]["trained_params"] > 0  # the projector's (fp32)
