"""Multimodal RoPE frequencies (chunked sections, or interleaved sections).

Each of a head's ``d / 2`` rotary frequencies is rotated by one of the three position ids of a token
(temporal, height, width). Which one is the frequency's *axis*:

* chunked: the first ``section[0]`` frequencies take T, the next ``section[1]`` H, the last
  ``section[2]`` W (megatron-core's ``MultimodalRotaryEmbedding`` builds this form only);
* interleaved (``mrope_interleaved``): frequency j takes H when ``j % 3 == 1`` and
  ``j < 3 * section[1]``, W when ``j % 3 == 2`` and ``j < 3 * section[2]``, else T (``section[0]`` is unused).

The angles come out as megatron-core's rotary tables do: ``[s, b, 1, d]``, the ``d / 2`` angles twice (the
non-interleaved, rotate-half pairing ``apply_rotary_pos_emb`` takes), fp32.
"""
from __future__ import annotations

import torch

T_AXIS, H_AXIS, W_AXIS = 0, 1, 2


def mrope_axes(section: tuple[int, ...], interleaved: bool, n_freqs: int | None = None) -> torch.Tensor:
    """The position-id axis (0 = T, 1 = H, 2 = W) of each rotary frequency, int64 [n_freqs] (default
    ``sum(section)``)."""
    n = sum(section) if n_freqs is None else n_freqs
    if not interleaved:
        if sum(section) != n:
            raise ValueError(f"chunked mrope_section {list(section)} must sum to {n} frequencies")
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))
    j = torch.arange(n)
    axes = torch.full((n,), T_AXIS, dtype=torch.int64)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = H_AXIS
    axes[(j % 3 == 2) & (j < 3 * section[2])] = W_AXIS
    return axes


def inverse_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """fp32 [head_dim / 2]: ``base ** -(2i / head_dim)``, as transformers' and megatron-core's default RoPE."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def mrope_angles(inv_freq: torch.Tensor, position_ids: torch.Tensor, section: tuple[int, ...],
                 interleaved: bool) -> torch.Tensor:
    """Rotary angles [s, b, 1, d] of ``position_ids [3, b, s]`` (T, H, W), frequency j at its axis's id."""
    axes = mrope_axes(tuple(section), interleaved, inv_freq.numel()).to(position_ids.device)
    ids = position_ids.to(inv_freq.device, torch.float32)  # [3, b, s]
    chosen = ids.index_select(0, axes.to(ids.device))  # [d/2, b, s]: each frequency's own position ids
    angles = chosen.permute(2, 1, 0) * inv_freq  # [s, b, d/2]
    return torch.cat((angles, angles), dim=-1).unsqueeze(2).contiguous()


class MultimodalRope(torch.nn.Module):
    """The LLM layers' multimodal rotary table: ``forward(position_ids [3, b, s]) -> [s, b, 1, d]`` angles.

    No parameters or buffers (the fp32 inverse frequencies stay fp32 whatever the stage's dtype: a plain
    attribute, moved to the ids' device on use)."""

    def __init__(self, head_dim: int, base: float, section: tuple[int, ...], interleaved: bool):
        super().__init__()
        if 2 * sum(section) != head_dim:
            raise ValueError(f"mrope_section {list(section)} must sum to head_dim / 2 = {head_dim // 2}")
        self.inv_freq = inverse_frequencies(head_dim, base)
        self.section, self.interleaved = tuple(section), interleaved

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        self.inv_freq = self.inv_freq.to(position_ids.device)
        return mrope_angles(self.inv_freq, position_ids, self.section, self.interleaved)
