"""The gated delta rule and the causal depthwise convolution over packed samples (THD), each sample on its own.

The gated DeltaNet linear-attention layers (``megatron/vlm/layers/gated_delta_net.py``) run both over a packed row of ``t`` tokens
cut into segments (``cu_seqlens``): the recurrent state and the convolution's window start at zero in every
segment, so a row packing four samples computes what four rows of one would.

The gated delta rule, per value head, token by token (state ``S`` [k_dim, v_dim], zero at a segment's start)::

    S <- exp(g_t) * S                          # decay (g_t <= 0, log space)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T  # delta-rule write of the correction
    o_t = S^T (scale * q_t)                    # read (scale = k_dim ** -0.5)

``chunked_delta_rule`` computes it in chunks of ``chunk`` tokens. Inside a chunk, with ``G_i`` the cumulative sum
of ``g`` from the chunk's start and ``S0`` the state entering it, the writes ``d_i = beta_i (v_i - S_{i-1}^T k_i)``
solve the unit lower-triangular system::

    d_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) d_j = beta_i v_i - beta_i exp(G_i) k_i^T S0

so ``d = U - W S0`` with ``U = T^-1 (beta v)`` and ``W = T^-1 (beta exp(G) k)`` (``T`` that system's matrix), and::

    o_i   = exp(G_i) q_i^T S0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) d_j
    S_out = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j d_j^T

Every segment is padded to a whole number of chunks (padding: g = beta = k = v = q = 0, which writes nothing), so
no chunk spans two segments. The intra-chunk terms are computed for all chunks at once; the scan over chunks then
runs ``max(chunks per segment)`` steps, step ``j`` advancing the ``j``-th chunk of every segment that has one
(segments sorted by chunk count, so the live states are a prefix). On a GPU with flash-linear-attention (``fla``)
installed, ``delta_rule`` calls its variable-length kernel instead (``cu_seqlens``; ``pick_backend``; compared with the
torch rule sample by sample in scripts/gpu_check.py's ``fla_delta_rule``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # flash-linear-attention: Triton kernels, GPU only
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
except ImportError:  # not installed (CPU machines): the torch rule below
    _fla_chunk_gated_delta_rule = None

Segments = tuple[tuple[int, int], ...]  # (start, end) token offsets of a packed row's segments, on the host

BACKENDS = ("auto", "torch", "fla")


def fla_available() -> bool:
    """Whether flash-linear-attention's gated delta rule imported."""
    return _fla_chunk_gated_delta_rule is not None


