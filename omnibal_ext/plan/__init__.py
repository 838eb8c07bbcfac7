"""One plan from all three levels: data (ISF), model (pipeline layout), memory (recompute).

:func:`make_plan` takes per-sample statistics and a :class:`PlanConfig` (a model, a GPU count, the
memory per GPU, ...) and returns a :class:`Plan`: the ISF thresholds, the parallel sizes, the pipeline layout and the
per-stage recompute plan the trainer runs (``trainer_flags``), plus predictions of four settings
side by side, the paper's ablation:

============  ==================  ============================  ==========================
setting       batching            pipeline layout               recompute
============  ==================  ============================  ==========================
baseline      random, padded      Megatron default              full, every layer
+data         ISF packed groups   Megatron default              full, every layer
+model        ISF packed groups   searched                      full, every layer
+memory       ISF packed groups   searched with the recompute   adaptive per stage
============  ==================  ============================  ==========================

How a prediction is made (tensor-free; every number comes from the existing planners)
--------------------------------------------------------------------------------------
*Costs per micro-batch are linear in its shape.*  The analytic cost model gives every unit's time
as a linear function of (ViT tiles, LLM tokens, sum of squared sample lengths): ViT, projector,
embedding and head are linear in tiles or tokens, a causal LLM layer adds attention FLOPs
proportional to ``sum(len_i^2)``.  So the per-stage forward, backward (with the recompute extra)
and send times of a layout are evaluated once for three unit shapes and combined per micro-batch
(:func:`stage_coefficients`); ``tests/test_plan.py`` checks this against the cost model directly.

*Micro-batches.*  Megatron's default: ``K`` random samples per micro-batch padded to the longest
of them: tiles = the K samples' tiles (the ViT runs no padding), LLM tokens = ``K * longest``,
attention ``K * longest^2`` (the padded sequences are computed in full).  ISF: one packed group
per micro-batch: its tiles, its tokens, ``sum(len_i^2)`` of its samples (packed attention stays
within a sample).  ``m = ceil(global batch / (dp * K))`` micro-batches per iteration.  At native resolution
(native resolution) the ISF groups are balanced in predicted time as the trainer balances them (``data_level``), and the
trainer flags carry the time thresholds, which the trainer applies without searching.

*DP straggling (the model we chose).*  Not a scale factor: the iteration is simulated.  The epoch's
micro-batches are laid out as Megatron (random) or the balanced step assembly (ISF) serves them:
step ``s`` gives DP rank ``r`` micro-batch ``(s, r)``, an iteration takes ``m`` consecutive steps.
For ``sim_iterations`` iterations spread evenly over the epoch, every DP rank's own ``m``
micro-batches run through the 1F1B simulator (``simulate.simulate_pipeline``, per-micro-batch
stage times and send times); the iteration lasts as long as its slowest rank, plus the gradient
all-reduce (ring all-reduce of the fp32 gradients of the largest stage, ``2 (dp-1)/dp * 4 bytes *
params / p2p bandwidth``, not overlapped).  So the prediction holds the padding, the DP
imbalance (the slowest of N ranks per step, averaged over the iteration's micro-batches as the
real schedule averages them) and the pipeline stalls that uneven micro-batches cause.
``balanced_iteration_s`` is the same iteration with every micro-batch at the mean shape; the
ratio of the two is the straggling the data level removes.

*Throughput.*  time per sample = sum of the sampled iteration times / samples they hold;
``gpu_days = samples * time per sample * gpus / 86400`` for one epoch of ``samples`` samples;
``tokens_per_s`` counts real (unpadded) LLM tokens of the whole cluster.

*Memory.*  ``memory_model.stage_memory`` (1F1B, distributed optimizer) at a shape every
micro-batch stays under: ISF: the caps, tiles = Qv, tokens = Qt, attention ``min(Qt, longest
sample) * Qt`` (the largest ``sum(len_i^2)`` a group under the caps can reach); random: the
mean padded micro-batch of the epoch (Megatron's micro-batch varies; its largest is in
``shapes["random_worst_padded"]``; the baseline's ``fits_memory`` is judged at the mean).  The
budget is ``gpu_memory * (1 - memory_reserve)`` (the model leaves out the CUDA context,
fragmentation and buffers).  Memory planning uses the ISF caps: the searched layout and the
recompute plan fit any group the trainer can build.

*Choosing the layout and recompute.*  Each balanced setting gathers candidates and keeps the
one with the least simulated time on the same micro-batches: +model: the paper's search (anchor
+ radius, unit times with full recompute, each stage checked to fit under full recompute) and the
default layout; +memory: ``recompute.plan_layout_and_recompute`` (search + adaptive recompute,
one recompute-aware round) and the adaptive plan on the +model and default layouts.  +model and
+memory keep only candidates that fit the budget.  Since the adaptive plan never adds time to a
layout's full recompute (selective recompute costs less than full, per unit and at any shape) and
the simulator is monotone in op times, +memory is never predicted slower than +model, nor +model
than +data when the default layout fits memory (when it does not, +data could not run).

*Parallel sizes.*  When not given: every (tp, pp) with tp in {1, 2, 4, 8} dividing the GPUs and
the attention heads and key/value groups of both ViT and LLM (the trainer's rule), pp dividing
gpus/tp, the default layout possible; each is screened by the least memory any layout needs with
full recompute (an exact min-max over contiguous splits, :func:`memory_need`) and by the
balanced (+memory) iteration at the mean ISF group; the fastest per sample that fits wins.

*The interleaved pipeline.*  For each configuration whose micro-batches per pipeline are at least PP and a
multiple of it, V = 2..``max_vpp`` model chunks per rank are also screened and planned for +memory
(``interleaved``): the partition search over V x PP virtual stages, memory per rank with the interleaved
in-flight replay (``memory_model.stage_memory(virtual_stages=V)``), each chunk's layers recomputed fully or
not at all, simulated with the interleaved 1F1B schedule; V > 1 wins only when predicted faster.  The
baseline, +data and +model rows keep V = 1 (the paper's ablation).  If none
fits, :class:`PlanError` names the least demanding configuration, its stage and its need.
"""
# Modules, one job each:
#   config         PlanConfig (the request), its checks, PlanError, SETTINGS, DEFAULT_GLOBAL_BATCH
#   configs        (tp, pp, dp) candidates, the quick screen of each, the refusal when none fits
#   data_level     ISF thresholds and the micro-batch loads of random and ISF batching
#   linear_costs   per-stage costs linear in the micro-batch shape
#   memory_need    exact least memory need under full recompute; the trainer's precision
#   context        one configuration's costs and memory table; candidates and their simulation
#   model_level    +model: layout search with full recompute, memory-checked
#   memory_level   +memory: layout search with adaptive recompute, adaptive recompute on given layouts
#   interleaved    +memory with V > 1 chunks per rank: allowed V, V x PP layout search, full/none recompute per chunk
#   simulation     sampled iterations through the 1F1B simulator
#   predictions    a setting's prediction row, GPU-days and speed-ups
#   planner        make_plan: all of the above in order
#   results        SettingPrediction and Plan (the JSON)
#   trainer_flags  the trainer's flags, argv and shell text; the trainer's TP rule
#   report         the text report and figures
from .config import DEFAULT_GLOBAL_BATCH, SETTINGS, PlanConfig, PlanError
from .configs import candidate_configs
from .data_level import Loads, random_loads
from .linear_costs import basis_costs, full_modes, stage_coefficients, stage_modes
from .memory_need import memory_need, memory_need_table, training_precision
from .planner import make_plan
from .report import format_plan, plot_plan
from .results import Plan, SettingPrediction
from .simulation import simulate_loads
from .trainer_flags import tp_problem, trainer_argv, trainer_command

__all__ = [
    "DEFAULT_GLOBAL_BATCH", "SETTINGS", "Loads", "Plan", "PlanConfig", "PlanError", "SettingPrediction",
    "basis_costs", "candidate_configs", "format_plan", "full_modes", "make_plan",
    "memory_need", "memory_need_table", "plot_plan", "random_loads", "simulate_loads", "stage_coefficients",
    "stage_modes", "tp_problem", "trainer_argv", "trainer_command", "training_precision",
]
