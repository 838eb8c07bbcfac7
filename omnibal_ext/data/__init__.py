"""Data-level balancing: ISF (Iterative Sampling and Filtering) and balanced step assembly.

numpy only (no torch, no megatron).  Modules:

* ``stats``   load/validate per-sample stats (ViT tiles, LLM tokens, optional per-image sizes), resample;
* ``native``  native-resolution image arithmetic: smart_resize patches, patch grids, sizes drawn to fit tiles;
* ``isf``     ISF grouping (single and multi-group), oversize policies, ISF in predicted time;
* ``online_isf`` ISF online over a look-ahead buffer per DP rank, ranks matched through one small all-gather per
  step; ``online_sim`` runs all its ranks in one process (benchmark, tests);
* ``assign``  balanced step assembly across DP ranks (tokens AND tiles), pack files;
* ``search``  automatic threshold search and the whole plan; ``search_time`` the same in predicted time;
* ``metrics`` PadRatio, DistRatio, fill, ``step_balance`` for one training step;
* ``sampler`` ``GroupBatchSampler`` and ``random_groups``;
* ``cli``     ``omnibal isf stats|search|pack``.
"""
from .assign import PackPlan, StepAssembly, assemble_steps, load_pack, save_pack, sp_runs
from .isf import Grouping, ISFParams, OversizeError, check_partition, isf_group, isf_multi
from .online_isf import BufferCosts, OnlineISF, OnlineISFConfig, OnlineOversizeError, SampleCost
from .metrics import dist_ratio_matrix, dist_ratio_one, fill, pad_ratio, step_balance
from .sampler import GroupBatchSampler, random_groups
from .search import IsfResult, SearchConfig, SearchResult, run_isf, run_isf_by_source, random_baseline, search_params
from .stats import SampleStats, StatsError, from_arrays, load_stats, resample

__all__ = [
    "PackPlan", "StepAssembly", "assemble_steps", "load_pack", "save_pack", "sp_runs",
    "Grouping", "ISFParams", "OversizeError", "check_partition", "isf_group", "isf_multi",
    "BufferCosts", "OnlineISF", "OnlineISFConfig", "OnlineOversizeError", "SampleCost",
    "dist_ratio_matrix", "dist_ratio_one", "fill", "pad_ratio", "step_balance",
    "GroupBatchSampler", "random_groups",
    "IsfResult", "SearchConfig", "SearchResult", "run_isf", "run_isf_by_source", "random_baseline", "search_params",
    "SampleStats", "StatsError", "from_arrays", "load_stats", "resample",
]
