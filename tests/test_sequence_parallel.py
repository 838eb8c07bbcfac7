"""--sequence-parallel at TP 2 against the serial run, and its activation bytes against the memory model.

Launches: the serial run and a TP2 --sequence-parallel run for random batching and for --omnibal-isf (the
packed rows are padded to a multiple of TP), a TP2 run without it (activation memory), and one torchrun of
tests/sp_profile_probe.py that profiles one ViT and one LLM layer at TP 2 with and without it.
"""
import json
from pathlib import Path

import pytest

from act_bounds import act_ratio_range
from canonical import TINY
from launch import run_training

pytestmark = pytest.mark.slow

BASE = TINY + ["--train-iters", "8"]
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _memory(workdir: Path, name: str) -> dict:
    return [json.loads(x) for x in (workdir / f"{name}.jsonl").read_text().splitlines()
            if json.loads(x).get("prefix") == "memory "][0]


@pytest.mark.parametrize("isf", [False, True], ids=["random", "isf"])
def test_sequence_parallel_equals_serial(tmp_path, data_cache, serial_run, isf):
    flags = BASE + ["--data-cache-dir", str(data_cache)] + (["--omnibal-isf"] if isf else [])
    serial = serial_run(flags)  # the session's serial run of these flags (shared with the interleaved tests)
    sp, _ = run_training(2, flags + SP + ["--log-activation-memory"], tmp_path, "sp")
    assert [r["iteration"] for r in sp] == list(range(1, 9))
    for got, want in zip(sp, serial):  # 8 iterations: replicated parameters' gradients are summed over TP
        assert abs(got["lm loss"] - want["lm loss"]) <= 1e-4 * abs(want["lm loss"]), (got, want)
        assert abs(got["grad norm"] - want["grad norm"]) <= 1e-3 * abs(want["grad norm"]), (got, want)
    assert sp[-1]["lm loss"] < sp[0]["lm loss"]
    print("max relative loss delta", max(abs(a["lm loss"] - b["lm loss"]) / abs(b["lm loss"]) for a, b in zip(sp, serial)))
    if not isf:  # per-rank activations: sequence parallelism keeps fewer than plain TP 2
        run_training(2, flags + ["--tensor-model-parallel-size", "2", "--log-activation-memory",
                                 "--train-iters", "2"], tmp_path, "tp")
        with_sp = _memory(tmp_path, "sp")["peak_act_bytes_per_stage"][0]
        without = _memory(tmp_path, "tp")["peak_act_bytes_per_stage"][0]
        print("peak activation bytes per rank: TP2+SP", with_sp, "TP2", without)
        _, hi = act_ratio_range({"tp": 2, "sequence_parallel": True}, {"tp": 2})  # the model: 0.86 at most
        assert 0 < with_sp < without and with_sp / without < hi, (with_sp, without, hi)


def test_sequence_parallel_activation_bytes_match_the_model(tmp_path):
    """Measured saved bytes of one ViT and one LLM layer at TP 2 (tests/sp_profile_probe.py) against
    analytic_costs(tp=2, device cpu, sequence_parallel=...): each layer within 5% with and without it, with and
    without full recompute (each tile padded 17 -> 18 tokens and the LLM row 301 -> 302 under it), and what
    sequence parallelism saves (the replicated part halved) within 5% of what the model says it saves."""
    import sp_profile_probe

    from omnibal_ext.model.cost_model import DEVICES, MicroBatchShape, analytic_costs
    from omnibal_ext.model.units import get_preset

    measured = sp_profile_probe.launch(tmp_path)
    shape = MicroBatchShape.from_dict(measured["shape"])
    model = {key: {u.kind: u for u in analytic_costs(get_preset("tiny"), shape, 2, DEVICES["cpu"],
                                                     attention="flash", sequence_parallel=key == "sp").units}
             for key in ("tp", "sp")}
    for kind in ("vit_layer", "llm_layer"):
        for key in ("tp", "sp"):
            for field in ("act_bytes", "act_bytes_full"):
                got, want = measured[key][kind][field], getattr(model[key][kind], field)
                print(kind, key, field, "measured", got, "model", want)
                assert got == pytest.approx(want, rel=0.05), (kind, key, field, got, want)
        saved = measured["tp"][kind]["act_bytes"] - measured["sp"][kind]["act_bytes"]
        assert saved == pytest.approx(model["tp"][kind].act_bytes - model["sp"][kind].act_bytes, rel=0.05), kind
        assert measured["sp"][kind]["act_bytes_full"] < 0.6 * measured["tp"][kind]["act_bytes_full"], kind
