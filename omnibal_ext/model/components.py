"""The planning side of a unit kind: what one unit costs for one micro-batch, on one TP rank.

Each kind of unit (``omnibal_ext.model.unit_kind.UnitKind``) names one ``CostComponent`` class; the cost
model, memory model, partition search and simulator read units only through them. The GPT decoder's
components (LLM embedding, layer, head) are shared here, since every family's LLM is one; the ViT's and
the projector's belong to their family.

FLOPs count one multiply-add as 2 and are summed over the TP ranks; bytes are per TP rank. Activation
bytes follow ``layer_act_bytes_per_token`` (see ``cost_model``'s docstring for the derivation).

Sequence parallelism (``sequence_parallel``, the trainer's ``--sequence-parallel``, TP > 1): the layers' part
replicated over TP (norm inputs, the linears' inputs, which megatron-core's sequence-parallel linears save
split and all-gather again in the backward) is split by TP too; the tokens a layer runs are padded to a
multiple of TP (LLM rows; each ViT tile); each TP all-reduce of a layer becomes an all-gather plus a
reduce-scatter, the same bytes on the wire (``tp_allreduce_bytes`` counts all-reduce-equivalent bytes, an
all-gather or a reduce-scatter as half); the head all-gathers its input and the embedding's output is
scattered (its backward all-gathers).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .shape import MicroBatchShape
from .spec import LanguageSpec, ModelSpec


@dataclass(frozen=True)
class ActBytes:
    """Activation bytes one unit keeps per micro-batch on one TP rank, by recompute mode, and what it sends."""

    act: float  # no recompute
    full: float  # full recompute (its input only)
    selective: float  # core attention recomputed
    send: float  # its output, sent when a stage boundary follows it


@dataclass(frozen=True)
class LayerKernels:
    """What the device's kernels keep for backward where devices differ: an explicit input of the memory model
    (``DeviceSpec.kernels``, which ``analytic_costs`` passes on).

    rms_norm: "fused" (one kernel, as torch runs RMSNorm on CUDA: the input and an fp32 1/rms per token, as
    measured on the H200) or "composite" (torch's RMSNorm on a CPU, built from elementwise ops: it also keeps
    the normalised ``x/rms``, ``h*D`` per token, for the weight's gradient). LayerNorm is one kernel on both
    (input, fp32 mean and 1/std per token).
    """

    rms_norm: str = "fused"

    def __post_init__(self):
        if self.rms_norm not in ("fused", "composite"):
            raise UserError(f"LayerKernels.rms_norm must be 'fused' or 'composite', got {self.rms_norm!r}")


FUSED_KERNELS = LayerKernels()


def norm_bytes_per_token(hidden: int, dtype_bytes: int, norm: str, kernels: LayerKernels) -> float:
    """Bytes one norm keeps per token beyond its input: fp32 statistics (LayerNorm: mean and 1/std; RMSNorm:
    1/rms) and, for a composite RMSNorm, the normalised tensor."""
    if norm == "LayerNorm":
        return 2 * 4.0
    if norm != "RMSNorm":
        raise UserError(f"norm must be LayerNorm or RMSNorm, got {norm!r}")
    return 4.0 + (hidden * dtype_bytes if kernels.rms_norm == "composite" else 0)


class CostComponent:
    """What one unit of a kind costs, bound to its ``ModelSpec`` and to its ``UnitKind`` (``UnitKind.cost_of``).

    efficiency: the fraction of the device's peak matmul rate it reaches in the analytic model; memory_bound: timed by
    ``mem_bytes`` over the memory bandwidth (it has no FLOPs). Its ``kind`` (name) and ``code`` (role, the layout
    letter) are its ``UnitKind``'s.
    """

    efficiency: float = 0.5
    memory_bound: bool = False

    def __init__(self, spec: ModelSpec, unit_kind: "UnitKind"):  # noqa: F821 (unit_kind imports this module)
        self.spec = spec
        self.unit_kind = unit_kind

    @property
    def kind(self) -> str:
        """The kind's name (a profile's and a report's ``kind``)."""
        return self.unit_kind.name

    @property
    def code(self) -> str:
        """The kind's role (the layout letter)."""
        return self.unit_kind.role

    def flops(self, shape: MicroBatchShape, tp: int) -> tuple[float, float]:
        """(total, attention-core) forward FLOPs over the micro-batch, all TP ranks."""
        raise NotImplementedError

    def mem_bytes(self, shape: MicroBatchShape) -> float:
        """Bytes the forward moves when it is memory-bound (``memory_bound``), per TP rank."""
        return 0.0

    def params(self, tp: int) -> int:
        """Parameters of one unit, whole model (at ``tp``: padded heads included)."""
        raise NotImplementedError

    def params_of_role(self, role: str, tp: int = 1) -> tuple[int, int]:
        """(all, replicated over TP) parameters of the unit that play ``role`` (a layout letter) for freezing: all
        of them for the unit's own role; a unit may hold parts of another (DeepStack mergers, the
        projector's, in ViT layer units). Replicated ones are counted 0 where a kind never splits them apart."""
        return (self.params(tp), 0) if role == self.code else (0, 0)

    def act_bytes(self, shape: MicroBatchShape, tp: int, dropout: bool, attention: str,
                  sequence_parallel: bool = False, kernels: LayerKernels = FUSED_KERNELS) -> ActBytes:
        """Activation bytes at ``shape`` on one TP rank; ``kernels``: what the device's kernels keep."""
        raise NotImplementedError

    def linears(self, tp: int) -> dict[str, tuple[int, int]]:
        """A layer kind's linears LoRA can adapt (``omnibal_ext.model.lora.LINEARS``: qkv, proj, fc1, fc2) as
        (in, out) features, whole model (at ``tp``: padded heads included); {} for other kinds."""
        return {}

    def tp_allreduce_bytes(self, shape: MicroBatchShape, sequence_parallel: bool = False,
                           tp: int = 1) -> tuple[float, float]:
        """(forward, backward) bytes the unit all-reduces over its TP group (of ``tp`` ranks) per micro-batch
        (with sequence parallelism: all-reduce-equivalent bytes, an all-gather or reduce-scatter counting half)."""
        return 0.0, 0.0

    def decode_cache(self, batch: int, context: float, tp: int, dtype_bytes: int) -> tuple[float, float]:
        """(FLOPs over all TP ranks, bytes per TP rank) one generation decode step of ``batch`` sequences spends on the
        unit's cache of ``context`` tokens per sequence (``omnibal_ext.model.decode_cost``); 0 for units without one."""
        return 0.0, 0.0

    # Expert parallelism (``omnibal_ext.model.moe_cost``): only MoE layers override these.
    def with_experts(self, run) -> "CostComponent":
        """This component under the expert run ``run`` (``moe_cost.ExpertRun``: EP / ETP sizes and the expert
        load); a unit without experts is the same under every run."""
        return self

    def rank_work(self, shape: MicroBatchShape, tp: int) -> float:
        """The forward work its time is proportional to on the busiest rank: FLOPs per TP rank (an MoE layer: its
        experts' FLOPs times the expert load imbalance), or memory bytes for a memory-bound kind."""
        return self.mem_bytes(shape) if self.memory_bound else self.flops(shape, tp)[0] / tp

    def ep_alltoall_bytes(self, shape: MicroBatchShape, tp: int, sequence_parallel: bool = False) -> tuple[float, float]:
        """(forward, backward) bytes one rank sends in its expert-parallel all-to-alls per micro-batch."""
        return 0.0, 0.0

    def expert_weight_bytes(self, dtype_bytes: int) -> tuple[float, float]:
        """(forward, backward) bytes of the routed experts' weights (and their gradients) one rank moves per
        micro-batch: small expert GEMMs are bound by them, not by their FLOPs (0 for units without experts)."""
        return 0.0, 0.0

    def expert_params(self) -> int:
        """Of ``params``, the routed experts' parameters (split over EP x ETP, not TP), whole model."""
        return 0


def sp_tokens(tokens: int, tp: int, sequence_parallel: bool) -> int:
    """Tokens a sequence-parallel run pads ``tokens`` to (a multiple of ``tp``); ``tokens`` without it."""
    return -(-tokens // tp) * tp if sequence_parallel and tp > 1 else tokens


def layer_act_bytes_per_token(
    hidden: int, heads: int, kv_groups: int, ffn: int, swiglu: bool, attended: float,
    dtype_bytes: int, tp: int, dropout: bool, attention: str, *, norm: str, rotary: bool = False,
    per_sample: bool = False, built_heads: int | None = None, head_dim: int | None = None,
    sequence_parallel: bool = False, kernels: LayerKernels = FUSED_KERNELS, kv_gathered: bool = False,
    qk_norm: bool = False, rotary_dim: int | None = None,
) -> tuple[float, float]:
    """(all, attention-core) activation bytes per token of one pre-norm layer (see cost_model's docstring).

    attended: attended length per token (tokens), so the core keeps ``heads*attended`` scores per token.
    norm: "LayerNorm" or "RMSNorm" (with ``kernels``: what the norms keep); rotary: the layer applies rotary
    embeddings; per_sample: attention runs once per packed sample; built_heads: heads the layer is built with
    (padded for TP; default ``heads``); head_dim: per-head width (default hidden / heads); sequence_parallel:
    the norm inputs, linear inputs, norm statistics and dropout masks (replicated without it) are split by TP;
    the rotary tables stay whole; kv_gathered: context parallelism, the attention gets keys and values
    all-gathered over the CP group (the caller counts them): the local fused QKV output and rotated keys are
    not kept; qk_norm: an RMSNorm over each head of the query and of the key (Qwen3); rotary_dim: the channels
    of each head RoPE rotates (default ``head_dim``; fewer under partial rotary).

    Beyond the textbook count, what this trainer's megatron-core local layers keep (saved tensors counted
    tensor by tensor on a CPU, within 0.1% at TP 2 with and without sequence parallelism:
    tests/test_sequence_parallel.py; on an H200: ``profiles/h200``, tests/test_cost_model.py):
    * each norm's fp32 statistics, and a composite RMSNorm's normalised tensor (``norm_bytes_per_token``);
    * attention "flash" (``SegmentAttention``: SDPA with grouped keys and values, ``enable_gqa``): the value
      is a view of the fused QKV output, so all of it stays, ``(h + 2*g*d)*D/t``; with rotary embeddings
      the rotated query and key are new tensors, ``(h + g*d)*D/t`` more;
    * attention "unfused" (megatron-core's ``DotProductAttention``): Q plus K, V repeated to every query head,
      ``(h + 2*h)*D/t``;
    * a gated MLP through megatron-core's unfused GLU (no bias, so no bias-activation fusion) also
      keeps ``act(x_glu)`` and ``x_linear + offset``: ``5*f*D/t``, not ``3*f*D/t``;
    * rotary embeddings keep cos and sin for q and for k: ``4*r*D`` (``r`` the rotated channels), replicated;
    * per-head q/k norms (``qk_norm``) keep the query copied out of the fused QKV output (its reshape of a
      split), ``h*D/t``, while the key's input is a view of that output; and per head of each, what an RMSNorm
      of ``d`` keeps (``norm_bytes_per_token``: fp32 ``1/rms`` and a composite norm's normalised tensor),
      ``(heads + g) * norm(d) / t``;
    * attention run per packed sample keeps each sample's output beside the concatenated
      out-projection input: ``h*D/t`` more. Counted whenever attention runs per sample: a row of one segment
      (no padding, no CP) keeps its one output as the out-projection input, ``h*D/t`` less (measured), but a
      shape that does not say its samples (``llm_attn_tokens_sq`` None, the memory caps) stands for rows of
      several. The per-sample outputs are part of the returned core: selective recompute re-runs the attention
      and keeps only its concatenated output (the out-projection input).
    """
    d_bytes, p = dtype_bytes, (1 if dropout else 0)
    head_dim = head_dim or hidden // heads
    groups = kv_groups if kv_groups < heads else (built_heads or heads)  # MHA: every built head has its K, V
    heads = built_heads or heads
    width = heads * head_dim  # attention width: hidden, unless heads are padded
    replicated = 4 * hidden * d_bytes + 2 * hidden * p + 2 * norm_bytes_per_token(hidden, d_bytes, norm, kernels)
    if sequence_parallel:
        replicated /= tp
    replicated += 4 * (rotary_dim or head_dim) * d_bytes if rotary else 0
    if attention == "unfused":
        qkv = 3 * width
    elif kv_gathered:
        qkv = width if rotary else 0  # the rotated query; the keys and values come all-gathered
    else:
        qkv = width + 2 * groups * head_dim + ((width + groups * head_dim) if rotary else 0)
    split = qkv * d_bytes + width * d_bytes
    split += (5 if swiglu else 2) * ffn * d_bytes
    if attention == "unfused":
        core = heads * attended * (d_bytes + p + p * d_bytes)
    elif attention == "flash":
        core = heads * 4.0  # fp32 log-sum-exp per head; the output is counted as the out-proj input
    else:
        raise UserError(f"attention must be 'unfused' or 'flash', got {attention!r}")
    if qk_norm:
        split += width * d_bytes + (heads + groups) * norm_bytes_per_token(head_dim, d_bytes, norm, kernels)
    if per_sample:
        core += width * d_bytes  # each sample's output, beside their concatenation
    return replicated + (split + core) / tp, core / tp


def llm_layer_flops(spec: ModelSpec, shape: MicroBatchShape) -> tuple[float, float]:
    """(total, attention-core) forward FLOPs of one LLM layer over the micro-batch."""
    lm = spec.language
    t, h, f = shape.rank_llm_tokens, lm.hidden_size, lm.ffn_hidden_size
    d = lm.kv_channels
    width = lm.num_attention_heads * d  # attention width: h, unless head_dim says otherwise
    qkv = 2.0 * t * h * (width + 2 * lm.kv_groups * d)
    out = 2.0 * t * width * h
    mlp = (6.0 if lm.swiglu else 4.0) * t * h * f
    core = 4.0 * width * 0.5 * shape.rank_attn_tokens_sq  # causal: half of the score matrix
    return qkv + out + mlp + core, core


class TextEmbedCost(CostComponent):
    """Vocabulary-parallel token embedding: a gather, timed as ``2*T*h*D`` bytes of memory traffic."""

    memory_bound = True

    def flops(self, shape, tp):
        return 0.0, 0.0

    def mem_bytes(self, shape):
        return 2.0 * shape.rank_llm_tokens * self.spec.language.hidden_size * shape.dtype_bytes

    def params(self, tp):
        return self.spec.language.vocab_size * self.spec.language.hidden_size

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # int64 token ids, the bool mask of the image-context slots (and, split over TP, of the ids outside this
        # rank's vocabulary rows), and the int64 index of the tiles
        T = sp_tokens(shape.rank_llm_tokens, tp, sequence_parallel)
        ids = T * (9.0 + (1.0 if tp > 1 else 0.0)) + shape.rank_vision_items * 8.0
        return ActBytes(ids, ids, ids, shape.rank_llm_tokens * self.spec.language.hidden_size * shape.dtype_bytes)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        out = shape.rank_llm_tokens * self.spec.language.hidden_size * shape.dtype_bytes
        return out, out / 2 if sequence_parallel else 0.0  # the scatter's backward all-gathers


def rotary_table_bytes(lm: LanguageSpec, shape, tokens: float) -> float:
    """The fp32 rotary angles an LLM layer gets as an input (what full recompute keeps besides the hidden states),
    ``rotary_dim`` wide: multimodal RoPE (``mrope_section``) one row per token (``tokens``: the rank's, padding
    included; angles of each token's 3-D position); 1-D RoPE one row per position of the longest sample, for which
    the token-weighted mean length ``sum(len^2) / T`` stands (the shape holds ``sum(len^2)`` only; exact for
    samples of one length)."""
    if lm.mrope_section is not None:
        rows = tokens
    else:
        rows = min(tokens, shape.attn_tokens_sq / shape.llm_tokens if shape.llm_tokens else 0.0)
    return rows * lm.rotary_dim * 4.0


class TextLayerCost(CostComponent):
    """One GPT decoder layer over the packed micro-batch (causal attention within each sample)."""

    def flops(self, shape, tp):
        return llm_layer_flops(self.spec, shape)

    def params(self, tp):
        lm = self.spec.language
        h, f, d = lm.hidden_size, lm.ffn_hidden_size, lm.kv_channels
        qkv_rows = lm.num_attention_heads * d + 2 * lm.kv_groups * d
        n = h * qkv_rows + lm.num_attention_heads * d * h + (3 if lm.swiglu else 2) * h * f + 2 * h
        return n + (qkv_rows if lm.qkv_bias else 0) + (2 * d if lm.qk_norm else 0)  # per-head q/k norm weights

    def linears(self, tp):
        lm = self.spec.language
        h, f, width = lm.hidden_size, lm.ffn_hidden_size, lm.num_attention_heads * lm.kv_channels
        return {"qkv": (h, width + 2 * lm.kv_groups * lm.kv_channels), "proj": (width, h),
                "fc1": (h, (2 if lm.swiglu else 1) * f), "fc2": (f, h)}

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        lm, D = self.spec.language, shape.dtype_bytes
        T = sp_tokens(shape.rank_llm_tokens, tp, sequence_parallel)  # the padding is a segment of its own
        attended = (shape.rank_attn_tokens_sq + (T - shape.rank_llm_tokens) ** 2) / T if T else 0.0
        per_tok, core = layer_act_bytes_per_token(
            lm.hidden_size, lm.num_attention_heads, lm.kv_groups, lm.ffn_hidden_size, lm.swiglu,
            attended, D, tp, dropout, attention, norm=lm.normalization, rotary=True, per_sample=attention == "flash",
            head_dim=lm.kv_channels, sequence_parallel=sequence_parallel, kernels=kernels,
            kv_gathered=shape.cp > 1 and attention == "flash", qk_norm=lm.qk_norm, rotary_dim=lm.rotary_dim)
        gathered = self.cp_attention_bytes(shape, tp) if attention == "flash" else 0.0
        split = tp if sequence_parallel else 1
        full = T * lm.hidden_size * D / split + rotary_table_bytes(lm, shape, T)
        return ActBytes(T * per_tok + gathered, full, T * (per_tok - core) + gathered, T * lm.hidden_size * D / split)

    def cp_attention_bytes(self, shape, tp: int) -> float:
        """What the context-parallel attention (``SegmentAttention``) keeps beyond a rank's own tokens, per TP rank:
        the keys and values of all the micro-batch's tokens, all-gathered over the CP group (grouped, not repeated
        to every head), and the masks of the chunks that attend to keys of later chunks. Every sample of padded
        length L is cut into 2 CP chunks of c = L / (2 CP); the busiest rank's two chunks attend to 2 CP + 1 chunks
        of keys (rank 0's first attends causally, without a mask), and SDPA keeps each boolean mask as a mask of
        the query's dtype, c x (chunks before it + 1) c: ``(2 CP + 1) / (4 CP^2) * sum(L^2) * D``. 0 without CP."""
        if shape.cp == 1:
            return 0.0
        lm, D, cp = self.spec.language, shape.dtype_bytes, shape.cp
        kv = shape.llm_tokens * 2.0 * lm.kv_groups * lm.kv_channels * D / tp
        return kv + (2 * cp + 1) / (4 * cp * cp) * shape.attn_tokens_sq * D

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        llm = shape.rank_llm_tokens * self.spec.language.hidden_size * shape.dtype_bytes
        return 2 * llm, 2 * llm  # with sequence parallelism 2 all-gathers + 2 reduce-scatters: the same bytes

    def decode_cache(self, batch, context, tp, dtype_bytes):
        """Each new token's query attends to ``context`` cached keys and values (``4 * width * context`` FLOPs),
        which are read: ``2 * groups * head dim * context`` elements per sequence, split over TP."""
        lm = self.spec.language
        width = lm.num_attention_heads * lm.kv_channels
        return (4.0 * width * context * batch,
                batch * context * 2.0 * lm.kv_groups * lm.kv_channels * dtype_bytes / tp)


class HeadCost(CostComponent):
    """Final norm, vocabulary-parallel output layer and cross entropy."""

    def flops(self, shape, tp):
        lm = self.spec.language
        return 2.0 * shape.rank_llm_tokens * lm.hidden_size * lm.vocab_size, 0.0

    def params(self, tp):
        lm = self.spec.language
        return lm.vocab_size * lm.hidden_size + lm.hidden_size

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # final-norm input and what the norm keeps (norm_bytes_per_token), output-layer input (split by TP under
        # sequence parallelism: the output layer saves its input before the all-gather), and of the vocab-parallel
        # loss the fp32 softmax, the target's local index (int64) and its mask (bool)
        lm, D = self.spec.language, shape.dtype_bytes
        T = sp_tokens(shape.rank_llm_tokens, tp, sequence_parallel)
        split = tp if sequence_parallel else 1
        hidden = T * lm.hidden_size * D / split
        norm = T * norm_bytes_per_token(lm.hidden_size, D, lm.normalization, kernels) / split
        act = 2 * hidden + norm + T * ((lm.vocab_size / tp) * 4.0 + 9.0)
        return ActBytes(act, hidden, act, 0.0)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        # its loss reductions are a few floats per token; the input's gradient in the backward (sequence
        # parallel: the input's all-gather forward, a reduce-scatter backward, each half an all-reduce)
        hidden = shape.rank_llm_tokens * self.spec.language.hidden_size * shape.dtype_bytes
        if sequence_parallel:
            return 3 * shape.rank_llm_tokens * 4.0 + hidden / 2, hidden / 2
        return 3 * shape.rank_llm_tokens * 4.0, hidden
