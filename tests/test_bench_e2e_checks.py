"""scripts/bench_e2e.py's own checks: its ISF group count is the trainer's (megatron/training/isf.py search_isf on the
dataset the bench writes, read by the family's reader: in predicted time for Qwen, by counts for the tiled model),
and "each level adds speed" is judged against the rows' run-to-run spread (PASS within the tolerance, FAIL beyond,
NOISY when the runs spread too much to tell)."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.parametrize("name", ["qwen3-vl", "internvl"])  # qwen3-vl: 11 groups in time, 10 by counts
def test_isf_group_count_is_the_trainers(tmp_path, name):
    import bench_e2e
    import benchlib as bl
    from megatron.training.flags import build_parser
    from megatron.training.isf import search_isf
    from megatron.training.setup import build_dataset
    from megatron.training.specs import run_config
    from megatron.training.tokenizer_setup import setup_tokenizer
    from megatron.vlm.data.synthetic import LengthRule, sample_plan

    model = bench_e2e.MODELS[name]
    n, k, seed = 40, 4, 1234
    data = bl.build_data(tmp_path / "data", n, model.image_px, model.tokens_per_image)
    rule = LengthRule(tokens_per_tile_model=model.tokens_per_image, max_tokens=bl.MAX_SAMPLE_TOKENS)
    planned = sample_plan(bl.stats_files(None), n, rule, 0)
    args = build_parser().parse_args(bl.trainer_argv({**model.flags, "--data-path": data.meta, "--seed": seed,
                                                      "--seq-length": data.seq_length, "--micro-batch-size": k,
                                                      "--global-batch-size": k, "--omnibal-isf": True,
                                                      "--data-cache-dir": str(tmp_path / "cache")}))
    config = run_config(args, 1)
    tokenizer, spec = setup_tokenizer(config)
    dataset = build_dataset(config, spec, tokenizer, data.meta)
    assert dataset.sample_lengths()[0].tolist() == planned["tokens"].tolist()  # the bench's lengths are the reader's
    want = len(search_isf(config, spec, dataset).grouping)
    spec = bench_e2e.spec_of(model)
    assert bench_e2e.isf_group_count(spec, model, planned["tokens"], rule.tiles(planned["vit_num"]), 1, k, 1,
                                     seed) == want


def _row(name, per_run):
    import bench_e2e
    import numpy as np

    return {"name": name, "samples_per_s": float(np.mean(per_run)), "run_spread": bench_e2e.run_spread(per_run)}


def test_level_check_against_noise():
    import bench_e2e

    assert bench_e2e.run_spread([10.0]) is None and bench_e2e.run_spread([9.0, 11.0]) == pytest.approx(0.2)
    base = _row("a", [10.0, 10.2])  # spread 2%: the stated 3% tolerance applies
    assert bench_e2e.level_check(base, _row("b", [12.0, 12.1])).startswith("PASS")
    slower = bench_e2e.level_check(base, _row("b", [9.9, 9.95]))  # 2% slower, within 3%
    assert slower.startswith("PASS") and "within the noise" in slower
    assert bench_e2e.level_check(base, _row("b", [9.0, 9.1])).startswith("FAIL")  # 10% slower, runs agree
    wide = _row("b", [9.0, 9.9])  # 10% spread: the tolerance widens to it
    assert bench_e2e.level_check(base, wide).startswith("PASS")
    assert bench_e2e.level_check(base, _row("b", [6.0, 8.0])).startswith("NOISY")  # 29% spread: decides nothing
    one = {"name": "c", "samples_per_s": 9.0, "run_spread": None}
    assert bench_e2e.level_check(base, one).startswith("FAIL") and "3.0%" in bench_e2e.level_check(base, one)
