"""ISF in the trainer: group the training set so that each micro-batch is one balanced pack."""
from __future__ import annotations

import math

import numpy as np
import torch.distributed as dist

from omnibal_ext.data.assign import assemble_steps
from omnibal_ext.data.isf import ISFParams, check_partition, isf_group
from omnibal_ext.data.search import SearchConfig, plan_isf

from .arguments import ArgumentError
from .run_plan import RunPlan


def isf_params_from_args(args) -> ISFParams | None:
    """Fixed thresholds from --omnibal-isf-qv/-qt[-min] (lower bounds default to 90% of the caps), or None."""
    qv, qt = args.omnibal_isf_qv, args.omnibal_isf_qt
    if qv is None and qt is None:
        return None
    if qv is None or qt is None:
        raise ArgumentError("--omnibal-isf-qv and --omnibal-isf-qt go together (or give neither to search them)")
    qv_min = int(0.9 * qv) if args.omnibal_isf_qv_min is None else args.omnibal_isf_qv_min
    qt_min = int(0.9 * qt) if args.omnibal_isf_qt_min is None else args.omnibal_isf_qt_min
    try:
        return ISFParams(qv=qv, qt=qt, qv_min=qv_min, qt_min=qt_min)
    except ValueError as e:
        raise ArgumentError(f"--omnibal-isf-*: {e}") from None


def search_config(args, plan: RunPlan) -> SearchConfig:
    """The ISF search's settings of this run (tokens counted to ``plan.isf_token_multiple``)."""
    return SearchConfig(dp_size=plan.data_parallel_size, samples_per_group=args.micro_batch_size,
                        seed=args.seed, time_budget_s=math.inf, token_multiple=plan.isf_token_multiple)


def check_samples_fit_caps(args, plan: RunPlan, dataset) -> None:
    """Refuse fixed ISF caps below a single sample, naming the sample's ``file:line``, its size and the flag
    to raise (ISF itself would stop with sample indices only, on rank 0 alone).  Runs on every rank."""
    qv, qt = args.omnibal_isf_qv, args.omnibal_isf_qt
    if qv is None and qt is None:
        return  # searched caps hold the largest sample
    tokens, tiles = dataset.sample_lengths()
    m = plan.isf_token_multiple
    counted, token_unit = search_config(args, plan).counted_tokens(tokens), \
        "tokens" if m == 1 else f"tokens padded to a multiple of {m}"
    for flag, cap, sizes, unit in (("--omnibal-isf-qt", qt, counted, token_unit),
                                   ("--omnibal-isf-qv", qv, tiles, "tiles")):
        over = np.flatnonzero(sizes > cap)
        if len(over):
            i = int(over[np.argmax(sizes[over])])
            raise ArgumentError(
                f"{flag} {cap} is below a single sample: {dataset.where(i)} has {int(sizes[i])} {unit} "
                f"({len(over)} sample(s) over the cap, largest {int(sizes[i])}); raise {flag} to at least "
                f"{int(sizes[i])}")


def isf_groups(args, plan: RunPlan, dataset) -> tuple[list[np.ndarray], np.ndarray, dict, dict]:
    """(groups of sample indices, balanced step order, caps, mean group) for the training set.

    Rank 0 plans (threshold search, grouping, step assembly) and broadcasts the result, so every
    rank trains the same groups whatever its speed (the search is bounded by a candidate count,
    not by time, and is deterministic for a seed anyway).  Nothing is dropped or duplicated
    (checked).  The caps {"qv", "qt", "qv_min", "qt_min"} (memory is planned for them) and the mean group
    {"tiles", "tokens", "attn_tokens_sq"} (sum of squared sample lengths per group: what a micro-batch costs on
    average) are RunPlan's ``isf_params`` and ``isf_mean_group``.
    """
    check_samples_fit_caps(args, plan, dataset)
    box = [None]
    if dist.get_rank() == 0:
        tokens, tiles = dataset.sample_lengths()
        cfg = search_config(args, plan)
        tokens = cfg.counted_tokens(tokens)
        data_plan = plan_isf(tiles, tokens, cfg, isf_params_from_args(args))
        check_partition(data_plan.grouping, len(dataset))
        g = data_plan.grouping
        box = [{"groups": g.groups(), "order": data_plan.assembly.order, "params": data_plan.params.to_dict(),
                "mean_group": {"tiles": float(g.tiles.mean()), "tokens": float(g.tokens.mean()),
                               "attn_tokens_sq": float((tokens.astype(float) ** 2).sum() / len(g))},
                "metrics": data_plan.metrics}]
    dist.broadcast_object_list(box, src=0)
    result = box[0]
    if dist.get_rank() == 0:
        m = result["metrics"]
        print(f"> ISF: {len(dataset)} samples -> {len(result['groups'])} groups, params {result['params']}; "
              f"planned dist ratio llm {m['dist_ratio_llm']:.4f} vit {m['dist_ratio_vit']:.4f}, "
              f"fill llm {m['fill_llm']:.3f} vit {m['fill_vit']:.3f}, "
              f"{m['samples_per_group']:.2f} samples/group", flush=True)
    return result["groups"], result["order"], result["params"], result["mean_group"]


def isf_subset_groups(tokens: np.ndarray, tiles: np.ndarray, sample_ids: np.ndarray, params: ISFParams,
                      dp_size: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """(groups, balanced step order) of the samples ``sample_ids`` only, by ISF with ``params``.

    tokens, tiles: int64 [N] per sample of the whole training set (tokens as ISF counts them:
    ``SearchConfig.counted_tokens``); groups hold global sample ids.
    The same method as the run's plan (its caps, step assembly for ``dp_size`` ranks), on a subset.
    """
    ids = np.asarray(sample_ids, dtype=np.int64)
    grouping = isf_group(np.asarray(tiles)[ids], np.asarray(tokens)[ids], params, seed=seed, sample_ids=ids)
    assembly = assemble_steps(grouping.tokens, grouping.tiles, dp_size)
    return grouping.groups(), assembly.order


def isf_regroup(args, plan: RunPlan, dataset):
    """``regroup(sample_ids) -> (groups, order)`` for the sampler: ISF on a subset with this run's caps.

    Used when a checkpoint's epoch is continued under another data-parallel size: its unserved
    samples are grouped for this run.  Collective: rank 0 groups and broadcasts, every rank must call
    it (``load_state_dict`` runs on every rank).  ``plan.isf_params``: the caps ``isf_groups`` found.
    """
    def regroup(sample_ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        box = [None]
        if dist.get_rank() == 0:
            tokens, tiles = dataset.sample_lengths()
            tokens = search_config(args, plan).counted_tokens(tokens)
            box = [isf_subset_groups(tokens, tiles, sample_ids, ISFParams(**plan.isf_params),
                                     plan.data_parallel_size, args.seed)]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return regroup
