"""``omnibal_ext.plan``: linear stage costs, memory need, DP simulation, and whole plans."""
from __future__ import annotations

import itertools
import re
import shlex

import numpy as np
import pytest

from omnibal_ext.data.isf import ISFParams
from omnibal_ext.data.stats import from_arrays
from omnibal_ext.memory.memory_model import GIB, stage_memory
from omnibal_ext.memory.recompute import full_recompute_plan, parse_recompute_plan, validate_recompute_plan
from omnibal_ext.model.cost_model import DEVICES, MicroBatchShape, analytic_costs, get_device
from omnibal_ext.model.layout import PipelineLayout, default_layout, parse_layout
from omnibal_ext.model.simulate import layout_stage_costs, simulate_pipeline
from omnibal_ext.model.units import build_units, get_preset
from omnibal_ext.plan import (SETTINGS, Loads, PlanConfig, PlanError, basis_costs, format_plan, make_plan, memory_need,
                              memory_need_table, random_loads, simulate_loads, stage_coefficients)

A100 = DEVICES["a100-80g"]


def synthetic_stats(n: int, seed: int, max_tiles: int = 6, tokens_per_tile: int = 256):
    """InternVL-like samples: 0..max_tiles tiles (some text-only), text 30..900 tokens + image tokens."""
    rng = np.random.default_rng(seed)
    tiles = np.where(rng.random(n) < 0.15, 0, rng.integers(1, max_tiles + 1, n))
    tokens = rng.integers(30, 900, n) + tokens_per_tile * tiles
    return from_arrays(tiles, tokens)


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,pp,tp", [("tiny", 3, 2), ("internvl-6b-20b", 4, 1)])
def test_stage_costs_are_linear_in_the_shape(preset, pp, tp):
    spec = get_preset(preset)
    n = len(build_units(spec))
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, n), pp - 1, replace=False))
    layout = PipelineLayout(tuple(np.diff(np.concatenate([[0], cuts, [n]])).tolist()))
    modes = rng.choice(["none", "selective", "full"], n).tolist()
    modes = [m if u.kind.endswith("layer") else "none" for m, u in zip(modes, build_units(spec))]
    coefs = stage_coefficients(basis_costs(spec, tp, A100), layout, pp, A100.p2p_bytes_per_s, modes)
    for tiles, tokens in ((0, 700), (7, 0), (13, 5000), (3, 1234)):
        sq = float(tokens) ** 2 * rng.random()
        direct = layout_stage_costs(analytic_costs(spec, MicroBatchShape(tiles, tokens, llm_attn_tokens_sq=sq), tp,
                                                   A100), layout, pp, A100.p2p_bytes_per_s, modes)
        v = np.array([tiles, tokens, sq])
        for got, want in zip(coefs, direct):
            np.testing.assert_allclose(v @ got, want[:, 0], rtol=1e-9, atol=1e-15)


def test_memory_need_matches_stage_memory_and_brute_force():
    spec = get_preset("tiny")
    costs = analytic_costs(spec, MicroBatchShape(12, 900), 1, A100)
    n, pp, dp, m = len(costs.units), 3, 2, 5
    need = memory_need_table(costs, pp, 1, dp, m)
    best_brute = np.inf
    for cuts in itertools.combinations(range(1, n), pp - 1):
        counts = tuple(np.diff((0,) + cuts + (n,)).tolist())
        layout = PipelineLayout(counts)
        peaks = [s.peak_bytes for s in stage_memory(costs, layout, full_recompute_plan(layout, costs.units),
                                                      pp, 1, dp, m)]
        edges = (0,) + cuts + (n,)
        table = [need[k, edges[k], edges[k + 1]] for k in range(pp)]
        np.testing.assert_allclose(table, peaks, rtol=1e-12)
        if max(peaks) < best_brute:
            best_brute = max(peaks)
    best, stage, counts = memory_need(need)
    assert best == pytest.approx(best_brute, rel=1e-12)
    layout = PipelineLayout(counts)
    peaks = [s.peak_bytes for s in stage_memory(costs, layout, full_recompute_plan(layout, costs.units), pp, 1, dp, m)]
    assert max(peaks) == pytest.approx(best) and int(np.argmax(peaks)) == stage


