"""MoE layers under context parallelism against the single-process run: each sample's tokens are split over the CP
ranks (megatron/vlm/parallel/context_parallel.py), so megatron-core's aux loss sums its token counts over TP x CP and our
per-sample seq_aux_loss sums each sample's routed tokens over TP x CP (megatron/vlm/layers/moe.py), padding excluded;
EP comes from DP x CP in megatron-core's grid. Losses, gradient norms and the logged aux loss within 1e-4 / 1e-3
for 6 iterations, the logged expert load the serial run's."""
import pytest
import torch

from megatron.vlm.parallel.context_parallel import split_tokens
from megatron.vlm.layers.moe import token_mask

# test_moe_training.py's flags and helpers: the serial reference of the random-batching runs is that file's, shared
# in a session
from test_moe_training import BASE, assert_close, column, data  # noqa: E402,F401 (data: the fixture)

CP2 = ["--context-parallel-size", "2"]


def assert_equals_serial(records, serial):
    for key, rel in (("lm loss", 1e-4), ("grad norm", 1e-3), ("moe aux loss", 1e-4), ("expert load imbalance", 1e-6)):
        assert_close(column(records, key), column(serial, key), rel)
    assert records[5]["lm loss"] < records[0]["lm loss"]
    assert all(2.5 < r["moe aux loss"] < 6.0 for r in records)  # 3 MoE layers, each near its balanced value 1


def test_token_mask_lines_up_the_cp_ranks_samples():
    """A short last sample (1 token) lies wholly on CP rank 0: with the unsplit micro-batch's segment count as the
    sample axis both ranks' masks have the same width (their per-sample sums all-reduce), and the ranks' columns sum
    to each sample's tokens, pads in column 0."""
    batch = {"segment_ids": torch.tensor([[0, 0, 0, 0, 0, 1]]), "cu_seqlens": torch.tensor([0, 5, 6])}
    parts = [split_tokens(batch, 2, rank, 0, None)["segment_ids"] for rank in (0, 1)]
    assert int(parts[1].max()) == 0  # rank 1 holds none of sample 1
    masks = [token_mask(p, samples=len(batch["cu_seqlens"]) - 1) for p in parts]
    assert masks[0].shape[-1] == masks[1].shape[-1] == 3
    per_sample = sum(m.reshape(-1, 3).sum(dim=0) for m in masks)
    assert per_sample.tolist() == [8 + 4 - 6, 5, 1]  # 8 + 4 padded tokens, 6 real
    with pytest.raises(ValueError, match="segment ids name 2"):
        token_mask(parts[0], samples=1)


def test_plan_screens_the_expert_grid_over_dp_x_cp():
    """omnibal plan at CP2 on 4 GPUs: every (TP, PP, DP, EP, ETP) megatron-core allows with EP from DP x CP (EP x
    ETP dividing TP x CP x DP), brute force over the definition; the trainer flags carry CP and EP."""
    from test_moe_plan import E, tiny_moe_spec, vlm_stats

    from omnibal_ext.memory.memory_model import GIB
    from omnibal_ext.model.units import build_units
    from omnibal_ext.plan import PlanConfig, make_plan

    spec = tiny_moe_spec(freq=(1, 1, 0, 1))
    plan = make_plan(vlm_stats(200, 1), PlanConfig(spec, 4, 4 * GIB, global_batch_size=32, sim_iterations=1,
                                                  isf_max_candidates=2, max_vpp=1, cp=2))
    screened = {(r["tp"], r["pp"], r["dp"], r["ep"], r["etp"]) for r in plan.configs_tried if "least_need_bytes" in r}
    want = set()
    for tp in (1, 2, 4):
        if spec.language.num_attention_heads % tp or spec.language.kv_groups % tp:
            continue
        for pp in (1, 2, 4):
            dp = 4 // (tp * pp * 2)
            if tp * pp * 2 * dp != 4 or pp > len(build_units(spec)):
                continue
            want |= {(tp, pp, dp, ep, etp) for ep in range(1, E + 1) for etp in {1, tp}
                     if E % ep == 0 and (tp * 2 * dp) % (ep * etp) == 0}
    assert screened == want and any(g[3] == 2 and g[2] == 1 for g in want)  # EP2 over the CP ranks alone
    assert plan.trainer_flags["--context-parallel-size"] == 2
    assert plan.trainer_flags["--expert-model-parallel-size"] == plan.ep


@pytest.mark.slow
@pytest.mark.parametrize("nproc,flags", [(2, CP2), (4, CP2 + ["--expert-model-parallel-size", "2"])],
                         ids=["cp2", "ep2cp2"])
def test_moe_cp_equals_serial(data, serial_run, shared_runs, nproc, flags):
    """megatron-core's aux loss (token counts over TP x CP); EP2 x CP2: the experts' EP group spans the CP ranks."""
    serial = serial_run(BASE + data)
    records, _, _ = shared_runs.run(nproc, BASE + data + flags)
    assert_equals_serial(records, serial)


@pytest.mark.slow
def test_seq_aux_loss_per_sample_cp2_equals_serial(data, serial_run, shared_runs):
    """seq_aux_loss per packed sample with ISF packing several samples into a row, each cut into CP chunks over the
    two ranks (a short sample's tokens may all sit on one rank): the serial run, told to count each sample padded
    to 2 x CP tokens as the CP2 run's ISF does."""
    flags = BASE + data + ["--omnibal-isf", "--moe-router-load-balancing-type", "seq_aux_loss"]
    serial = serial_run(flags + ["--omnibal-isf-token-multiple", "4"])
    records, _, _ = shared_runs.run(2, flags + CP2)
    assert_equals_serial(records, serial)


# interleaved pipeline: rank 0 runs stages 0 and 2 (an MoE layer on each chunk), rank 1 stages 1 (dense) and 3 (MoE)
VPP_LAYOUT = "Iv*4PEt|t|t|tL"


@pytest.mark.slow
@pytest.mark.parametrize("nproc,flags", [(2, []), (4, ["--expert-model-parallel-size", "2"])],
                         ids=["pp2v2", "ep2pp2v2"])
def test_moe_interleaved_equals_serial(data, serial_run, shared_runs, nproc, flags):
    """megatron-core's interleaved 1F1B schedule with MoE layers on both model chunks of a rank: the aux-loss
    tracker and the expert load see every chunk's routers once per micro-batch."""
    serial = serial_run(BASE + data)
    records, out, _ = shared_runs.run(nproc, BASE + data + flags + ["--pipeline-model-parallel-size", "2",
                                                                     "--pipeline-layout", VPP_LAYOUT])
    assert "interleaved: 2 model chunks per rank" in out
    assert_equals_serial(records, serial)


@pytest.mark.slow
def test_global_aux_loss_cp2_equals_serial(data, serial_run, shared_runs):
    """global_aux_loss (megatron-core's token counts over TP x DP x CP, accumulated over the micro-batches) with the
    z-loss (megatron/vlm/layers/moe.py MaskedTopKRouter.apply_z_loss: the mean over the TP x CP group's real tokens; at
    CP2 megatron-core 0.16's own would give half the gradient)."""
    flags = BASE + data + ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-z-loss-coeff", "0.1"]
    records, serial = shared_runs.run(2, flags + CP2)[0], serial_run(flags)
    assert_equals_serial(records, serial)
    assert_close(column(records, "moe z loss"), column(serial, "moe z loss"), 1e-4)
