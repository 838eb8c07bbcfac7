"""`omnibal partition` output contract, in-process; plots are written."""
import argparse
import json

import pytest

from omnibal_ext.errors import UserError

from omnibal_ext.model.cli import add_partition_parser, main
from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs, DEVICES
from omnibal_ext.model.costs import CostTable
from omnibal_ext.model.units import build_units, get_preset


def test_contract_keys_and_targets(tmp_path, capsys):
    out = tmp_path / "plan.json"
    res = main(["--model", "internvl-6b-20b", "--pp", "4", "--json", str(out), "--plot", str(tmp_path / "fig")])
    d = json.loads(out.read_text())
    assert d == json.loads(json.dumps(res))
    names = [u.name for u in build_units(get_preset("internvl-6b-20b"))]
    assert [l["name"] for l in d["layers"]] == names
    for l in d["layers"]:
        assert set(l) >= {"name", "kind", "fwd_s", "bwd_s", "act_bytes", "send_bytes"}
    assert d["search_seconds"] >= 0
    assert set(d["layouts"]) == {"default", "param_split", "searched", "optimal"}
    total = sum(l["fwd_s"] + l["bwd_s"] for l in d["layers"])
    for name, lay in d["layouts"].items():
        assert set(lay) >= {"stage_layers", "stage_times_s", "bottleneck_over_mean", "flag"}
        assert sum(lay["stage_layers"]) == len(names) and min(lay["stage_layers"]) > 0
        # stage times recomputed from the layers list
        edges = [0]
        for c in lay["stage_layers"]:
            edges.append(edges[-1] + c)
        times = [sum(l["fwd_s"] + l["bwd_s"] for l in d["layers"][a:b]) for a, b in zip(edges[:-1], edges[1:])]
        assert lay["stage_times_s"] == pytest.approx(times)
        assert lay["bottleneck_over_mean"] == pytest.approx(max(times) / (total / 4))
    assert d["layouts"]["searched"]["bottleneck_over_mean"] <= 1.03
    assert d["layouts"]["default"]["flag"].startswith("Iv*45PE")
    assert "searched" in capsys.readouterr().out
    for suffix in ("stage_times", "timeline_default", "timeline_searched"):
        assert (tmp_path / f"fig_{suffix}.png").stat().st_size > 1000


def test_interleaved_and_profile(tmp_path):
    spec = get_preset("tiny")
    shape = MicroBatchShape(2, 64)
    prof = analytic_costs(spec, shape, device=DEVICES["cpu"], efficiency={"llm_layer": 0.01})
    path = tmp_path / "profile.json"
    CostTable(tuple(prof.units), "profile", {"device": "cpu", "dtype": "fp32", "spec": spec.to_dict(),
                                             "shape": shape.to_dict(), "tp": 1}).save(str(path))
    out = tmp_path / "plan.json"
    d = main(["--model", "tiny", "--pp", "2", "--vpp", "2", "--profile", str(path), "--device", "cpu",
              "--tiles", "2", "--llm-tokens", "64", "--json", str(out)])
    assert d["cost_source"] == "calibrated"
    for lay in d["layouts"].values():
        assert len(lay["stage_layers"]) == 4 and len(lay["stage_times_s"]) == 2
    # the calibration made LLM layers 100x slower than the analytic default: they carry the time
    llm = [l for l in d["layers"] if l["kind"] == "llm_layer"]
    assert llm[0]["fwd_s"] == pytest.approx(prof.units[7].fwd_s)


def test_subparser_registration(tmp_path):
    parser = argparse.ArgumentParser(prog="omnibal")
    add_partition_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["partition", "--model", "tiny", "--pp", "3", "--json", str(tmp_path / "p.json")])
    d = args.func(args)
    assert d["pp"] == 3 and len(d["layouts"]["optimal"]["stage_layers"]) == 3


def test_bad_profile_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"units": [{"name": "x"}]}')
    with pytest.raises(UserError, match="bad.json"):
        main(["--model", "tiny", "--pp", "2", "--profile", str(bad), "--json", str(tmp_path / "o.json")])
