"""What the trainer is told: the plan's flag dict, its argv and shell text, and the trainer's TP rule."""
from __future__ import annotations

import shlex

from ..model.moe import ExpertGrid, MoESpec
from ..model.units import ModelSpec


def tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot split this model's attention (the trainer's rule), or None.

    The ViT's heads are padded to a multiple of ``tp`` (``VisionSpec.padded_heads``); the LLM's heads
    and key-value groups must divide."""
    heads, groups = spec.language.num_attention_heads, spec.language.kv_groups
    if heads % tp or groups % tp:
        return f"TP {tp} does not divide the LLM's {heads} attention heads / {groups} key-value groups"
    return None


def sequence_parallel(tp: int) -> bool:
    """Whether a plan at ``tp`` runs sequence parallelism: always with TP > 1 (it only splits what TP leaves
    replicated, so it lowers activation memory at the same TP traffic; ``--sequence-parallel``), context
    parallelism or not."""
    return tp > 1


def sp_tp(tp: int) -> int:
    """The TP size sequence parallelism splits each CP rank's tokens over (``tp`` where the plan runs it, else 1):
    under context parallelism the trainer pads every sample to a multiple of 2 x CP x this
    (``cp_split.padded_lengths``)."""
    return tp if sequence_parallel(tp) else 1


def plan_trainer_flags(model: str, tp: int, pp: int, layout_flag: str, recompute_flag: str, isf_params,
                       samples_per_group: int, global_batch_size: int, bf16: bool,
                       freeze_flags: list[str] = (), cp: int = 1, vpp: int = 1, time_device: str | None = None) -> dict:
    """The flags ``pretrain_vlm.py`` runs the plan with (``--omnibal-plan`` applies them).

    isf_params: the ISF thresholds (qv, qt, qv_min, qt_min: tiles and tokens per group; the pass count T; in
    predicted time also the time caps and bounds in ns), which the trainer applies as given (its times from the
    cost model of ``time_device``, the plan's);
    samples_per_group: K, the micro-batch size; global_batch_size: samples per iteration; freeze_flags: the
    freeze and LoRA flags the plan was made with (``Freeze.flags()``), which the trainer must train with; cp: the
    context-parallel size (``--context-parallel-size``, written when > 1); vpp: model
    chunks per pipeline rank (> 1: ``--virtual-pipeline-model-parallel-size``, the layout has ``vpp x pp`` stages).
    """
    freeze = {}
    for i, f in enumerate(freeze_flags):
        if f.startswith("--"):
            nxt = freeze_flags[i + 1] if i + 1 < len(freeze_flags) else None
            freeze[f] = _flag_value(nxt) if nxt is not None and not nxt.startswith("--") else True
    return {**freeze,
        "--model": model,
        "--tensor-model-parallel-size": tp,
        "--pipeline-model-parallel-size": pp,
        "--virtual-pipeline-model-parallel-size": vpp if vpp > 1 else None,
        "--sequence-parallel": sequence_parallel(tp),
        **({"--context-parallel-size": cp} if cp > 1 else {}),
        "--pipeline-layout": layout_flag,
        "--recompute-plan": recompute_flag,
        "--omnibal-isf": True,
        "--omnibal-isf-qv": int(isf_params.qv),
        "--omnibal-isf-qt": int(isf_params.qt),
        "--omnibal-isf-qv-min": int(isf_params.qv_min),
        "--omnibal-isf-qt-min": int(isf_params.qt_min),
        "--omnibal-isf-iters": int(isf_params.iters),  # the passes T the plan grouped with (default: 10)
        **(time_flags(isf_params, time_device) if isf_params.timed else {}),
        "--micro-batch-size": samples_per_group,
        "--global-batch-size": global_batch_size,
        # the memory plan assumes both: optimizer state sharded over DP, and bf16 on a GPU
        "--use-distributed-optimizer": True,
        "--bf16": bf16,
    }


def moe_trainer_flags(moe: MoESpec | None, grid: ExpertGrid) -> dict:
    """The trainer flags of an MoE model (Megatron's names; {} for a dense model): the expert-parallel sizes of the
    plan and the model's experts as ``LanguageSpec.moe`` describes them (``--moe-layer-freq`` in its list form;
    ``--moe-router-pre-softmax`` for a softmax router whose top-k probabilities are not renormalised, Qwen3-MoE's
    ``norm_topk_prob`` False)."""
    if moe is None:
        return {}
    return {
        "--expert-model-parallel-size": grid.ep,
        "--expert-tensor-parallel-size": grid.etp,
        "--num-experts": moe.num_experts,
        "--moe-router-topk": moe.topk,
        "--moe-ffn-hidden-size": moe.ffn_hidden_size,
        "--moe-layer-freq": "[" + ",".join(str(x) for x in moe.layer_freq) + "]",
        "--moe-router-score-function": moe.score_function,
        "--moe-router-pre-softmax": moe.score_function == "softmax" and not moe.norm_topk_prob,
        "--moe-router-load-balancing-type": moe.load_balancing_type,
        "--moe-shared-expert-intermediate-size": moe.shared_expert_ffn_hidden_size or None,
        "--moe-shared-expert-gate": moe.shared_expert_gate,
        "--moe-expert-capacity-factor": moe.capacity_factor,
        "--moe-token-dispatcher-type": "alltoall",
    }


def time_flags(isf_params, time_device: str | None) -> dict:
    """The trainer flags of ISF thresholds in predicted time: the time caps and bounds (ns) and the
    cost model's device of the times (so that the trainer groups exactly as the plan did)."""
    if time_device is None:
        raise ValueError("plan_trainer_flags: ISF thresholds in time need the device of their times")
    return {"--omnibal-isf-vit-time": int(isf_params.vit_time),
            "--omnibal-isf-llm-time": int(isf_params.llm_time),
            "--omnibal-isf-vit-time-min": int(isf_params.vit_time_min),
            "--omnibal-isf-llm-time-min": int(isf_params.llm_time_min),
            "--omnibal-isf-time-device": time_device}


def _flag_value(text: str):
    """A freeze/LoRA flag's value as given: an int where it is one (--unfreeze-vit-layers, --lora-rank), else the
    text (--lora-dropout 0.1, --lora-targets llm.qkv)."""
    try:
        return int(text)
    except ValueError:
        return text


def trainer_argv(flags: dict) -> list[str]:
    """Trainer arguments of a flag dict: True is a bare switch, False/None are left out, any other
    value is joined as ``--flag=value`` (so that a value starting with "-", such as the recompute
    plan ``-|t2``, is not taken for a flag by argparse)."""
    return [k if v is True else f"{k}={v}" for k, v in flags.items() if v is not None and v is not False]


def trainer_command(flags: dict) -> str:
    """Shell text of :func:`trainer_argv`, quoted for pasting."""
    return shlex.join(trainer_argv(flags))
