"""Flag parsing: plan application and validation (no processes started)."""
import json
import re

import pytest

import torch

from megatron.training.arguments import parse_flags
from megatron.training.flags import ArgumentError
from megatron.training.specs import run_config


def test_plan_flags_are_applied_and_command_line_overrides(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "tiny", "trainer_flags": {
        "--model": "tiny", "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 2,
        "--pipeline-layout": "Iv*3|vPEt*4L", "--recompute-plan": "v1|t2s", "--omnibal-isf": True,
        "--omnibal-isf-qv": 12, "--omnibal-isf-qt": 400, "--omnibal-isf-qv-min": 10, "--omnibal-isf-qt-min": 380,
        "--micro-batch-size": 4, "--global-batch-size": 16}}))
    args = parse_flags(["--omnibal-plan", str(plan), "--micro-batch-size", "2"], world_size=4)
    run = run_config(args, 4)
    assert args.pipeline_model_parallel_size == 2 and run.parallel.data_parallel_size == 2
    assert args.pipeline_layout == "Iv*3|vPEt*4L" and args.recompute_plan == "v1|t2s"
    assert args.omnibal_isf and (args.omnibal_isf_qv, args.omnibal_isf_qt) == (12, 400)
    assert (args.omnibal_isf_qv_min, args.omnibal_isf_qt_min) == (10, 380)
    assert args.micro_batch_size == 2  # the command line wins
    assert run.optim.num_microbatches == 16 // (2 * 2)


def test_printed_plan_command_parses_back_when_a_value_starts_with_a_dash():
    """`omnibal plan` prints the trainer flags to paste; a recompute plan like "-|t2s" (no recompute on
    stage 0) must reach the parser as a value, not as an unknown flag."""
    import shlex

    from omnibal_ext.plan import trainer_command

    flags = {"--model": "tiny", "--pipeline-model-parallel-size": 2, "--pipeline-layout": "Iv*3|vPEt*4L",
             "--recompute-plan": "-|t2s", "--omnibal-isf": True, "--use-distributed-optimizer": False}
    args = parse_flags(shlex.split(trainer_command(flags)), world_size=2)
    assert args.recompute_plan == "-|t2s" and args.pipeline_layout == "Iv*3|vPEt*4L"
    assert args.omnibal_isf and not args.use_distributed_optimizer


