"""Qwen3-VL training against the serial run, where DeepStack features cross pipeline stages (slow): a tiny Hugging
Face Qwen3-VL (``hf_tiny_qwen3_vl``: 3 ViT heads that TP 2 pads to 4, DeepStack at ViT layers 0 and 3 of 4 feeding
LLM layers 0 and 1 of 3, a 3 x 3 position table) fine-tuned from --hf-checkpoint on ``messages`` JSONL with small
colour photos. Three iterations give the serial run's losses and gradient norms within 1e-5 at

* interleaved V = 2 ``Iv|v*3PE|t|t*2L``: both features cross chunks (0 -> 2 and 1 -> 3, over both ranks);
* CP2 x PP2 ``Iv*4PE|t*3L``: both features cross into an LLM stage with this CP rank's images' rows.

TP2 + SP, CP2, PP2 with feature 0 crossing from a ViT stage into a ViT stage (``Iv*2|v*2PEt*3L``) and --freeze-vit
there (the ViT unchanged, the projector and both DeepStack mergers trained) are the family conformance suite's
(tests/test_conformance.py, the Qwen3-VL kit), on the structured-content form of the data.

Four micro-batches per iteration (megatron-core's interleaved schedule with as many as pipeline ranks does not
finish on gloo: issue 25's item 7)."""
from __future__ import annotations

import pytest

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_tiny_qwen3_vl  # noqa: E402

pytestmark = pytest.mark.slow

TOL = 1e-5  # relative, on each iteration's loss and gradient norm


@pytest.fixture(scope="module")
def flags(tmp_path_factory, data_cache):
    """The serial run's flags (no ISF: the micro-batches are the same at every parallel size)."""
    folder = tmp_path_factory.mktemp("qwen3_vl_training")
    hf_tiny_qwen3_vl.make_tiny_with_tokenizer(folder / "hf", seed=3)
    return ["--hf-checkpoint", str(folder / "hf"), "--data-path", hf_tiny_qwen3_vl.write_messages_data(folder),
            "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
            "--lr-warmup-iters", "0", "--eval-interval", "0", "--seq-length", "256", "--data-cache-dir",
            str(data_cache), "--seed", "5"]


def assert_equal_runs(got, want):
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        for key in ("lm loss", "grad norm"):
            assert abs(g[key] - w[key]) <= TOL * abs(w[key]), (key, g, w)


PP2 = ["--pipeline-model-parallel-size", "2"]
CASES = {
    "interleaved_crossing": (2, PP2 + ["--pipeline-layout", "Iv|v*3PE|t|t*2L"]),
    "cp2_pp2_crossing": (4, PP2 + ["--context-parallel-size", "2", "--pipeline-layout", "Iv*4PE|t*3L"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_training_equals_serial(flags, serial_run, tmp_path, case):
    serial = serial_run(flags)
    nproc, parallel = CASES[case]
    got, out = run_training(nproc, flags + parallel, tmp_path, "parallel")
    assert "loaded weights from --hf-checkpoint" in out
    assert_equal_runs(got, serial)
