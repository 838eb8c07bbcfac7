"""scripts/bench_moe.py: its summary row and markdown table on a synthetic run (hand-computed values), the plot,
the balancing flags per config (each refused or accepted by the trainer's parser as the brief says), and its
--quick path end to end (4 configs x 2 iterations at EP2: slow)."""
import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_moe as bm  # noqa: E402


def _series():
    return {"iteration": [1, 2, 3, 4], "expert_load_imbalance": [2.0, 1.8, 1.4, 1.2],
            "ep_load_imbalance": [1.5, 1.3, 1.1, 1.05], "ms": [900.0, 300.0, 200.0, 400.0],
            "lm_loss": [6.0, 5.0, 4.0, 3.0], "aux_loss": [None] * 4}


def test_summary_windows_and_table():
    row = bm.summary("bias", _series(), first=2, last=2, warmup=1)
    assert row["router"] == "sigmoid" and row["iterations"] == 4
    assert row["imbalance_first"] == pytest.approx(1.9) and row["imbalance_last"] == pytest.approx(1.3)
    assert row["ep_imbalance_last"] == pytest.approx(1.075)
    assert row["ms_per_iteration"] == pytest.approx(300.0)  # median of 300, 200, 400 (the first left out)
    assert (row["loss_first"], row["loss_last"]) == pytest.approx((5.5, 3.5))
    table = bm.markdown([row, bm.summary("none", _series(), 2, 2, 1)], first=2, last=2).splitlines()
    assert len(table) == 4 and table[0].count("|") == 9
    assert table[2] == "| bias | sigmoid | 1.900 | 1.300 | 1.075 | 300 | 5.500 | 3.500 |"
    assert table[3].startswith("| none | softmax |")


def test_plot_writes_png(tmp_path):
    path = bm.plot({"none": _series(), "bias": _series()}, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.endswith("b.png")


@pytest.mark.parametrize("config", bm.CONFIGS)
def test_config_flags_parse(config):
    """Each config's flags are accepted by the trainer's parser at EP2 on 2 ranks, with the balancing it names."""
    from megatron.training.arguments import parse_flags
    from megatron.training.specs import model_spec_of, moe_run_of

    args = parse_flags(bm.run_flags(config, 3, 7, ROOT, 0.01, 0.01), world_size=2)
    moe, run = model_spec_of(args).language.moe, moe_run_of(args)
    assert (moe.num_experts, moe.topk, run.ep) == (8, 2, 2)
    assert moe.load_balancing_type == (config if config in ("aux_loss", "seq_aux_loss") else "none")
    assert run.expert_bias == (config == "bias")
    assert moe.score_function == ("sigmoid" if config == "bias" else "softmax")


@pytest.mark.bench
def test_quick_run_writes_table_json_and_plot(tmp_path, pooled_benchlib):
    assert bm.main(["--quick", "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0  # runs in the pools
    res = json.loads((tmp_path / "moe_balance.json").read_text())
    assert [r["config"] for r in res["rows"]] == list(bm.CONFIGS) and res["iterations"] == 2
    for config, s in res["series"].items():
        assert s["iteration"] == [1, 2] and all(x >= 1.0 for x in s["expert_load_imbalance"]), config
        assert (s["aux_loss"][0] is not None) == (config in ("aux_loss", "seq_aux_loss")), config
    assert (tmp_path / "moe_balance.md").read_text().count("\n") == 6
    assert (tmp_path / "moe_balance.png").stat().st_size > 1000
