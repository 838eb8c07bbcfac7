"""Mixture-of-experts LLM layers, planning side: the description a ``LanguageSpec`` holds (``MoESpec``), the
converters of the checkpoints' and Megatron's rules for which layers are MoE, and the expert-parallel grid
(``ExpertGrid``) with megatron-core's constraint.

Which layers are MoE is megatron-core's list form of ``moe_layer_freq``: one entry per decoder layer, 1 = MoE,
0 = dense. Qwen's configs say it as ``decoder_sparse_step`` and ``mlp_only_layers`` (``layer_freq_from_qwen``),
Megatron's integer form N as "every N-th layer from layer 0" (``layer_freq_from_every``).

The expert grid (megatron-core ``parallel_state.initialize_model_parallel``): the decoder's ranks are
TP x CP x DP x PP; the experts' are ETP x EP x expert-DP x PP over the same world, so ETP x EP must divide
TP x CP x DP (expert DP = world / (ETP x EP x PP)), and EP must divide the number of experts (each EP rank holds
E / EP of them, ``MoELayer.num_local_experts``). ETP defaults to TP in megatron-core.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import UserError

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a GPT decoder (None in ``LanguageSpec.moe`` for a dense one).

    num_experts: routed experts per MoE layer (HF ``num_experts``, Megatron ``--num-experts``); topk: experts each
    token is routed to (HF ``num_experts_per_tok``, ``--moe-router-topk``); ffn_hidden_size: one expert's FFN width
    (HF ``moe_intermediate_size``, ``--moe-ffn-hidden-size``); layer_freq: per decoder layer 1 (MoE) or 0 (dense
    MLP of ``LanguageSpec.ffn_hidden_size``), megatron-core's list form of ``moe_layer_freq`` (its length is checked
    against the decoder's layers by ``LanguageSpec``); shared_expert_ffn_hidden_size: the shared expert's FFN width,
    0 = none (``--moe-shared-expert-intermediate-size``); shared_expert_gate: the shared expert's output goes through
    a sigmoid gate (a linear H -> 1); norm_topk_prob: the top-k probabilities are renormalised to sum to
    1 (HF ``norm_topk_prob``); score_function: the router's score ("softmax" | "sigmoid",
    ``--moe-router-score-function``); load_balancing_type: ``--moe-router-load-balancing-type`` (aux_loss |
    seq_aux_loss | global_aux_loss | none); capacity_factor: ``--moe-expert-capacity-factor``, None = no token
    dropping (each expert runs every token routed to it)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    layer_freq: tuple[int, ...]
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    norm_topk_prob: bool = True
    score_function: str = "softmax"
    load_balancing_type: str = "aux_loss"
    capacity_factor: float | None = None

    def __post_init__(self):
        for name in ("num_experts", "topk", "ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise UserError(f"MoESpec.{name} must be a positive integer, got {value!r}")
        if self.topk > self.num_experts:
            raise UserError(f"MoESpec.topk {self.topk} exceeds MoESpec.num_experts {self.num_experts}")
        freq = tuple(self.layer_freq)
        if not freq or any(x not in (0, 1) for x in freq):
            raise UserError(f"MoESpec.layer_freq must be a non-empty list of 0 (dense) and 1 (MoE) per layer, "
                            f"got {list(freq)}")
        object.__setattr__(self, "layer_freq", tuple(int(x) for x in freq))
        if not any(self.layer_freq):
            raise UserError("MoESpec.layer_freq has no MoE layer (all 0): describe a dense decoder with moe=None")
        s = self.shared_expert_ffn_hidden_size
        if isinstance(s, bool) or int(s) != s or s < 0:
            raise UserError(f"MoESpec.shared_expert_ffn_hidden_size must be an integer >= 0 (0: none), got {s!r}")
        if self.shared_expert_gate and not s:
            raise UserError("MoESpec.shared_expert_gate needs a shared expert (shared_expert_ffn_hidden_size > 0)")
        if self.score_function not in SCORE_FUNCTIONS:
            raise UserError(f"MoESpec.score_function must be one of {', '.join(SCORE_FUNCTIONS)}, "
                            f"got {self.score_function!r}")
        if self.load_balancing_type not in LOAD_BALANCING:
            raise UserError(f"MoESpec.load_balancing_type must be one of {', '.join(LOAD_BALANCING)}, "
                            f"got {self.load_balancing_type!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise UserError(f"MoESpec.capacity_factor must be > 0 (None: no token dropping), "
                            f"got {self.capacity_factor!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "MoESpec":
        """From ``dataclasses.asdict`` (a spec's JSON); unknown keys are refused, naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UserError(f"MoESpec: unknown fields {sorted(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**d)

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) is an MoE layer."""
        return bool(self.layer_freq[layer])

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The 0-based indices of the MoE layers."""
        return tuple(i for i, x in enumerate(self.layer_freq) if x)


def first_layers(moe: MoESpec | None, num_layers: int) -> MoESpec | None:
    """``moe`` for the decoder's first ``num_layers`` layers (a model of fewer layers: the trainer's profiler), None
    where they hold no MoE layer (a dense decoder) or ``moe`` is None."""
    if moe is None or not any(moe.layer_freq[:num_layers]):
        return None
    freq = moe.layer_freq[:num_layers] + (moe.layer_freq[-1],) * (num_layers - len(moe.layer_freq))
    return dataclasses.replace(moe, layer_freq=freq)


