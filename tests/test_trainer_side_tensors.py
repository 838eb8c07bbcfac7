"""DeepStack-like side tensors through the trainer against the serial run of the same model (the oracle): the toy
family of ``toy_deepstack.py`` (defined outside megatron/ and omnibal_ext/, loaded by the launched ranks with
--family-module), whose ViT layers 1 and 2 feed mergers whose features are added to LLM layers 0 and 2 (units 2 -> 7,
3 -> 9). Only what tests/test_qwen3_vl_training.py and the conformance suite (the real DeepStack family, the same
crossings at PP2, interleaved V = 2, CP2 x PP2 and --freeze-vit) do not check:

* PP2 with full recompute, ``Iv*2|v*2PEt*4L``: feature 0 crosses ViT -> ViT and is read past the boundary, the
  layers recomputed;
* TP2 --sequence-parallel x PP2, ``Iv*3|vPEt*4L``: both features cross with this TP rank's tokens.

Losses of every iteration within 1e-5 (relative) of serial (4 micro-batches per iteration).
"""
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOY = str(Path(__file__).resolve().parent / "toy_deepstack.py")
BASE = ["--family-module", TOY, "--model", "toy-deepstack", "--train-iters", "3", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr-warmup-iters", "0", "--lr", "2e-3", "--log-interval", "1", "--seed", "7",
        "--eval-interval", "0"]
CASES = {
    "pp2-recompute": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PEt*4L",
                          "--recompute-granularity", "full"]),
    "tp2-sp-pp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size",
                       "2", "--pipeline-layout", "Iv*3|vPEt*4L"]),
}


def losses(records):
    return [r["lm loss"] for r in sorted(records, key=lambda r: r["iteration"])]


@pytest.mark.parametrize("case", list(CASES))
def test_side_tensors_equal_serial(data_cache, shared_runs, serial_run, case):
    nproc, parallel = CASES[case]
    flags = BASE + ["--data-cache-dir", str(data_cache)]
    serial = losses(serial_run(flags))
    records, out, _ = shared_runs.run(nproc, flags + parallel)
    got = losses(records)
    assert len(got) == len(serial) == 3
    assert all(abs(g - s) <= 1e-5 * abs(s) for g, s in zip(got, serial)), (case, got, serial)
    assert serial[-1] < serial[0]