def test_random_loads_pad_every_micro_batch_to_its_longest_sample():
    stats = synthetic_stats(203, 1)
    k, dp, m = 4, 3, 2
    loads, mean, worst = random_loads(stats, k, dp, m, iterations=3, seed=7)
    perm = np.random.default_rng(7).permutation(len(stats))
    rows = []
    for start in range(0, len(stats), k):
        idx = perm[start:start + k]
        longest = stats.tokens[idx].max()
        rows.append((stats.vit[idx].sum(), len(idx) * longest, len(idx) * float(longest) ** 2))
    rows = np.array(rows, dtype=float)
    np.testing.assert_allclose(mean, rows.mean(axis=0))
    np.testing.assert_allclose(worst, rows.max(axis=0))
    # iteration i, rank r, micro-batch j = group (step s_ij) * dp + r, steps from evenly spread starts
    steps = len(rows) // dp
    starts = np.floor(np.arange(3) * steps / 3).astype(int)
    for i, r, j in itertools.product(range(3), range(dp), range(m)):
        g = ((starts[i] + j) % steps) * dp + r
        np.testing.assert_allclose(loads.shape[i, r, j], rows[g])
    assert loads.samples.sum() == 3 * dp * m * k  # full groups only in these steps


def test_dp_simulation_waits_for_the_slowest_rank():
    m, P = 4, 3
    rng = np.random.default_rng(3)
    shape = rng.uniform(1, 2, (2, 2, m, 3))
    shape[1, 1] *= 1.7  # iteration 1: rank 1 carries more
    loads = Loads(shape, shape[..., 1], np.ones((2, 2, m)))
    coefs = tuple(rng.uniform(0.1, 1.0, (3, P)) * s for s in (1.0, 2.0, 0.01))
    out = simulate_loads(coefs, loads, allreduce_s=0.5)
    per_iter = []
    for i in range(2):
        per_rank = [simulate_pipeline(*[(shape[i, r] @ c)[..., None] for c in coefs[:2]], m,
                                      (shape[i, r] @ coefs[2])[..., None]).iteration_s for r in range(2)]
        per_iter.append(max(per_rank) + 0.5)
    assert out.iteration_s == pytest.approx(np.mean(per_iter))
    assert out.seconds_per_sample == pytest.approx(sum(per_iter) / (2 * 2 * m))
    assert out.iteration_s > out.balanced_iteration_s  # the straggler costs time


