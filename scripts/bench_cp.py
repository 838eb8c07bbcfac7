"""Context-parallel balance of the published OmniBal stats packed by ISF (DP 8, about 4 samples per group): per
micro-batch, the busiest CP rank's attended pairs of real tokens over the mean, and its ViT tiles against
ceil(tiles / CP), with the runtime's own split (megatron/vlm/parallel/context_parallel.py: rank_work).

    python scripts/bench_cp.py
"""
from __future__ import annotations

import glob
import math
import os

import numpy as np

from megatron.vlm.parallel.context_parallel import rank_work
from omnibal_ext.data.search import SearchConfig, run_isf
from omnibal_ext.data.stats import load_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    stats = load_stats(sorted(glob.glob(os.path.join(ROOT, "data", "omnibal_stats", "*.json.gz"))))
    plan = run_isf(stats.vit, stats.tokens, SearchConfig(dp_size=8, samples_per_group=4, seed=0))
    groups = [(stats.tokens[g], int(stats.vit[g].sum())) for g in plan.grouping.groups()]
    print(f"{len(stats.vit)} samples, {len(groups)} ISF groups")
    print("| CP | busiest/mean attended pairs, mean over groups | worst group | busiest rank's tiles <= ceil(tiles/CP) | pad tokens |")
    print("|---|---|---|---|---|")
    for cp in (2, 4, 8):
        ratios, tiles_ok, pads, total = [], True, 0, 0
        for lengths, tiles in groups:
            pairs, rank_tiles = rank_work(lengths, tiles, cp)
            ratios.append(max(pairs) / (sum(pairs) / cp))
            tiles_ok &= max(rank_tiles) <= math.ceil(tiles / cp)
            pads += sum(-(-int(n) // (2 * cp)) * 2 * cp - int(n) for n in lengths)
            total += int(sum(lengths))
        print(f"| {cp} | {np.mean(ratios):.4f} | {max(ratios):.4f} | {'yes' if tiles_ok else 'NO'} | {pads / total:.2%} |")


if __name__ == "__main__":
    main()
