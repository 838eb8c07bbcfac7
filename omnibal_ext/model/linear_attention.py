"""Closed-form cost of one Gated DeltaNet (linear-attention) layer over a packed micro-batch: FLOPs by term and the
bytes autograd keeps for its backward, as ``megatron/vlm/layers/gated_delta_net.py`` runs it (torch delta rule).

Sizes: ``t`` tokens in ``n`` segments (samples) of lengths ``L_s``; ``h`` hidden; ``nk``/``nv`` key/value heads of
``dk``/``dv``; conv channels ``cd = 2*nk*dk + nv*dv``; conv kernel ``w``; in_proj width ``p = cd + nv*dv + 2*nv``;
chunk ``c``; ``N = sum_s ceil(L_s / c)`` chunks (each segment padded to whole chunks).

Forward FLOPs (a multiply-add counts 2; whole model, summed over TP ranks)::

    in_proj    2 t h p                       out_proj  2 t nv dv h
    conv       2 cd w (t + (n - 1)(w - 1))   (one depthwise conv over the row, w - 1 zeros before each segment)
    rule_intra N nv (2 c^2 dk + 2 c^2 dk)    (k_beta k^T, q k^T inside each chunk)
    rule_scan  N nv (3 * 2 c dk dv + 2 c^2 dv)  (read of the state twice, its update, the chunk's own attention)
    rule_solve N nv c (c - 1)(dk + dv)       (two unit-triangular solves; not a matmul)
    elementwise  t (nv * 12 + nk * dk * 6 + nv * dv * 8)  (gates, l2 norms, gated norm; approximate)

Per token, with every length a multiple of ``c``: ``2 h p + 2 nv dv h + 2 cd w + nv (4 c dk + 2 c dv + 6 dk dv)``:
linear in tokens, the chunk size trading the intra-chunk ``c`` terms against nothing else (the scan's state terms
do not depend on it).

Activation bytes (one TP rank: heads and channels split by ``tp``; ``b``: the activations' dtype bytes, 4 for
fp32 internals) are the storages autograd saves, counted once each (``megatron.training.memory.ActivationMeter``)::

    in_proj input          t' h b          (t' = t / tp under sequence parallelism, else t)
    conv                   (t + n(w-1)) (8 + cd b) + 8 t + 2 t cd b   (index, padded input, output index,
                                                                       conv output, its silu)
    l2 norms               2 t nk (dk + 1) 4 (+ 2 t nk dk 4 when b < 4: the fp32 copies of q, k)
    gates                  t nv (b + 4 + 4) + 2 nv 4                  (sigmoid(b), softplus in/out, -exp(A_log))
    delta rule             t nv 4                                     (g; it keeps only its inputs: q, k, v, beta
                                                                       counted above; its backward recomputes it)
    gated norm             t nv (dv 4 + 4 + 2 dv b + 2 dv 4)          (fp32 input, 1/rms, normed, weighted,
                                                                       fp32 gate and its silu)
    out_proj input         t nv dv b

The delta rule's internals (per-chunk matrices, states) are recomputed in its backward, as fla's kernel recomputes
its chunk states, so no term grows with the chunk size.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class LinearAttentionShape:
    """One layer's sizes, whole model (transformers' ``linear_*`` config keys)."""

    hidden: int
    key_heads: int
    key_head_dim: int
    value_heads: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        """Query or key width."""
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The causal conv's channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_dim(self) -> int:
        return self.conv_dim + self.value_dim + 2 * self.value_heads

    def in_proj_sections(self, tp: int) -> list[int]:
        """Widths of one TP rank's [q | k | v | z | b | a] in in_proj's output."""
        return [self.key_dim // tp, self.key_dim // tp, self.value_dim // tp, self.value_dim // tp,
                self.value_heads // tp, self.value_heads // tp]

    def check_tp(self, tp: int) -> None:
        """UserError unless the value heads are a multiple of the key heads and TP divides the key heads."""
        if self.value_heads % self.key_heads:
            raise UserError(f"linear_num_value_heads ({self.value_heads}) must be a multiple of "
                            f"linear_num_key_heads ({self.key_heads})")
        if self.key_heads % tp:
            raise UserError(f"tensor parallelism ({tp}) must divide linear_num_key_heads ({self.key_heads}): "
                            f"each TP rank holds whole linear-attention heads")


@dataclass(frozen=True)
class LinearAttentionFlops:
    """Forward FLOPs of one layer over a micro-batch, by term (module docstring)."""

    in_proj: float
    conv: float
    rule_intra: float
    rule_scan: float
    rule_solve: float
    out_proj: float
    elementwise: float

    @property
    def matmul(self) -> float:
        """The matmul and convolution FLOPs (what ``torch.utils.flop_counter`` counts)."""
        return self.in_proj + self.conv + self.rule_intra + self.rule_scan + self.out_proj

    @property
    def total(self) -> float:
        return self.matmul + self.rule_solve + self.elementwise


def _check(lengths, chunk: int) -> None:
    if chunk < 1:
        raise UserError(f"linear attention: the delta rule's chunk must be >= 1, got {chunk}")
    if not lengths or min(lengths) < 1:
        raise UserError(f"linear attention: segment lengths must be positive, got {list(lengths)}")


def linear_attention_flops(shape: LinearAttentionShape, lengths, chunk: int) -> LinearAttentionFlops:
    """Forward FLOPs of one layer over a packed row of segments of ``lengths`` tokens, delta rule by ``chunk``."""
    _check(lengths, chunk)
    t, n = sum(lengths), len(lengths)
    chunks = sum(-(-L // chunk) for L in lengths)
    nk, dk, nv, dv, h, w = (shape.key_heads, shape.key_head_dim, shape.value_heads, shape.value_head_dim,
                            shape.hidden, shape.conv_kernel)
    c = chunk
    return LinearAttentionFlops(
        in_proj=2.0 * t * h * shape.in_proj_dim,
        conv=2.0 * shape.conv_dim * w * (t + (n - 1) * (w - 1)),
        rule_intra=chunks * nv * 4.0 * c * c * dk,
        rule_scan=chunks * nv * (6.0 * c * dk * dv + 2.0 * c * c * dv),
        rule_solve=chunks * nv * float(c * (c - 1) * (dk + dv)),
        out_proj=2.0 * t * nv * dv * h,
        elementwise=float(t * (nv * 12 + nk * dk * 6 + nv * dv * 8)))


def linear_attention_flops_per_token(shape: LinearAttentionShape, chunk: int) -> float:
    """Matmul FLOPs per token of long segments (lengths a multiple of ``chunk``, the conv's gaps neglected)."""
    nv, dk, dv = shape.value_heads, shape.key_head_dim, shape.value_head_dim
    return (2.0 * shape.hidden * (shape.in_proj_dim + nv * dv) + 2.0 * shape.conv_dim * shape.conv_kernel
            + nv * (4.0 * chunk * dk + 2.0 * chunk * dv + 6.0 * dk * dv))


@dataclass(frozen=True)
class LinearAttentionActBytes:
    """Bytes one layer keeps for its backward on one TP rank, by term (module docstring)."""

    in_proj_input: float
    conv: float
    l2_norms: float
    gates: float
    delta_rule: float
    gated_norm: float
    out_proj_input: float

    @property
    def total(self) -> float:
        return (self.in_proj_input + self.conv + self.l2_norms + self.gates + self.delta_rule + self.gated_norm
                + self.out_proj_input)


def linear_attention_act_bytes(shape: LinearAttentionShape, lengths, tp: int = 1, sequence_parallel: bool = False,
                               dtype_bytes: int = 2) -> LinearAttentionActBytes:
    """Saved bytes of one layer over a packed row of ``lengths`` on one of ``tp`` ranks (activations in
    ``dtype_bytes``; lengths sum to a multiple of ``tp`` under sequence parallelism)."""
    _check(lengths, 1)
    shape.check_tp(tp)
    t, n = sum(lengths), len(lengths)
    if sequence_parallel and t % tp:
        raise UserError(f"linear attention: sequence parallelism needs the row's {t} tokens padded to a multiple "
                        f"of TP ({tp})")
    b, f32 = float(dtype_bytes), 4.0
    nk, dk, nv, dv, w = (shape.key_heads // tp, shape.key_head_dim, shape.value_heads // tp, shape.value_head_dim,
                         shape.conv_kernel)
    cd = shape.conv_dim // tp
    padded = t + n * (w - 1)
    fp32_copies = 2 * t * nk * dk * f32 if dtype_bytes < 4 else 0.0
    return LinearAttentionActBytes(
        in_proj_input=(t // tp if sequence_parallel and tp > 1 else t) * shape.hidden * b,
        conv=padded * (8 + cd * b) + 8 * t + 2 * t * cd * b,
        l2_norms=2 * t * nk * (dk + 1) * f32 + fp32_copies,
        gates=t * nv * (b + 2 * f32) + 2 * nv * f32,
        delta_rule=t * nv * f32,
        gated_norm=t * nv * (dv * f32 + f32 + 2 * dv * b + 2 * dv * f32),
        out_proj_input=t * nv * dv * b)
