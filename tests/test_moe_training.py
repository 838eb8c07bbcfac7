"""Training with MoE decoder layers (megatron-core's MoELayer, aux loss on) on the built-in tiny model under expert,
tensor, pipeline and data parallelism, against the single-process run (random and ISF batching): losses, gradient
norms and the logged aux loss within 1e-4 / 1e-3 for 6 iterations; the expert load logged and written per layer."""
import json
from pathlib import Path

import pytest

from canonical import TINY_MOE

pytestmark = pytest.mark.slow

BASE = TINY_MOE + ["--train-iters", "6"]
ISF = ["--omnibal-isf", "--omnibal-isf-qv", "8", "--omnibal-isf-qt", "240"]


@pytest.fixture(scope="module")
def data(data_cache):
    return ["--data-cache-dir", str(data_cache)]


def assert_close(got, want, rel):
    assert len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


def column(records, key):
    return [r[key] for r in records]


def ep2_logging_load(shared_runs) -> list[str]:
    """EP2 with --log-expert-load into the shared runs' folder: the ep2 run of test_moe_parallel_equals_serial, whose
    file test_expert_load_file_counts_every_routed_token reads (one launch for both)."""
    return ["--expert-model-parallel-size", "2", "--log-expert-load", str(shared_runs.folder / "expert_load.jsonl")]


@pytest.mark.parametrize("nproc,flags", [
    (2, None),  # ep2_logging_load
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),  # ETP = TP = 2
    (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    (4, ["--expert-model-parallel-size", "2"]),  # EP2 x expert-DP2 (DP4 for the dense part)
    (4, ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]),
], ids=["ep2", "tp2-sp", "ep2pp2", "ep2dp2", "ep2etp2"])
def test_moe_parallel_equals_serial(data, serial_run, shared_runs, nproc, flags):
    serial = serial_run(BASE + data)
    records, _, _ = shared_runs.run(nproc, BASE + data + (ep2_logging_load(shared_runs) if flags is None else flags))
    assert_close(column(records, "lm loss"), column(serial, "lm loss"), 1e-4)
    assert_close(column(records, "grad norm"), column(serial, "grad norm"), 1e-3)
    assert_close(column(records, "moe aux loss"), column(serial, "moe aux loss"), 1e-4)
    # the logged expert load is every rank's tokens: the same routing as the serial run's
    assert_close(column(records, "expert load imbalance"), column(serial, "expert load imbalance"), 1e-6)
    assert records[5]["lm loss"] < records[0]["lm loss"]
    # 3 MoE layers, each near its balanced value 1 (megatron-core's switch loss: E * sum_e f_e p_e)
    assert all(2.5 < r["moe aux loss"] < 6.0 for r in records)


def test_moe_isf_ep2_equals_ep1(data, shared_runs):
    """ISF batching: its groups depend on the data-parallel size, and EP2 needs two data-parallel ranks, so the
    reference is the same two ranks at EP1 (every expert on both, gradients all-reduced over DP)."""
    ep1, _, _ = shared_runs.run(2, BASE + data + ISF)
    ep2, _, _ = shared_runs.run(2, BASE + data + ISF + ["--expert-model-parallel-size", "2"])
    for key, rel in (("lm loss", 1e-4), ("grad norm", 1e-3), ("moe aux loss", 1e-4)):
        assert_close(column(ep2, key), column(ep1, key), rel)


def test_seq_aux_loss_per_packed_sample_tp2_sp_equals_serial(data, serial_run, shared_runs):
    """seq_aux_loss (megatron/vlm/layers/moe.py: per packed sample, padding excluded) with ISF packing several samples into
    a row and sequence parallelism cutting them over the two TP ranks (each sample's routed tokens summed over
    TP): the losses, gradient norms and logged aux loss of the serial run."""
    flags = BASE + data + ISF + ["--moe-router-load-balancing-type", "seq_aux_loss"]
    serial = serial_run(flags)
    records, _, _ = shared_runs.run(2, flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    for key, rel in (("lm loss", 1e-4), ("grad norm", 1e-3), ("moe aux loss", 1e-4)):
        assert_close(column(records, key), column(serial, key), rel)
    assert all(2.5 < r["moe aux loss"] < 6.0 for r in serial)  # 3 MoE layers, each near its balanced value 1


def test_expert_load_file_counts_every_routed_token(data, shared_runs):
    """--log-expert-load: per iteration, per MoE layer, tokens per expert summed over the ranks; each layer routes
    every real token of the iteration to top-k = 2 experts, so its counts sum to 2 x the same token count, the
    same in every layer; the logged imbalance is the largest max/mean over the layers."""
    flags = ep2_logging_load(shared_runs)
    records, _, _ = shared_runs.run(2, BASE + data + flags)
    path = Path(flags[-1])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [1, 2, 3, 4, 5, 6]
    for line, record in zip(lines, records):
        layers = line["tokens_per_expert"]
        assert sorted(layers) == ["0", "2", "3"]  # the MoE layers of --moe-layer-freq [1,0,1,1]
        sums = {sum(c) for c in layers.values()}
        assert len(sums) == 1 and sums.pop() % 2 == 0
        worst = max(max(c) / (sum(c) / len(c)) for c in layers.values())
        assert abs(record["expert load imbalance"] - worst) < 1e-9
        assert sum(record["ep rank tokens"]) == sum(sum(c) for c in layers.values())