def pick_backend(backend: str, on_cuda: bool, fla_imported: bool) -> str:
    """The delta rule's implementation, ``"fla"`` or ``"torch"``: ``auto`` takes fla's varlen kernel for tensors on a
    CUDA device when fla imported, else the torch rule; ``fla`` asks for the kernel (RuntimeError where it did not
    import); ``torch`` the torch rule everywhere."""
    if backend not in BACKENDS:
        raise ValueError(f"delta_rule: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "fla" and not fla_imported:
        raise RuntimeError("delta_rule: backend 'fla' asked for, but flash-linear-attention does not import")
    if backend == "fla" or (backend == "auto" and on_cuda and fla_imported):
        return "fla"
    return "torch"


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (fla's and transformers' convention), in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_conv1d(x: Tensor, weight: Tensor, segments: Segments) -> Tensor:
    """Causal depthwise convolution of each segment on its own (no bias): x [t, d], weight [d, w] -> [t, d].

    Output token ``i`` of a segment is ``sum_j weight[:, w-1-j] * x[i-j]`` over ``j <= i`` (taps before the
    segment's start see zeros, never the previous segment's tokens). Each segment gets ``w - 1`` zero rows in front
    and one valid ``conv1d`` runs over the row.
    """
    t, d = x.shape
    width = weight.shape[-1]
    if width == 1:
        return x * weight[:, 0]
    pad = width - 1
    src, keep = [], []
    for s, (start, end) in enumerate(segments):
        src.append(torch.full((pad,), t, dtype=torch.long))  # index t: the zero row
        src.append(torch.arange(start, end))
        keep.append(torch.arange(start, end) + s * pad)  # the valid output ending at each token
    src_index = torch.cat(src).to(x.device)
    keep_index = torch.cat(keep).to(x.device)
    padded = torch.cat([x, x.new_zeros(1, d)]).index_select(0, src_index)  # [t + n * pad, d]
    out = F.conv1d(padded.t().unsqueeze(0), weight.unsqueeze(1), groups=d)[0]  # [d, t + (n - 1) * pad]
    return out.index_select(1, keep_index).t()


def _chunk_layout(segments: Segments, chunk: int, t: int) -> tuple[Tensor, Tensor, list[int], list[int]]:
    """Where each padded chunk position reads from (index ``t`` = padding), which padded positions hold the tokens,
    each segment's first chunk and chunk count."""
    src, keep, first, count = [], [], [], []
    pos = 0
    for start, end in segments:
        n = -(-(end - start) // chunk)
        first.append(pos // chunk)
        count.append(n)
        src.append(torch.arange(start, end))
        src.append(torch.full((n * chunk - (end - start),), t, dtype=torch.long))
        keep.append(torch.arange(pos, pos + end - start))
        pos += n * chunk
    return torch.cat(src), torch.cat(keep), first, count


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments,
                       chunk: int = 64, scale: float | None = None, final_state: bool = False):
    """The gated delta rule over packed segments, in torch, fp32 (module docstring).

    q, k: [t, h, k_dim]; v: [t, h, v_dim]; g (log decay, <= 0), beta: [t, h] (the same h: key heads repeated to
    the value heads beforehand); segments: (start, end) covering [0, t) in order. Returns o [t, h, v_dim], fp32;
    with ``final_state`` (generation) also each segment's state after its last token, [segments, h, k_dim, v_dim]
    fp32 (a chunk's padding decays nothing and writes nothing, so the state after the last chunk is it).
    """
    if chunk < 1:
        raise ValueError(f"chunked_delta_rule: chunk must be >= 1, got {chunk}")
    t, h, dk = k.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    src, keep, first, count = _chunk_layout(segments, chunk, t)
    src, keep = src.to(q.device), keep.to(q.device)

    def chunks(x: Tensor) -> Tensor:  # [t, h, ...] -> [n_chunks, h, chunk, ...], zero padded
        x = x.float()
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, src)
        x = x.reshape(-1, chunk, *x.shape[1:])
        return x.transpose(1, 2)

    q, k, v = chunks(q) * scale, chunks(k), chunks(v)  # [n, h, c, d]
    g, beta = chunks(g), chunks(beta)  # [n, h, c]
    cum = g.cumsum(-1)  # G
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # exp(G_i - G_j), j<=i
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower part: T - I
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # [n, h, c, c]
    q_decayed = q * cum.exp().unsqueeze(-1)
    last = cum[..., -1:]  # G_last [n, h, 1]
    k_decayed = k * (last - cum).exp().unsqueeze(-1)
    chunk_decay = last.exp().unsqueeze(-1)  # [n, h, 1, 1]

    order = sorted(range(len(segments)), key=lambda s: -count[s])  # longest first: live states form a prefix
    state = q.new_zeros(len(order), h, dk, dv)
    finals = q.new_zeros(len(segments), h, dk, dv) if final_state else None
    outs, out_chunks = [], []
    for step in range(count[order[0]] if order else 0):
        live = sum(1 for s in order if count[s] > step)
        ids = torch.tensor([first[s] + step for s in order[:live]], device=q.device)
        state = state[:live]
        d = u[ids] - w[ids] @ state
        outs.append(q_decayed[ids] @ state + attn[ids] @ d)
        out_chunks.append(ids)
        state = state * chunk_decay[ids] + k_decayed[ids].transpose(-1, -2) @ d
        if finals is not None:  # the segments whose last chunk this was
            for i, s in enumerate(order[:live]):
                if count[s] == step + 1:
                    finals[s] = state[i]
    out = torch.cat(outs)  # [n, h, c, dv] in scan order
    out = out[torch.argsort(torch.cat(out_chunks))]  # chunk order
    out = out.transpose(1, 2).reshape(-1, h, dv)  # [n * c, h, dv]
    out = out.index_select(0, keep)
    return (out, finals) if final_state else out


class _RecomputedDeltaRule(torch.autograd.Function):
    """``chunked_delta_rule`` keeping only its inputs for the backward, which runs it again (as fla's kernel
    recomputes its chunk states): its per-chunk matrices and states are never held between forward and backward.
    q, k come per key head and are repeated to the value heads inside."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, segments, chunk, ratio):
        ctx.segments, ctx.chunk, ctx.ratio = segments, chunk, ratio
        ctx.save_for_backward(q, k, v, g, beta)
        with torch.no_grad():
            return _repeated_rule(q, k, v, g, beta, segments, chunk, ratio)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = _repeated_rule(*inputs, ctx.segments, ctx.chunk, ctx.ratio)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None)


def _repeated_rule(q, k, v, g, beta, segments, chunk, ratio, final_state=False):
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return chunked_delta_rule(q, k, v, g, beta, segments, chunk, final_state=final_state)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments,
               cu_seqlens: Tensor | None, chunk: int = 64, backend: str = "auto", final_state: bool = False):
    """The gated delta rule over packed segments: fla's varlen kernel on a GPU where it imports (``auto``, ``fla``),
    else ``chunked_delta_rule`` (its internals recomputed in the backward: ``_RecomputedDeltaRule``).

    q, k: [t, key heads, k_dim] (each key head serving value heads / key heads consecutive value heads); v: [t, h,
    v_dim]; g, beta: [t, h]; cu_seqlens: the segments' bounds (any device) or None. Returns [t, h, v_dim], fp32;
    with ``final_state`` (generation's prefill, no gradient) also each segment's final state [segments, h, k_dim,
    v_dim] fp32."""
    ratio = v.shape[1] // k.shape[1]
    if pick_backend(backend, q.is_cuda, fla_available()) == "torch":
        if final_state:
            return _repeated_rule(q, k, v, g, beta, segments, chunk, ratio, final_state=True)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
            return _RecomputedDeltaRule.apply(q, k, v, g, beta, segments, chunk, ratio)
        return _repeated_rule(q, k, v, g, beta, segments, chunk, ratio)
    if cu_seqlens is None:
        bounds = [0] + [end for _, end in segments]
        cu_seqlens = torch.tensor(bounds, dtype=torch.long)
    # fla's chunk size is its own (64); checked against the torch rule sample by sample on a GPU by
    # scripts/gpu_check.py (fla_delta_rule), the glue on the CPU with a stand-in kernel (tests/test_fla_dispatch.py)
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    dtype = v.dtype  # fla wants q, k, v, beta in one dtype (g in fp32)
    o, state = _fla_chunk_gated_delta_rule(
        q=q.to(dtype).unsqueeze(0), k=k.to(dtype).unsqueeze(0), v=v.unsqueeze(0), g=g.float().unsqueeze(0),
        beta=beta.to(dtype).unsqueeze(0),
        scale=q.shape[-1] ** -0.5, initial_state=None, output_final_state=final_state,
        cu_seqlens=cu_seqlens.to(q.device, torch.long), use_qk_l2norm_in_kernel=False)
    return (o[0], state.float()) if final_state else o[0]