def test_plan_file_errors_name_the_flag(tmp_path):
    with pytest.raises(ArgumentError, match="--omnibal-plan .*no such file"):
        parse_flags(["--omnibal-plan", str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ArgumentError, match="--omnibal-plan .*not a plan"):
        parse_flags(["--omnibal-plan", str(bad)])


@pytest.mark.parametrize("argv,world,match", [
    (["--global-batch-size", "10", "--micro-batch-size", "4"], 1, "--global-batch-size 10"),
    (["--pipeline-model-parallel-size", "2"], 3, "world size 3"),
    (["--pipeline-model-parallel-size", "2", "--omnibal-partition", "auto", "--pipeline-layout", "5,7"], 2,
     "--omnibal-partition auto"),
    (["--recompute-granularity", "full", "--recompute-plan", "v1"], 1, "--recompute-plan"),
    (["--patch-size", "5"], 1, "--patch-size 5"),
])
def test_inconsistent_flags_are_refused(argv, world, match):
    with pytest.raises(ArgumentError, match=match):
        parse_flags(argv, world_size=world)


def test_global_batch_default_is_four_micro_batches_per_rank():
    args = parse_flags(["--micro-batch-size", "3"], world_size=2)
    run = run_config(args, 2)
    assert run.optim.global_batch_size == 24 and run.optim.num_microbatches == 4


@pytest.mark.parametrize("argv,match", [
    (["--micro-batch-size", "0"], "--micro-batch-size 0"),
    (["--global-batch-size", "0"], "--global-batch-size 0"),
    (["--global-batch-size", "-4"], "--global-batch-size -4"),
    (["--train-iters", "-1"], "--train-iters -1"),
    (["--log-interval", "0"], "--log-interval 0"),
    (["--save", "ckpt", "--save-interval", "-5"], "--save-interval -5"),
    (["--eval-interval", "-1"], "--eval-interval -1"),
    (["--exit-interval", "-2"], "--exit-interval -2"),
    (["--eval-iters", "0"], "--eval-iters 0"),
    (["--seq-length", "0"], "--seq-length 0"),
    (["--max-num-tiles", "0"], "--max-num-tiles 0"),
    (["--min-num-tiles", "0"], "--min-num-tiles 0"),
    (["--min-num-tiles", "7", "--max-num-tiles", "6"], "--min-num-tiles 7 > --max-num-tiles 6"),
    (["--lr", "-0.1"], "--lr -0.1"),
    (["--num-workers", "-1"], "--num-workers -1: must be >= 0"),
    (["--prefetch-factor", "0"], "--prefetch-factor 0: must be >= 1"),
    (["--omnibal-isf", "--omnibal-isf-qv", "0", "--omnibal-isf-qt", "100"], "--omnibal-isf-qv 0"),
    (["--omnibal-isf", "--omnibal-isf-qv", "4", "--omnibal-isf-qt", "-1"], "--omnibal-isf-qt -1"),
    (["--omnibal-isf", "--omnibal-isf-qt", "100"], "--omnibal-isf-qv and --omnibal-isf-qt go together"),
    (["--omnibal-isf", "--omnibal-isf-qv", "4", "--omnibal-isf-qt", "100", "--omnibal-isf-qt-min", "200"],
     "--omnibal-isf-qt-min 200 is above --omnibal-isf-qt 100"),
    (["--omnibal-isf", "--omnibal-isf-qv-min", "3"], "--omnibal-isf-qv-min 3 needs --omnibal-isf-qv"),
    (["--omnibal-isf-qv", "4", "--omnibal-isf-qt", "100"], "--omnibal-isf-qv --omnibal-isf-qt given without --omnibal-isf"),
    (["--omnibal-isf", "--omnibal-isf-qv", "4", "--omnibal-isf-qt", "100", "--omnibal-isf-vit-time", "9"],
     "--omnibal-isf-vit-time and --omnibal-isf-llm-time go together"),
    (["--omnibal-isf", "--omnibal-isf-vit-time", "9", "--omnibal-isf-llm-time", "9"],
     "--omnibal-isf-vit-time/--omnibal-isf-llm-time need --omnibal-isf-qv/-qt"),
    (["--omnibal-isf", "--omnibal-isf-qv", "4", "--omnibal-isf-qt", "100", "--omnibal-isf-vit-time", "9",
      "--omnibal-isf-llm-time", "9", "--omnibal-isf-llm-time-min", "10"],
     "--omnibal-isf-llm-time-min 10 is above --omnibal-isf-llm-time 9"),
    (["--omnibal-isf", "--omnibal-isf-iters", "3"], "--omnibal-isf-iters needs fixed thresholds"),
    (["--omnibal-isf", "--omnibal-isf-qv", "4", "--omnibal-isf-qt", "100", "--omnibal-isf-iters", "0"],
     "--omnibal-isf-iters 0: must be >= 1"),
])
def test_bad_values_are_refused_before_any_process_group(argv, match):
    """validate_flags (run before initialize_distributed) names the flag and its value."""
    with pytest.raises(ArgumentError, match=re.escape(match)):
        parse_flags(argv)


@pytest.mark.parametrize("argv,world,message", [
    (["--lr", "0"], 1, "--lr 0.0 is below --min-lr 1e-05: the schedule decays from --lr to --min-lr"),
    (["--lr", "1e-6"], 1, "--lr 1e-06 is below --min-lr 1e-05"),
    (["--lr", "nan"], 1, "--lr nan: must be a finite number"),
    (["--clip-grad", "inf"], 1, "--clip-grad inf: must be a finite number"),
    (["--weight-decay", "-5"], 1, "--weight-decay -5.0: must be >= 0"),
    (["--adam-beta2", "1.5"], 1, "--adam-beta2 1.5: must be < 1"),
    (["--adam-beta1", "-0.1"], 1, "--adam-beta1 -0.1: must be >= 0"),
    (["--lr-decay-iters", "0"], 1, "--lr-decay-iters 0: must be >= 1"),
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "1"], 2,
     "--num-query-groups 1 (LLM key/value groups) is not divisible by --tensor-model-parallel-size 2"),
    (["--load", "x", "--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"], 1,
     "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other"),
    (["--override-opt-param-scheduler"], 1, "--override-opt_param-scheduler needs --load"),
    (["--use-checkpoint-opt_param-scheduler"], 1, "--use-checkpoint-opt_param-scheduler needs --load"),
    (["--force-save-lock"], 1, "--force-save-lock needs --save"),
    (["--max-skipped-fraction", "0.5"], 1, "--max-skipped-fraction needs --skip-bad-samples"),
    (["--skip-bad-samples", "--max-skipped-fraction", "1.5"], 1, "--max-skipped-fraction 1.5: must be <= 1"),
], ids=["lr-0", "lr-below-min", "lr-nan", "clip-inf", "wd", "beta2", "beta1", "decay-iters", "query-groups",
        "both-scheduler-flags", "override-alone", "checkpoint-alone", "force-lock-alone", "fraction-alone",
        "fraction-above-1"])
