"""ISF in the trainer: group the training set so that each micro-batch is one balanced pack."""
from __future__ import annotations

import numpy as np
import torch.distributed as dist

from omnibal_ext.data.isf import ISFParams, check_partition
from omnibal_ext.data.search import SearchConfig, plan_isf

from .arguments import ArgumentError


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


def isf_groups(args, dataset) -> tuple[list[np.ndarray], np.ndarray]:
    """(groups of sample indices, balanced step order) for the training set.

    Every rank computes the same plan from the same statistics and seed; nothing is dropped or
    duplicated (checked).  The thresholds and the metrics are printed once.
    """
    tokens, tiles = dataset.sample_lengths()
    cfg = SearchConfig(dp_size=args.data_parallel_size, samples_per_group=args.micro_batch_size, seed=args.seed)
    plan = plan_isf(tiles, tokens, cfg, isf_params_from_args(args))
    check_partition(plan.grouping, len(dataset))
    args.isf_params = plan.params.to_dict()
    if dist.get_rank() == 0:
        m = plan.metrics
        print(f"> ISF: {len(dataset)} samples -> {len(plan.grouping)} groups, params {args.isf_params}; "
              f"planned dist ratio llm {m['dist_ratio_llm']:.4f} vit {m['dist_ratio_vit']:.4f}, "
              f"fill llm {m['fill_llm']:.3f} vit {m['fill_vit']:.3f}, "
              f"{m['samples_per_group']:.2f} samples/group", flush=True)
    return plan.grouping.groups(), plan.assembly.order
