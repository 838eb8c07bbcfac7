"""``omnibal memory`` on a hand-built cost table of the tiny preset (no analytic model needed)."""
import argparse
import json

import numpy as np
import pytest

from omnibal_ext.errors import UserError

from omnibal_ext.memory.cli import add_memory_parser, main
from omnibal_ext.memory.memory_model import GIB, stage_memory
from omnibal_ext.memory.recompute import parse_recompute_plan
from omnibal_ext.model.costs import CostTable, UnitCost
from omnibal_ext.model.layout import parse_layout
from omnibal_ext.model.units import PRESETS, build_units


@pytest.fixture()
def tiny_costs(tmp_path):
    rng = np.random.default_rng(5)
    units = []
    for u in build_units(PRESETS["tiny"]):
        layer = u.kind.endswith("layer")
        act = float(rng.integers(100, 200)) * 2**20
        units.append(UnitCost(u.name, u.kind, 1.0, 2.0, act, act / 10 if layer else act, act / 2 if layer else act,
                              0.25 if layer else 0.0, 1e6, int(rng.integers(1, 5)) * 2**20))
    table = CostTable(tuple(units), source="hand")
    path = tmp_path / "costs.json"
    table.save(str(path))
    return table, str(path)


def run(argv, tmp_path):
    out = tmp_path / "out.json"
    result = main(argv + ["--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    return result


def test_cli_plans_within_budget(tiny_costs, tmp_path, capsys):
    table, path = tiny_costs
    layout_flag = "Iv*3|vPEt*4L"
    args = ["--model", "tiny", "--pp", "2", "--dp", "2", "--micro-batches", "4", "--budget-gib", "1.0",
            "--layout", layout_flag, "--costs", path]
    out = run(args, tmp_path)
    layout = parse_layout(layout_flag, PRESETS["tiny"], 2)
    stages = parse_recompute_plan(out["recompute"]["flag"], 2)
    mem = stage_memory(table, layout, stages, 2, 1, 2, 4)
    assert [s["peak_bytes"] for s in out["stages"]] == [m.peak_bytes for m in mem]
    assert all(s["peak_bytes"] <= 1.0 * GIB for s in out["stages"])
    none = stage_memory(table, layout, None, 2, 1, 2, 4)
    assert out["baselines"]["none"]["stage_peak_bytes"] == [m.peak_bytes for m in none]
    assert max(m.peak_bytes for m in none) > 1.0 * GIB  # so some recompute was needed
    assert out["recompute"]["flag"] != "-|-"
    assert "--recompute-plan" in capsys.readouterr().out


def test_cli_errors(tiny_costs, tmp_path):
    _, path = tiny_costs
    base = ["--model", "tiny", "--pp", "2", "--micro-batches", "4", "--costs", path]
    with pytest.raises(UserError, match="pipeline stage 0 needs .* short by"):
        run(base + ["--budget-gib", "0.05"], tmp_path)
    assert json.loads((tmp_path / "out.json").read_text())["error"].startswith("pipeline stage 0 needs")
    with pytest.raises(UserError, match="--layout: stage 0 gives 't'"):
        run(base + ["--budget-gib", "4", "--layout", "t*4|L"], tmp_path)
    with pytest.raises(UserError, match="stage 0 fully recomputes 5 ViT"):
        run(base + ["--budget-gib", "4", "--recompute-plan", "v5|t1"], tmp_path)


def test_cli_search_and_subparser(tiny_costs, tmp_path):
    _, path = tiny_costs
    parser = argparse.ArgumentParser(prog="omnibal")
    add_memory_parser(parser.add_subparsers(dest="command"))
    out_path = tmp_path / "s.json"
    args = parser.parse_args(["memory", "--model", "tiny", "--pp", "2", "--micro-batches", "4", "--budget-gib",
                              "1.0", "--layout", "joint", "--costs", path, "--json", str(out_path)])
    out = args.func(args)
    assert out["layout"]["how"] in ("searched", "recompute-aware", "joint-optimal")
    assert out["layout"]["candidates"][-1]["how"] == "joint-optimal"
    assert min(c["bottleneck_s"] for c in out["layout"]["candidates"]) == max(out["recompute"]["stage_time_s"])
