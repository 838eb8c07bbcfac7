"""``--eval-generate`` on the default run (the built-in digits data, ``tiny`` at PP 2), shortened to 200 iterations:
the accuracy by generation over every validation answer equals the teacher-forced answer accuracy the trainer logs
beside it (592 answers; about 8% right at this point, so both are counts of real hits), with no difference left
unexplained; and the flags it cannot run with are refused naming them."""
import json

import pytest

from launch import run_trainer
from megatron.training.arguments import parse_flags
from megatron.training.flags import ArgumentError


@pytest.mark.slow
def test_generation_accuracy_equals_teacher_forced_on_the_default_run(tmp_path, data_cache):
    flags = ["--pipeline-model-parallel-size", "2", "--train-iters", "200", "--eval-interval", "200",
             "--eval-generate", "--log-interval", "100", "--data-cache-dir", str(data_cache)]
    run_trainer(flags, tmp_path, "evalgen", nproc=2, timeout=1800)
    lines = [json.loads(x) for x in (tmp_path / "evalgen.jsonl").read_text().splitlines()]
    val = [r for r in lines if r.get("prefix") == "validation "][-1]
    print({k: v for k, v in val.items() if "acc" in k or "generation" in k or k == "answers"})
    assert val["generation answers"] == val["answers"] == 592
    assert val["answer acc"] > 0.05
    causes = {c: val[f"generation differs {c}"] for c in ("near-tie", "stop token", "other")}
    assert causes["other"] == 0
    # samples differing (the logged accuracies are fp32 sums: the counts to a hundredth)
    assert abs(val["generation acc"] - val["answer acc"]) * val["answers"] <= sum(causes.values()) + 0.01
    assert val["generation tf acc"] == pytest.approx(val["answer acc"], abs=1.5 / val["answers"])


@pytest.mark.parametrize("extra,match", [(["--eval-interval", "0"], "--eval-interval"),
                                         (["--transformer-impl", "transformer_engine"], "transformer_engine"),
                                         (["--attention-backend", "unfused"], "unfused"),
                                         (["--eval-generate-samples", "0"], "--eval-generate-samples")])
def test_flags_it_cannot_run_with_are_refused(extra, match):
    with pytest.raises(ArgumentError, match=match):
        parse_flags(["--eval-generate", *extra])
