"""What the trainer logs of its MoE layers each iteration: ``moe aux loss`` from megatron-core's aux-loss tracker
(``moe_utils``: each router records its load-balancing and z losses, without their coefficients, per decoder layer)
and the expert load from the routers' routing maps (``megatron.vlm.layers.moe.ExpertLoad``), both over every rank; and
``--log-expert-load`` FILE, the per-layer, per-expert token counts as JSON lines.

``moe aux loss``: the routers' losses summed over the MoE layers and the loss kinds, per micro-batch (megatron-core's
reduction: summed over pipeline stages and its reduce group, averaged over data-parallel ranks; divided here by the
micro-batches per data-parallel rank).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils

from megatron.vlm.layers.moe import ExpertLoad, load_metrics

from .run_plan import RunPlan

# megatron-core's tracker names (router.py): the load-balancing losses and the z-loss
TRACKED = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


class MoELog:
    """Per-iteration MoE metrics of a run whose model chunks are ``modules`` (unwrapped stages) with ``num_layers``
    decoder layers and ``num_experts`` experts at EP ``ep``; ``path``: --log-expert-load (None: not written),
    written by ``writer`` (the logging rank); aux_loss / z_loss: the run has a load-balancing loss / a z-loss (logged
as ``moe aux loss`` / ``moe z loss``); device: where the routers' losses are (the tracker's tensors)."""

    def __init__(self, modules, num_layers: int, num_experts: int, ep: int, path: str | None, writer: bool,
                 num_microbatches: int, aux_loss: bool = True, z_loss: bool = False, device=None):
        self.aux_loss, self.z_loss = aux_loss, z_loss
        self.num_layers, self.num_experts, self.ep = num_layers, num_experts, ep
        self.num_microbatches = num_microbatches
        self.load = ExpertLoad().attach(modules)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        for name in TRACKED:  # indexed by decoder layer (MoETextLayer numbers its routers), not by block
            tracker.setdefault(name, {"values": torch.zeros(num_layers, device=device), "reduce_group": None, "avg_group": None,
                                      "reduce_group_has_dp": False})
        self.file = None
        if path and writer:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")

    def start_iteration(self) -> None:
        self.load.reset()
        moe_utils.clear_aux_losses_tracker()

    def metrics(self, iteration: int, group=None) -> dict:
        """This iteration's metrics (every rank calls it: collectives over ``group``, default the world)."""
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        values = torch.stack([tracker[n]["values"].detach().to("cpu", torch.float64) for n in TRACKED])
        dist.all_reduce(values, group=group)  # each layer's values live on its stage; ranks hold parts of a loss
        dp = parallel_state.get_data_parallel_world_size()
        # megatron-core's reduction (reduce_aux_losses_tracker_across_ranks): the load-balancing losses' parts sum
        # over TP x CP (each rank's tokens under sequence or context parallelism) and average over DP; the global
        # one's parts sum over DP too; the z-loss's too (MaskedTopKRouter.apply_z_loss: parts of the TP x CP mean)
        per_name = values.sum(dim=1) / torch.tensor([dp, dp, 1, dp], dtype=torch.float64)
        per_name /= self.num_microbatches
        out = {}
        if self.aux_loss:
            out["moe aux loss"] = float(per_name[:3].sum())
        if self.z_loss:
            out["moe z loss"] = float(per_name[3])
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        for layer, c in self.load.counts.items():
            counts[layer] += c
        dist.all_reduce(counts, group=group)
        per_layer = {layer: counts[layer] for layer in range(self.num_layers) if counts[layer].sum() > 0}
        out.update(load_metrics(per_layer, self.ep))
        if self.file:
            self.file.write(json.dumps({"iteration": iteration, "tokens_per_expert":
                                        {str(k): [int(x) for x in v] for k, v in per_layer.items()}}) + "\n")
            self.file.flush()
        return out

    def close(self) -> None:
        self.load.detach()
        if self.file:
            self.file.close()


def moe_log_of(plan: RunPlan, modules, device) -> MoELog | None:
    """The MoE log of a run (None for a dense model): ``modules`` its unwrapped model chunks."""
    moe = plan.model_spec.language.moe
    if moe is None:
        return None
    run = plan.config.model.moe_run
    return MoELog(modules, plan.model_spec.language.num_layers, moe.num_experts, run.ep, plan.config.log.log_expert_load,
                  dist.get_rank() == dist.get_world_size() - 1, plan.config.optim.num_microbatches,
                  aux_loss=moe.load_balancing_type != "none" and run.aux_loss_coeff > 0,
                  z_loss=bool(run.z_loss_coeff), device=device)