def layer_freq_from_qwen(num_layers: int, decoder_sparse_step: int, mlp_only_layers=()) -> tuple[int, ...]:
    """megatron-core's list form of Qwen's rule: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is
    not in ``mlp_only_layers`` (HF ``decoder_sparse_step`` / ``mlp_only_layers`` configs)."""
    if int(decoder_sparse_step) != decoder_sparse_step or decoder_sparse_step < 1:
        raise UserError(f"decoder_sparse_step must be a positive integer, got {decoder_sparse_step!r}")
    dense = set(int(i) for i in mlp_only_layers or ())
    bad = sorted(i for i in dense if not 0 <= i < num_layers)
    if bad:
        raise UserError(f"mlp_only_layers {bad} are not layers of the {num_layers}-layer decoder")
    return tuple(int((i + 1) % decoder_sparse_step == 0 and i not in dense) for i in range(num_layers))


def layer_freq_from_every(num_layers: int, every: int) -> tuple[int, ...]:
    """megatron-core's list form of its integer ``moe_layer_freq`` N: layer i is MoE when i % N == 0."""
    if isinstance(every, bool) or int(every) != every or every < 1:
        raise UserError(f"--moe-layer-freq must be a positive integer or a list of 0/1 per layer, got {every!r}")
    return tuple(int(i % every == 0) for i in range(num_layers))


def parse_layer_freq(text: str | int, num_layers: int) -> tuple[int, ...]:
    """``--moe-layer-freq`` in either form: an integer N (``layer_freq_from_every``) or a list of 0/1 per layer
    ("[1,0,1,1]" or "1,0,1,1"); UserError naming the flag otherwise."""
    if isinstance(text, int):
        return layer_freq_from_every(num_layers, text)
    s = str(text).strip()
    if s.lstrip("+").isdigit():
        return layer_freq_from_every(num_layers, int(s))
    items = [x.strip() for x in s.strip("[]()").split(",") if x.strip()]
    if not items or any(x not in ("0", "1") for x in items):
        raise UserError(f"--moe-layer-freq {text!r}: give an integer N (every N-th layer) or a list of 0/1 per layer")
    if len(items) != num_layers:
        raise UserError(f"--moe-layer-freq {text!r} has {len(items)} entries for {num_layers} decoder layers")
    return tuple(int(x) for x in items)


@dataclass(frozen=True)
class ExpertGrid:
    """Expert-parallel sizes: ep (``--expert-model-parallel-size``) and etp (``--expert-tensor-parallel-size``)."""

    ep: int = 1
    etp: int = 1

    def expert_dp(self, tp: int, cp: int, dp: int) -> int:
        """Expert data-parallel size: world / (ETP x EP x PP) = TP x CP x DP / (ETP x EP)."""
        return tp * cp * dp // (self.ep * self.etp)


DENSE_GRID = ExpertGrid()


def expert_grid_problem(moe: MoESpec | None, grid: ExpertGrid, tp: int, cp: int, dp: int) -> str | None:
    """Why ``grid`` cannot run with TP x CP x DP per pipeline stage (megatron-core's rule, module docstring), or
    None."""
    ep, etp = grid.ep, grid.etp
    if ep < 1 or etp < 1:
        return f"EP {ep} and ETP {etp} must be >= 1"
    if moe is None:
        return None if ep == 1 and etp == 1 else f"EP {ep} / ETP {etp} on a dense model (no experts)"
    if moe.num_experts % ep:
        return f"EP {ep} does not divide the {moe.num_experts} experts"
    if (tp * cp * dp) % (ep * etp):
        return (f"ETP {etp} x EP {ep} does not divide TP {tp} x CP {cp} x DP {dp} = {tp * cp * dp} ranks per "
                f"pipeline stage (expert DP = world / (ETP x EP x PP))")
    if moe.ffn_hidden_size % etp:  # the shared expert is split over TP, as dense MLPs are
        return f"ETP {etp} does not divide the expert FFN width {moe.ffn_hidden_size}"
    return None


def expert_grids(moe: MoESpec | None, tp: int, cp: int, dp: int, ep: int | None = None,
                 etp: int | None = None) -> tuple[list[ExpertGrid], list[str]]:
    """The expert grids to try at TP x CP x DP: EP over the divisors of the experts (or ``ep``), ETP in {1, TP}
    (or ``etp``); a dense model has only ``DENSE_GRID``. Returns (grids, reasons for the ones refused)."""
    if moe is None:
        return [DENSE_GRID], []
    eps = [ep] if ep is not None else [e for e in range(1, moe.num_experts + 1) if moe.num_experts % e == 0]
    etps = [etp] if etp is not None else sorted({1, tp})
    out, why = [], []
    for e in eps:
        for t in etps:
            g = ExpertGrid(e, t)
            problem = expert_grid_problem(moe, g, tp, cp, dp)
            if problem is None:
                out.append(g)
            elif ep is not None or etp is not None or e <= tp * cp * dp:
                why.append(problem)
    return out, why