def test_optimizer_and_run_safety_values_are_refused_naming_the_flag(argv, world, message):
    """What megatron-core's scheduler, torch's Adam or a later stage of the run would reject with a traceback
    (after the data scan and the model build) is refused by the flag checks, naming the flag."""
    with pytest.raises(ArgumentError) as e:
        parse_flags(argv, world)
    assert str(e.value).startswith(message), str(e.value)


def test_tensorboard_dir_needs_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ArgumentError, match="--tensorboard-dir tb: the tensorboard package is not installed"):
        parse_flags(["--tensorboard-dir", "tb"])


def test_values_that_work_are_accepted():
    args = parse_flags(["--num-workers", "2", "--train-iters", "0", "--eval-interval", "0", "--lr", "0", "--min-lr", "0",
                       "--omnibal-isf", "--omnibal-isf-qv", "8", "--omnibal-isf-qt", "300",
                       "--omnibal-isf-qv-min", "8", "--omnibal-isf-qt-min", "0"])
    assert args.omnibal_isf_qv_min == 8 and args.train_iters == 0


def test_isf_token_multiple_is_what_context_parallelism_pads_to():
    """ISF counts each sample's tokens to the multiple CP pads it to: 2 x CP, x TP with --sequence-parallel (the
    trainer's split pads the same, megatron/vlm/parallel/context_parallel.py), 1 without CP; the flag overrides it."""
    cpu = torch.device("cpu")
    for argv, world, want in ([[], 1, 1], [["--context-parallel-size", "2"], 2, 4],
                              [["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"], 4, 8],
                              [["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1],
                              [["--omnibal-isf", "--omnibal-isf-token-multiple", "4"], 1, 4]):
        assert run_config(parse_flags(argv, world), world).balance.isf_token_multiple == want, argv
    with pytest.raises(ArgumentError, match="--omnibal-isf-token-multiple given without --omnibal-isf"):
        parse_flags(["--omnibal-isf-token-multiple", "4"], 1)


# The typed configuration (megatron/training/config.py): every flag lands in it, typed, and nothing below the
# entry point reads the parsed flags.
# flags that become one typed value (a config field of another name) rather than a field of their own
CONSUMED = {
    "model.spec": {"model", "vision_num_layers", "vision_hidden_size", "vision_num_attention_heads",
                   "vision_ffn_hidden_size", "image_size", "patch_size", "num_layers", "hidden_size",
                   "num_attention_heads", "num_query_groups", "ffn_hidden_size", "init_method_std",
                   "vision_normalization", "vision_norm_eps", "vision_qkv_bias", "vision_qk_norm",
                   "vision_layer_scale_init", "vision_feature_layer", "qkv_bias", "head_dim", "norm_epsilon",
                   "rotary_base", "tie_word_embeddings", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                   "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                   "moe_router_score_function", "moe_router_pre_softmax", "moe_router_load_balancing_type",
                   "moe_expert_capacity_factor"},
    "model.moe_run": {"moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_enable_expert_bias",
                      "moe_router_bias_update_rate", "moe_token_drop_policy", "moe_token_dispatcher_type"},
    "model.trainable": {"freeze_vit", "freeze_projector", "freeze_llm", "unfreeze_vit_layers", "unfreeze_lm_head"},
    "model.lora": {"lora_rank", "lora_alpha", "lora_dropout", "lora_targets"},
    "parallel.virtual_pipeline_size": {"virtual_pipeline_model_parallel_size"},
    "data.media": {"max_num_tiles", "min_num_tiles", "min_pixels", "max_pixels", "video_fps", "video_min_frames",
                   "video_max_frames", "video_max_pixels", "video_total_pixels", "video_folder_fps"},
    "balance.isf_fixed_params": {"omnibal_isf_qv", "omnibal_isf_qt", "omnibal_isf_qv_min", "omnibal_isf_qt_min",
                                 "omnibal_isf_iters", "omnibal_isf_vit_time", "omnibal_isf_llm_time",
                                 "omnibal_isf_vit_time_min", "omnibal_isf_llm_time_min"},
    "balance.memory_budget_gib": {"omnibal_memory_budget"},
    "the parse itself": {"family_module", "omnibal_plan"},  # modules imported, a plan's flags read first
}


def test_every_flag_lands_in_the_typed_config():
    """Each flag is a field of one RunConfig section of its own name (``--omnibal-X``: ``balance.X``) or one of the
    typed values listed in CONSUMED: a new flag must be given its place."""
    import dataclasses

    from megatron.training import config as c
    from megatron.training.flags import build_parser

    sections = {"model": c.ModelConfig, "parallel": c.ParallelConfig, "data": c.DataConfig,
                "balance": c.BalanceConfig, "optim": c.OptimConfig, "log": c.LogConfig,
                "checkpoint": c.CheckpointConfig}
    assert [f.name for f in dataclasses.fields(c.RunConfig)] == list(sections)
    fields = {f.name for section in sections.values() for f in dataclasses.fields(section)}
    consumed = set().union(*CONSUMED.values())
    for holder in CONSUMED:
        if "." in holder:
            section, name = holder.split(".")
            assert name in {f.name for f in dataclasses.fields(sections[section])}, holder
    placeless = []
    for action in build_parser()._actions:
        dest = action.dest
        own = dest[len("omnibal_"):] if dest.startswith("omnibal_") else dest
        if dest != "help" and own not in fields and dest not in consumed:
            placeless.append(dest)
    assert placeless == []


def test_the_typed_config_holds_the_flags_and_what_follows_from_them():
    """Given and derived values, recounted by hand: 8 processes at TP 2 are DP 4; 3 samples per micro-batch make a
    global batch of 4 x 3 x 4 = 48 (4 micro-batches per rank); --omnibal-recompute auto measures activations; CP 2
    under sequence parallelism at TP 2 counts ISF tokens to 2 x 2 x 2 = 8; ETP defaults to TP."""
    from megatron.training.arguments import parse_config

    config = parse_config(["--tensor-model-parallel-size", "2", "--micro-batch-size", "3", "--omnibal-recompute",
                           "auto", "--lr", "2e-3", "--max-num-tiles", "4", "--omnibal-isf", "--omnibal-isf-qv", "40",
                           "--omnibal-isf-qt", "900", "--save", "ck", "--json-log", "log.jsonl"], world_size=8)
    assert (config.parallel.data_parallel_size, config.optim.global_batch_size, config.optim.num_microbatches) == \
        (4, 48, 4)
    assert config.log.log_activation_memory and config.balance.recompute == "auto"
    assert config.optim.lr == 2e-3 and config.data.media.max_num_tiles == 4 and config.checkpoint.save == "ck"
    assert (config.balance.isf_fixed_params.qv, config.balance.isf_fixed_params.qt) == (40, 900)
    assert (config.balance.isf_fixed_params.qv_min, config.balance.isf_fixed_params.qt_min) == (36, 810)  # 90%
    assert config.parallel.expert_tensor_parallel_size == 2 and config.log.json_log == "log.jsonl"
    cp = parse_config(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                      world_size=4)
    assert cp.balance.isf_token_multiple == 8 and cp.parallel.data_parallel_size == 1
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):  # what follows from the flags is the RunPlan, not an edit
        config.optim.lr = 1.0


def test_nothing_below_the_entry_point_reads_parsed_flags():
    """No module under megatron/ names a parsed ``args`` namespace: the flags are read as ``flags`` by the parse
    (flags.py, validation.py, specs.py) and everything else takes the typed configuration."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "megatron"
    readers = [f"{path.relative_to(root.parent)}:{i}" for path in sorted(root.rglob("*.py"))
               for i, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\bargs\.", line)]
    assert readers == []
