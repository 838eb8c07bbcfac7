"""Mixture-of-experts decoder layers at run time, on megatron-core's MoE (``MoELayer``, ``TopKRouter``,
``SequentialMLP``, the alltoall / allgather token dispatchers).

What a checkpoint or preset says about the experts is the planning side's ``omnibal_ext.model.moe.MoESpec``
(``LanguageSpec.moe``); how a run trains them (loss coefficients, aux-loss-free bias, dispatcher, token drop
policy, expert-parallel sizes) is ``MoERun``, made from the flags. ``config_fields`` maps both onto megatron-core's
TransformerConfig fields; ``layer_spec`` turns a dense layer spec into the MoE one.

Routing (megatron-core's ``topk_routing_with_score_function``): softmax scores with ``moe_router_pre_softmax`` False
take the softmax over the top-k logits (the k probabilities sum to 1: HF ``norm_topk_prob`` True); with it True the
softmax over all experts, then the top k (unnormalised: ``norm_topk_prob`` False). Sigmoid scores are always
renormalised over the top k when k > 1.

Expert weights: megatron-core draws each rank's local experts one after the other from the running generator, so
EP would change them; ``SeededSequentialMLP`` draws expert ``g`` (global index) from its own seed, taken from the
layer's seeded generator, and leaves that generator as one draw moved on: the weights of every expert, and of what
the layer draws after them (the shared expert), do not depend on EP or ETP.

Padding and packed samples: the router gets ``token_mask``'s mask (padding, and which packed sample each token
belongs to) through megatron-core's ``padding_mask`` argument; megatron-core's losses and the expert-bias count see
the padding part, and ``seq_aux_loss`` is computed per packed sample (``per_sample_aux_loss``), padding excluded.

Token dispatchers: megatron-core 0.16's config refuses allgather with variable sequence lengths (its all-gather over
the expert TP x EP group needs the same token count on every rank), which our stages need; the config always names
alltoall and ``DispatchedMoELayer`` swaps in ``PaddedAllGatherTokenDispatcher`` for allgather (each rank's tokens
padded to the group's largest count, the pads routed to no expert).

Expert load: ``ExpertLoad`` records each router's routing map (a forward hook returning nothing: the router's
output is read, never changed) as tokens per expert per layer, for the log and ``--log-expert-load``.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler, compute_routing_scores_for_aux_loss,
                                                     get_default_pg_collection, save_to_aux_losses_tracker)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from omnibal_ext.model.moe import MoESpec

DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class MoERun:
    """How a run trains its MoE layers (Megatron's flags). aux_loss_coeff: ``--moe-aux-loss-coeff`` (the weight of
    ``MoESpec.load_balancing_type``'s loss); z_loss_coeff: ``--moe-z-loss-coeff`` (None: none); expert_bias:
    ``--moe-router-enable-expert-bias`` (aux-loss-free balancing, sigmoid router), bias_update_rate its step per
    iteration (``--moe-router-bias-update-rate``); drop_policy: ``--moe-token-drop-policy`` (with
    ``MoESpec.capacity_factor``); dispatcher: ``--moe-token-dispatcher-type``; ep / etp:
    ``--expert-model-parallel-size`` / ``--expert-tensor-parallel-size``."""

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    drop_policy: str = "probs"
    dispatcher: str = "alltoall"
    ep: int = 1
    etp: int = 1


def config_fields(moe: MoESpec | None, run: MoERun | None, tp: int) -> dict:
    """megatron-core TransformerConfig fields of a decoder with ``moe`` trained as ``run`` (none for a dense one)."""
    if moe is None:
        return {}
    run = run or MoERun()
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=list(moe.layer_freq), moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_load_balancing_type=moe.load_balancing_type,
        moe_aux_loss_coeff=run.aux_loss_coeff if moe.load_balancing_type != "none" else 0.0,
        moe_z_loss_coeff=run.z_loss_coeff, moe_router_enable_expert_bias=run.expert_bias,
        moe_router_bias_update_rate=run.bias_update_rate, moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=run.drop_policy,
        moe_token_dispatcher_type="alltoall",  # allgather: DispatchedMoELayer swaps it in (its docstring)
        expert_model_parallel_size=run.ep, expert_tensor_parallel_size=run.etp,
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        moe_router_dtype="fp32")


def expert_seed(base: int, expert: int) -> int:
    """The seed of global expert ``expert`` of a layer whose seeded generator gave ``base``."""
    return (base * 1_000_033 + 104_729 * (expert + 1)) % (2**31 - 1)


class SeededSequentialMLP(SequentialMLP):
    """megatron-core's ``SequentialMLP`` whose local experts are drawn from their global index's seed (module
    docstring): one ``base`` draw from the layer's generator, each expert under ``expert_seed(base, g)``."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        base = int(torch.randint(0, 2**31 - 1, (1,)))
        super().__init__(0, config, submodules, pg_collection)  # no expert drawn from the running generator
        self.num_local_experts = num_local_experts
        first = self.ep_group.rank() * num_local_experts  # MoELayer.local_expert_indices
        for j in range(num_local_experts):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(expert_seed(base, first + j))
                self.local_experts.append(MLP(self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size,
                                              is_expert=True, tp_group=pg_collection.expt_tp))


def token_mask(segment_ids: torch.Tensor, samples: int | None = None) -> torch.Tensor:
    """The router's token mask from the collate's segment ids (int [rows, sequence], the packed sample's index within
    the micro-batch, -1 on padding): bool [rows, sequence, 1 + samples], ``[..., 0]`` True at padding (megatron-core's
    ``padding_mask``), ``[..., 1 + s]`` True on the tokens of packed sample ``s``. megatron-core's ``MoELayer`` only
    transposes its first two axes and takes ``bool()`` of it on its way to the router (``MaskedTopKRouter``).
    samples: the width of the sample axis (at least the largest segment id + 1; default: exactly that); the ranks
    whose per-sample statistics are summed (context parallelism: each holds a part of every sample, some none of a
    short one) must give the same."""
    largest = int(segment_ids.max()) + 1 if segment_ids.numel() else 0
    if samples is None:
        samples = largest
    elif samples < largest:
        raise ValueError(f"token_mask: {samples} samples, but the segment ids name {largest}")
    return torch.nn.functional.one_hot(segment_ids + 1, 1 + samples).bool()


def split_token_mask(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(padding mask [sequence, rows], True at padding; sample membership bool [tokens, samples] in the router's
    token order, or None) of a router's mask: ``token_mask``'s, after ``MoELayer``'s transpose, or megatron-core's
    plain padding mask (no membership)."""
    if mask is None or mask.dim() == 2:
        return mask, None
    return mask[..., 0], mask[..., 1:].reshape(-1, mask.shape[-1] - 1)


def per_sample_aux_loss(scores: torch.Tensor, routed: torch.Tensor, members: torch.Tensor, topk: int,
                        reduce_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence aux loss with each packed sample as a sequence (megatron-core's seq_aux_loss, DeepSeek-V2's
    formula, per sample), padding excluded: the mean over the samples s of E / (k T_s^2) * sum_e P_se F_se, with
    T_s the sample's real tokens, P_se its tokens' scores of expert e summed (this rank's tokens) and F_se its tokens
    routed to e (every rank's of ``reduce_group``: sequence parallelism splits samples over TP ranks, whose parts
    of the loss then sum to the whole). scores / routed: [tokens, E] (zero on padding), members: bool [tokens, S].
    Returns (loss, the real tokens of ``reduce_group``'s ranks: what megatron-core's aux_loss scales its part by under
    per-token loss with a padding mask, its token count all-reduced in place)."""

    num_experts = scores.shape[-1]
    membership = members.to(scores.dtype)
    routed_per_sample = membership.t() @ routed.to(scores.dtype)  # [S, E]
    if reduce_group is not None:
        routed_per_sample = reduce_from_tensor_model_parallel_region(routed_per_sample, reduce_group)
    tokens = routed_per_sample.sum(dim=1) / topk  # [S]
    present = tokens > 0
    scores_per_sample = membership.t() @ scores  # [S, E]
    per_sample = (scores_per_sample * routed_per_sample).sum(dim=1) / tokens.clamp(min=1) ** 2
    loss = per_sample[present].sum() * (num_experts / topk) / present.sum().clamp(min=1)
    return loss, tokens.sum()


class MaskedTopKRouter(TopKRouter):
    """megatron-core's ``TopKRouter`` taking ``token_mask``'s mask: megatron-core's parts get the padding mask, and
    the sequence aux loss (``seq_aux_loss``) is ``per_sample_aux_loss``, one sequence per packed sample (megatron-core
    takes each row as one: a THD row of many samples as one sequence). Its expert-bias token count takes the padding
    mask as a column (0.16.1 ands the routing map [tokens, experts] with the flat mask [tokens], which fails)."""

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        padding, members = split_token_mask(padding_mask)
        probs, routing_map = super().routing(logits, padding_mask=padding)
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff > 0 and self.training and torch.is_grad_enabled():
            if members is None:
                raise ValueError("seq_aux_loss: the router needs megatron.vlm.layers.moe.token_mask's mask (which token "
                                 "belongs to which packed sample)")
            flat = logits.reshape(-1, self.config.num_moe_experts)
            routed, scores = compute_routing_scores_for_aux_loss(
                flat, self.topk, self.score_function, padding_mask=None if padding is None else padding.reshape(-1))
            loss, tokens = per_sample_aux_loss(scores, routed, members, self.topk, self.tp_cp_group)
            probs = self.attach_and_log_load_balancing_loss(probs, coeff, loss * coeff, "seq_load_balancing_loss",
                                                            self.tp_cp_group, valid_token_count=tokens)
        return probs, routing_map

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The z-loss (ST-MoE: coefficient x the mean over the real tokens of logsumexp(logits)^2) as the mean over
        every real token of the TP x CP group, whose ranks each hold a part of the micro-batch (sequence or context
        parallelism): this rank's part is its tokens' sum / the group's token count (the parts sum to the mean),
        and under per-token loss its gradient is the coefficient x its sum (the loss's token count divides it
        later). megatron-core 0.16 takes each rank's own mean and divides the coefficient by the group size, which
        under per-token loss scales the gradient by 1 / (TP x CP) and logs the mean of the ranks' means.
        logits [tokens, E]; padding_mask [tokens], True at padding. Logged (tracker "z_loss") without the
        coefficient, this rank's part of the group's mean."""

        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        squares = torch.logsumexp(logits, dim=-1).square()
        real = torch.ones_like(squares) if padding_mask is None else (~padding_mask).to(squares.dtype)
        local_sum = (squares * real).sum()
        tokens = real.sum().detach()
        if self.tp_cp_group.size() > 1:
            torch.distributed.all_reduce(tokens, group=self.tp_cp_group)
        mean_part = local_sum / tokens.clamp(min=1)
        logits = MoEAuxLossAutoScaler.apply(logits, coeff * (local_sum if self.calculate_per_token_loss else mean_part))
        save_to_aux_losses_tracker("z_loss", mean_part.detach(), self.layer_number, self.config.num_layers,
                                   reduce_group=self.tp_cp_group)
        return logits

    def _apply_seq_aux_loss(self, probs, *args, **kwargs):
        return probs  # per packed sample in ``routing`` instead

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1, 1)
        return super()._apply_expert_bias(routing_map, padding_mask=padding_mask)


class PaddedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron-core's allgather token dispatcher for ranks holding different numbers of tokens (our stages'
    variable sequence lengths: micro-batches and DP ranks differ): its all-gather over the expert TP x EP group
    needs the same count on every rank, so each rank's tokens are padded at their end to the group's largest count
    (one all-reduce of the count per forward), the pad rows routed to no expert (routing map False, probability 0:
    the experts never see them, their outputs are zero and nothing flows back to them) and cut off again after the
    reduce-scatter. The router ran before on the real tokens, so its aux losses and the expert load are those of
    the real tokens."""

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.unpadded_shape = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens = flat.shape[0]
        longest = torch.tensor([tokens], dtype=torch.int64, device=flat.device)
        if self.tp_size > 1 or self.ep_size > 1:
            torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX, group=self.tp_ep_group)
        pad = int(longest) - tokens
        if pad:
            flat = torch.nn.functional.pad(flat, (0, 0, 0, pad))
            routing_map = torch.nn.functional.pad(routing_map, (0, 0, 0, pad), value=False)
            probs = torch.nn.functional.pad(probs, (0, 0, 0, pad))
        return super().dispatch_preprocess(flat, routing_map, probs)

    def combine_postprocess(self, hidden_states):
        out = super().combine_postprocess(hidden_states)  # [largest count, H]
        return out[:self.unpadded_shape[:-1].numel()].reshape(self.unpadded_shape)


class DispatchedMoELayer(MoELayer):
    """megatron-core's ``MoELayer`` with the token dispatcher of ``--moe-token-dispatcher-type`` (``dispatcher``,
    a spec param): megatron-core 0.16's config refuses "allgather" with variable sequence lengths, so the config
    names "alltoall" and an allgather layer replaces the dispatcher megatron-core built by
    ``PaddedAllGatherTokenDispatcher`` (before the experts and shared expert are built: no draw from the
    generator in between, the weights stay those of the alltoall layer)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, dispatcher: str = "alltoall"):
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"DispatchedMoELayer: dispatcher {dispatcher!r} is not one of {', '.join(DISPATCHERS)}")
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection)
        if dispatcher == "allgather":
            if self.shared_expert_overlap:
                raise ValueError("DispatchedMoELayer: the allgather dispatcher has no shared-expert overlap")
            self.token_dispatcher = PaddedAllGatherTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection)


def layer_spec(dense_spec, num_experts: int, normalization: str, dispatcher: str = "alltoall"):
    """``dense_spec`` (a local-spec layer, already changed for the family: seeded layer, attention, norms) with
    megatron-core's MoE module as its MLP (the local backend: ``SequentialMLP`` experts, seeded per expert, the
    token dispatcher ``dispatcher``: ``DispatchedMoELayer``); the copy is changed, ``dense_spec`` is not."""


    spec = copy.deepcopy(dense_spec)
    mlp = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                   normalization=normalization).submodules.mlp
    mlp.submodules.experts.module = SeededSequentialMLP
    mlp.submodules.router = MaskedTopKRouter
    mlp.module, mlp.params = DispatchedMoELayer, {**mlp.params, "dispatcher": dispatcher}
    spec.submodules.mlp = mlp
    return spec


def moe_layers(module: torch.nn.Module):
    """(layer, MoELayer) of every MoE layer under ``module``, in module order (a MoE layer's ``layer_number`` is its
    decoder layer + 1: ``MoETextLayer`` sets it through megatron-core's ``set_layer_number``)."""

    for m in module.modules():
        if isinstance(m, MoELayer):
            yield m.layer_number - 1, m


@dataclass
class ExpertLoad:
    """Tokens routed to each expert per decoder layer, summed over the micro-batches since ``reset`` (this rank's
    tokens; padding excluded when the router gets the padding mask)."""

    counts: dict = dataclasses.field(default_factory=dict)  # decoder layer -> float64 [E] (host)
    handles: list = dataclasses.field(default_factory=list)

    def attach(self, modules) -> "ExpertLoad":
        """Record the routers of the MoE layers under each of ``modules`` (forward hooks; ``detach`` removes them)."""
        for module in modules:
            for layer, moe in moe_layers(module):
                self.handles.append(moe.router.register_forward_hook(self._hook(layer)))
        return self

    def _hook(self, layer: int):
        def record(router, inputs, output):
            if not torch.is_grad_enabled():  # recomputed or evaluation forwards: not counted
                return None
            _, routing_map = output
            padding, _ = split_token_mask(inputs[1] if len(inputs) > 1 else None)
            routed = routing_map.bool()
            if padding is not None:
                routed = routed & ~padding.reshape(-1, 1).bool()
            n = routed.sum(dim=0).detach().to("cpu", torch.float64)
            self.counts[layer] = self.counts[layer] + n if layer in self.counts else n
            return None

        return record

    def reset(self) -> None:
        self.counts = {}

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def load_metrics(counts: dict[int, torch.Tensor], ep: int) -> dict:
    """The log's expert-load metrics from tokens per expert per layer (all ranks' tokens): ``expert load imbalance``,
    over the MoE layers the largest max/mean tokens per expert; ``ep load imbalance``, the same over EP ranks (each
    holding E / EP consecutive experts); ``ep rank tokens``, per EP rank its tokens summed over the layers."""
    if not counts:
        return {}
    worst = worst_rank = 1.0
    per_rank = torch.zeros(ep, dtype=torch.float64)
    for c in counts.values():
        mean = float(c.mean())
        if mean > 0:
            worst = max(worst, float(c.max()) / mean)
        ranks = c.reshape(ep, -1).sum(dim=1)
        per_rank += ranks
        if float(ranks.mean()) > 0:
            worst_rank = max(worst_rank, float(ranks.max() / ranks.mean()))
    return {"expert load imbalance": worst, "ep load imbalance": worst_rank,
            "ep rank tokens": [int(x) for x in per_rank]}