# ------------------------------------------------------------------------------------------------
def peaks_by_hand(units, counts, stages, pp, tp, dp, m, bytes_per_param):
    """Peak bytes of each pipeline rank, counted here from the memory model's definitions: static bytes
    (``bytes_per_param`` per parameter, a rank holding 1/tp), the activations each unit keeps per micro-batch
    (the first ``*_full_layers`` ViT / LLM layers of a stage keep their input only, the other layers of a
    ``*_selective`` stage keep the selective bytes) times the micro-batches alive, replayed forward by forward in
    Megatron's (interleaved) 1F1B order, plus the largest one-layer recompute working set.

    units: UnitCost per unit; counts: units per virtual stage (``pp * V`` of them, chunk c of rank r is virtual stage
    c * pp + r); stages: StageRecompute per virtual stage."""
    v = len(counts) // pp
    kept, static, work = [], [], []
    start = 0
    for count, sr in zip(counts, stages):
        seen = {"v": 0, "t": 0}
        act = transient = params = 0.0
        for u in units[start:start + count]:
            params += u.param_count / tp
            keep = u.act_bytes
            if u.code in seen:
                full = sr.vit_full_layers if u.code == "v" else sr.llm_full_layers
                selective = sr.vit_selective if u.code == "v" else sr.llm_selective
                if seen[u.code] < full:
                    keep = u.act_bytes_full
                elif selective:
                    keep = u.act_bytes_selective
                seen[u.code] += 1
            act += keep
            transient = max(transient, u.act_bytes - keep)
        kept.append(act)
        static.append(params * bytes_per_param)
        work.append(transient)
        start += count
    peaks = []
    for r in range(pp):
        chunks = [c * pp + r for c in range(v)]
        total = m * v
        warmup = min(pp - r - 1 if v == 1 else 2 * (pp - r - 1) + (v - 1) * pp, total)
        live, peak, fwd, bwd = [0] * v, 0.0, 0, 0

        def forward():
            nonlocal fwd, peak
            live[(fwd // pp) % v] += 1
            fwd += 1
            peak = max(peak, sum(n * kept[c] for n, c in zip(live, chunks)))

        def backward():
            nonlocal bwd
            live[v - 1 - (bwd // pp) % v] -= 1
            bwd += 1
        for _ in range(warmup):
            forward()
        while fwd < total:
            forward()
            backward()
        assert min(live) >= 0
        peaks.append(sum(static[c] for c in chunks) + peak + max(work[c] for c in chunks))
    return peaks


def check_plan(plan, spec_name: str, gpus: int, budget: float):
    spec = get_preset(spec_name)
    d = plan.to_dict()
    for key in ("model", "tp", "pp", "dp", "isf", "rows", "trainer_flags", "trainer_args", "pipeline_layout",
                "recompute_plan", "num_microbatches", "budget_bytes", "shapes"):
        assert key in d
    assert d["model"] == spec_name and plan.tp * plan.pp * plan.dp == gpus
    assert [r["setting"] for r in d["rows"]] == list(SETTINGS)
    flags = d["trainer_flags"]
    for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--pipeline-layout",
              "--recompute-plan", "--omnibal-isf-qv", "--omnibal-isf-qt", "--micro-batch-size"):
        assert f in flags and f in d["trainer_args"]
    assert flags["--omnibal-isf-qv"] == d["isf"]["params"]["qv"] and flags["--omnibal-isf-qt"] == d["isf"]["params"]["qt"]
    # the trainer groups with the plan's thresholds and pass count T exactly (it never re-plans)
    from megatron.training.flags import build_parser
    from megatron.training.specs import isf_params_from_flags

    trainer = build_parser().parse_args(shlex.split(d["trainer_args"]))
    assert isf_params_from_flags(trainer) == ISFParams(**d["isf"]["params"])
    v = flags.get("--virtual-pipeline-model-parallel-size") or 1  # left out (None) at V = 1
    assert v == plan.vpp == d["vpp"] and ("--virtual-pipeline-model-parallel-size" in d["trainer_args"]) == (v > 1)
    layout = parse_layout(flags["--pipeline-layout"], spec, flags["--pipeline-model-parallel-size"], vpp=v)
    stages = parse_recompute_plan(flags["--recompute-plan"], plan.pp * v)
    validate_recompute_plan(stages, layout, build_units(spec))
    assert flags["--global-batch-size"] == plan.num_microbatches * plan.dp * flags["--micro-batch-size"]
    assert flags["--use-distributed-optimizer"] is True and flags["--bf16"] == (plan.device != "cpu")
    rows = {r.setting: r for r in plan.rows}
    # +data runs Megatron's default layout with full recompute
    assert rows["+data"].stage_units == default_layout(spec, plan.pp).stage_units
    assert rows["baseline"].stage_units == rows["+data"].stage_units
    units = build_units(spec)
    assert all(rows[s].vpp == 1 for s in ("baseline", "+data", "+model"))  # the paper's ablation: no interleaving
    if v > 1:  # per chunk: every layer recomputed or none (the interleaved memory level's plans)
        full = full_recompute_plan(layout, units)
        assert all(st == f or (st.vit_full_layers, st.llm_full_layers, st.vit_selective, st.llm_selective)
                   == (0, 0, False, False) for st, f in zip(stages, full))
        assert plan.pp <= plan.num_microbatches and plan.num_microbatches % plan.pp == 0
    for s in ("baseline", "+data", "+model"):  # full recompute of every layer
        lay = PipelineLayout(rows[s].stage_units)
        assert parse_recompute_plan(rows[s].recompute_flag, plan.pp) == full_recompute_plan(lay, units)
    # never slower as the levels add up (all three ISF rows run the same micro-batches)
    assert rows["+memory"].iteration_s <= rows["+model"].iteration_s * (1 + 1e-12)
    assert rows["+model"].iteration_s <= rows["+data"].iteration_s * (1 + 1e-12)
    for s in ("+model", "+memory"):
        assert rows[s].fits_memory and max(rows[s].stage_peak_bytes) <= budget
    # stage memory of the plan at the ISF caps, counted by hand from the units' costs
    caps = plan.shapes["isf_caps"]
    # TP > 1 runs sequence parallelism: the flag is emitted and the memory model counts it
    assert flags["--sequence-parallel"] == (plan.tp > 1)
    assert ("--sequence-parallel" in d["trainer_args"]) == (plan.tp > 1)
    costs = analytic_costs(spec, MicroBatchShape.from_dict(caps), plan.tp, A100, attention=plan.attention,
                           sequence_parallel=plan.tp > 1)
    per_param = 2 + 4 + 12 / plan.dp if flags["--bf16"] else 4 + 4 + 8 / plan.dp  # distributed Adam, sharded over DP
    peaks = peaks_by_hand(costs.units, layout.stage_units, stages, plan.pp, plan.tp, plan.dp, plan.num_microbatches,
                          per_param)
    np.testing.assert_allclose(peaks, rows["+memory"].stage_peak_bytes, rtol=1e-12)
    for r in plan.rows:  # GPU-days from time per sample, samples and GPUs
        assert r.gpu_days == pytest.approx(plan.samples * r.iteration_s / r.samples_per_iteration * gpus / 86400)
        assert r.speedup == pytest.approx(rows["baseline"].gpu_days / r.gpu_days)
    assert rows["baseline"].speedup == pytest.approx(1.0)


def test_plan_tiny_chooses_sizes(tmp_path):
    stats = synthetic_stats(1500, 2, max_tiles=4, tokens_per_tile=4)
    budget = 0.9 * GIB
    plan = make_plan(stats, PlanConfig("tiny", 4, 1 * GIB, global_batch_size=32, sim_iterations=2, isf_max_candidates=4))
    check_plan(plan, "tiny", 4, budget)
    assert plan.tp in (1, 2)  # tiny's 2 key/value groups rule out TP 4
    # brute force: the whole plan (ISF, partition, recompute, simulated iterations) at every (TP, PP) of 4 GPUs, each
    # given as fixed sizes; the chosen sizes are those whose balanced plan simulates the fewest GPU-days
    simulated = {}
    for tp, pp in itertools.product((1, 2, 4), repeat=2):
        if 4 % (tp * pp):
            continue
        try:
            fixed = make_plan(stats, PlanConfig("tiny", 4, 1 * GIB, tp=tp, pp=pp, global_batch_size=32,
                                                sim_iterations=2, isf_max_candidates=4))
        except PlanError as e:
            assert tp == 4 and "TP 4" in str(e), (tp, pp, e)  # the 2 key/value groups
            continue
        simulated[tp, pp] = {r.setting: r for r in fixed.rows}["+memory"].gpu_days
    assert len(simulated) == 5
    assert min(simulated, key=simulated.get) == (plan.tp, plan.pp), simulated
    assert any("TP 4" in c.get("reason", "") for c in plan.configs_tried)


def test_plan_internvl_fixed_sizes():
    stats = synthetic_stats(1200, 3)
    plan = make_plan(stats, PlanConfig("internvl-6b-20b", 16, 80 * GIB, tp=1, pp=4, global_batch_size=64,
                                       sim_iterations=2, isf_max_candidates=4, samples=1_200_000))
    check_plan(plan, "internvl-6b-20b", 16, 72 * GIB)
    assert (plan.tp, plan.pp, plan.dp) == (1, 4, 4) and plan.samples == 1_200_000
    rows = {r.setting: r for r in plan.rows}
    # the default layout puts the whole ViT on stage 0: balancing the layout must pay off
    assert rows["+model"].iteration_s < 0.8 * rows["+data"].iteration_s
    # ISF packs without padding: fewer LLM token-seconds wasted than random batching
    assert rows["+data"].tokens_per_s > rows["baseline"].tokens_per_s


def test_refusal_names_stage_need_and_budget():
    stats = synthetic_stats(300, 4)
    with pytest.raises(PlanError) as e:
        make_plan(stats, PlanConfig("internvl-6b-34b", 2, 80 * GIB, global_batch_size=16, sim_iterations=1,
                                    isf_max_candidates=2))
    msg = str(e.value)
    assert "\n" not in msg and "does not fit 2 GPUs" in msg
    m = re.search(r"TP=(\d+) PP=(\d+) DP=(\d+), needs ([\d.]+) GiB on pipeline stage (\d+).*budget of ([\d.]+) GiB", msg)
    assert m, msg
    tp, pp, dp = int(m.group(1)), int(m.group(2)), int(m.group(3))
    assert tp * pp * dp == 2 and float(m.group(6)) == pytest.approx(72.0)
    # the 34B LLM alone holds ~34e9 parameters at >= 6 bytes each: far over 2 x 72 GiB in any split
    assert float(m.group(4)) > 72.0 and 34e9 * 6 / (tp * pp) / GIB > 72


def test_bad_requests():
    stats = synthetic_stats(200, 5)
    with pytest.raises(PlanError, match="--gpus is 4"):
        make_plan(stats, PlanConfig("tiny", 4, GIB, tp=1, pp=2, dp=1))
    with pytest.raises(PlanError, match="no usable"):
        make_plan(stats, PlanConfig("tiny", 4, GIB, tp=4))  # 2 key/value groups
    with pytest.raises(ValueError, match="unknown model preset"):
        make_plan(stats, PlanConfig("nope", 4, GIB))


def test_candidate_configs_honour_min_pp():
    from omnibal_ext.plan import candidate_configs

    spec = get_preset("internvl-6b-20b")
    every, _ = candidate_configs(spec, 16)
    deep, skipped = candidate_configs(spec, 16, min_pp=4)
    assert {p for _, p, _ in every} >= {1, 2, 4} and deep == [c for c in every if c[1] >= 4]
    assert any(s.get("pp") == 2 and "below the 4 stages" in s["reason"] for s in skipped)
    # InternViT-6B's 25 heads are padded, so the LLM's 8 key-value groups bound TP
    assert {t for t, _, _ in every} == {1, 2, 4, 8}


def test_plus_model_refuses_instead_of_falling_back_to_a_layout_that_does_not_fit(monkeypatch):
    """When no +model layout fits with full recompute the planner says so, naming the configuration and
    each candidate's need, instead of reporting a layout over the budget."""
    from omnibal_ext.plan import context, model_level

    real = context.stage_peaks
    over = {}

    def memory_over_budget(ctx, costs, layout, stages):
        over["budget"] = ctx.budget
        return tuple(2 * ctx.budget for _ in real(ctx, costs, layout, stages))

    monkeypatch.setattr(model_level, "stage_peaks", memory_over_budget)
    ctx = context.build_context(get_preset("tiny"), get_device("a100-80g"), 1, 2, 1, 4, 80 * GIB, "unfused",
                                MicroBatchShape(8, 512), MicroBatchShape(8, 512))
    default = default_layout(ctx.spec, 2)
    cands = model_level.model_candidates(ctx, default)
    with pytest.raises(PlanError) as e:
        model_level.fitting_model_candidates(ctx, cands)
    message = str(e.value)
    assert "no +model plan fits tiny at TP=1 PP=2 DP=1, 4 micro-batches, budget 80.0 GiB per GPU" in message
    assert message.count("with full recompute") == len(cands) and "160.0 GiB" in message


def test_plus_memory_refuses_with_each_candidates_reason(monkeypatch):
    from omnibal_ext.memory.recompute import MemoryBudgetError
    from omnibal_ext.plan import context, memory_level

    def no_budget(*args, **kwargs):
        raise MemoryBudgetError(0, 2.0 * GIB, 1.0 * GIB, "even full recompute")

    monkeypatch.setattr(memory_level, "plan_recompute", no_budget)
    monkeypatch.setattr(memory_level, "plan_layout_and_recompute", no_budget)
    ctx = context.build_context(get_preset("tiny"), get_device("a100-80g"), 1, 2, 1, 4, 1 * GIB, "unfused",
                                MicroBatchShape(8, 512), MicroBatchShape(8, 512))
    with pytest.raises(PlanError, match=r"no \+memory plan fits tiny at TP=1 PP=2 DP=1.*layout search \+ adaptive "
                                        r"recompute: .*; default layout \+ adaptive recompute: "):
        memory_level.memory_candidates(ctx, [("default", default_layout(ctx.spec, 2))])


@pytest.mark.parametrize("name,kv_groups,head_dim", [("internvl3-1b", 2, 64), ("internvl3-2b", 2, 128),
                                                      ("internvl3-8b", 4, 128)])
def test_plan_internvl3_presets(name, kv_groups, head_dim):
    """The InternVL3 presets (InternViT-300M + Qwen2.5) plan on 64 GPUs of 80 GiB, sizes chosen."""
    spec = get_preset(name)
    assert (spec.vision.num_layers, spec.vision.hidden_size, spec.vision.head_dim, spec.tokens_per_tile) == \
        (24, 1024, 64, 256)
    assert spec.language.kv_groups == kv_groups and spec.language.hidden_size // spec.language.num_attention_heads \
        == head_dim and spec.language.vocab_size % 128 == 0
    plan = make_plan(synthetic_stats(1200, 4), PlanConfig(name, 64, 80 * GIB, global_batch_size=256, sim_iterations=2,
                                                      isf_max_candidates=4))
    check_plan(plan, name, 64, 72 * GIB)


# ------------------------------------------------------------------------------------------------
def _llm_only_stages(plan, setting):
    """Indices of the row's pipeline stages that hold LLM units only (no ViT, no projector)."""
    flag = plan.row(setting).layout_flag
    return [i for i, s in enumerate(flag.split("|")) if "v" not in s and "P" not in s]


def test_plan_with_context_parallelism_counts_per_rank_work():
    """--cp 2 on the same data: DP halves, the LLM stages' time per micro-batch about halves (the same default
    layout and full recompute: the +data row), every stage's memory drops, and the trainer flags carry
    --context-parallel-size with --sequence-parallel (TP 2: samples padded to 2 x CP x TP = 8)."""
    stats = synthetic_stats(3000, 0)
    plans = {cp: make_plan(stats, PlanConfig("internvl-6b-20b", 16, 80 * GIB, tp=2, pp=4, cp=cp, sim_iterations=2,
                                             isf_max_candidates=5, isf_search_samples=3000)) for cp in (1, 2)}
    one, two = plans[1], plans[2]
    assert (one.dp, two.dp, one.cp, two.cp) == (2, 1, 1, 2)
    row1, row2 = one.row("+data"), two.row("+data")
    assert row1.layout_flag == row2.layout_flag
    llm = _llm_only_stages(one, "+data")
    assert llm
    for i in llm:
        assert 0.45 < row2.stage_time_s[i] / row1.stage_time_s[i] < 0.6
    for s in range(4):  # the ViT stages too: half the tiles each
        assert row2.stage_time_s[s] < 0.65 * row1.stage_time_s[s]
    assert all(b < a for a, b in zip(row1.stage_peak_bytes, row2.stage_peak_bytes))
    assert one.trainer_flags["--sequence-parallel"] is True and "--context-parallel-size" not in one.trainer_flags
    assert two.trainer_flags["--context-parallel-size"] == 2 and two.trainer_flags["--sequence-parallel"] is True
    assert "--sequence-parallel" in two.trainer_args and "--context-parallel-size=2" in two.trainer_args
    assert any("padded to a multiple of 8 tokens (2 x CP x TP" in n for n in two.notes)
    assert two.shapes["isf_caps"]["cp"] == 2 and two.to_dict()["cp"] == 2
    assert "CP=2" in format_plan(two)


def test_context_parallel_costs_count_sequence_parallelism():
    from omnibal_ext.plan.context import build_context
    from omnibal_ext.plan.trainer_flags import sequence_parallel, sp_tp

    assert sequence_parallel(2) and not sequence_parallel(1) and (sp_tp(1), sp_tp(4)) == (1, 4)
    spec = get_preset("internvl-6b-20b")
    shape = MicroBatchShape(8, 4096, llm_attn_tokens_sq=4096.0 * 1024, cp=2)
    ctx = build_context(spec, A100, 2, 4, 1, 8, 70 * GIB, "unfused", shape, shape, cp=2)
    assert ctx.costs_isf.meta["sequence_parallel"] is True and ctx.grad_ranks == 2
    with pytest.raises(ValueError):
        build_context(spec, A100, 2, 4, 1, 8, 70 * GIB, "unfused", MicroBatchShape(8, 4096), shape, cp=2)


def test_cp_data_level_pads_as_the_trainer():
    """Under CP the ISF plan groups, and the shapes count, every sample padded to 2 x CP (x TP with sequence
    parallelism), computed here by brute force: Qt caps the padded tokens of every group."""
    from omnibal_ext.plan.data_level import cap_shape, isf_for_ranks, mean_isf_group

    def pad(n, multiple):
        while n % multiple:
            n += 1
        return n

    stats = synthetic_stats(2000, 3)
    config = PlanConfig("tiny", 4, GIB, cp=4, isf_max_candidates=4, isf_search_samples=2000)
    for sp_tp in (1, 2):
        data = isf_for_ranks(stats, 1, config, sp_tp)
        g = data.grouping
        tok = [np.array([pad(int(n), 8 * sp_tp) for n in stats.tokens[m]]) for m in g.groups()]
        assert g.tokens.tolist() == [int(t.sum()) for t in tok]
        assert max(t.sum() for t in tok) <= data.params.qt
        shape, _ = mean_isf_group(stats, g, 4, sp_tp)
        np.testing.assert_allclose(shape, [g.tiles.mean(), np.mean([t.sum() for t in tok]),
                                           np.mean([(t.astype(float) ** 2).sum() for t in tok])])
        real = np.mean([stats.tokens[m].sum() for m in g.groups()])
        assert shape[1] > real
        cap = cap_shape(data.params, stats, 4, sp_tp)
        assert cap.cp == 4 and cap.llm_tokens == data.params.qt and cap.vision_items == data.params.qv
        assert cap.llm_attn_tokens_sq == min(cap.llm_tokens, pad(int(stats.tokens.max()), 8 * sp_tp)) * cap.llm_tokens


def test_cp_request_checks():
    stats = synthetic_stats(200, 1)
    with pytest.raises(PlanError, match="--cp"):
        make_plan(stats, PlanConfig("tiny", 4, GIB, cp=3))
    with pytest.raises(PlanError, match="--cp"):
        make_plan(stats, PlanConfig("tiny", 4, GIB, tp=1, pp=2, dp=1, cp=1))


# The interleaved pipeline (V model chunks per rank)
def _plan_6b20b(global_batch: int, **kw):
    """InternVL 6B+20B at TP4 PP4 DP1 on 16 GPUs of 80 GiB (K = 4: global batch 64 = 16 micro-batches)."""
    return make_plan(synthetic_stats(1200, 5), PlanConfig("internvl-6b-20b", 16, 80 * GIB, tp=4, pp=4, dp=1,
                                                          global_batch_size=global_batch, attention="flash",
                                                          sim_iterations=2, isf_max_candidates=4, **kw))


def test_plan_picks_interleaving_when_predicted_faster_and_its_flags_parse():
    plan = _plan_6b20b(64)
    assert plan.num_microbatches == 16 and plan.vpp == 2
    check_plan(plan, "internvl-6b-20b", 16, 72 * GIB)  # flags, layout and per-chunk recompute, memory per rank
    flags = plan.trainer_flags
    assert flags["--virtual-pipeline-model-parallel-size"] == 2
    assert "--virtual-pipeline-model-parallel-size=2" in plan.trainer_args and "--sequence-parallel" in plan.trainer_args
    spec = get_preset("internvl-6b-20b")
    layout = parse_layout(flags["--pipeline-layout"], spec, 4, vpp=2)
    assert layout.num_stages == 8 and parse_layout(flags["--pipeline-layout"], spec, 4, vpp=None) == layout
    with pytest.raises(Exception):  # not a plain 4-stage layout
        parse_layout(flags["--pipeline-layout"], spec, 4)
    final = plan.row("+memory")
    assert final.vpp == 2 and len(final.stage_units) == 8 and len(final.stage_peak_bytes) == 4
    assert plan.to_dict()["vpp"] == 2 and any("V=2" in n for n in plan.notes)
    screened = [c for c in plan.configs_tried if "estimated_seconds_per_sample_by_vpp" in c]
    assert screened and screened[0]["vpp"] == 2
    by_v = screened[0]["estimated_seconds_per_sample_by_vpp"]
    assert by_v["2"] < by_v["1"]
    # the simulator's verdict: the same request held at V = 1 predicts a slower +memory iteration
    plain = _plan_6b20b(64, vpp=1)
    assert plain.vpp == 1 and "--virtual-pipeline-model-parallel-size" not in plain.trainer_args
    assert final.iteration_s < plain.row("+memory").iteration_s
    assert [r.iteration_s for r in plan.rows[:3]] == [r.iteration_s for r in plain.rows[:3]]  # ablation rows: V = 1
    assert "V=2 (interleaved)" in format_plan(plan) and "(per chunk)" in format_plan(plan)


def test_plan_never_interleaves_when_the_micro_batches_do_not_allow_it():
    plan = _plan_6b20b(56)  # 14 micro-batches per pipeline: not a multiple of PP 4
    assert plan.num_microbatches == 14 and plan.vpp == 1
    assert "--virtual-pipeline-model-parallel-size" not in plan.trainer_args
    assert all(c.get("vpp", 1) == 1 for c in plan.configs_tried)
    assert any("not a multiple of PP 4" in n for n in plan.notes)
    check_plan(plan, "internvl-6b-20b", 16, 72 * GIB)
    with pytest.raises(PlanError, match="V=2: 14 micro-batches per pipeline are not a multiple of PP 4"):
        _plan_6b20b(56, vpp=2)


def test_vpp_problem_rules():
    from omnibal_ext.plan.interleaved import vpp_problem

    assert vpp_problem(4, 16, 2, 100) is None and vpp_problem(4, 4, 3, 100) is None
    assert vpp_problem(4, 16, 1, 3) is None  # V = 1 is always allowed
    assert "PP >= 2" in vpp_problem(1, 16, 2, 100)
    assert "not a multiple" in vpp_problem(4, 2, 2, 100) and "not a multiple" in vpp_problem(4, 6, 2, 100)
    assert "exceed" in vpp_problem(4, 16, 2, 7)
