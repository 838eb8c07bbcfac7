"""What one micro-batch holds, as the cost model sees it."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class MicroBatchShape:
    """What one micro-batch holds.

    vision_items: the ViT's work in the unit its family counts it in (fixed-size tiles: 448 px tiles, each
        running ``spec.vision.seq_per_tile`` tokens); the family's components turn it into tokens.
    llm_tokens: LLM sequence tokens, image tokens included.
    dtype_bytes: bytes per activation element (2 for bf16/fp16).
    llm_attn_tokens_sq: sum of squared lengths of the packed samples (tokens^2); None = one
        sequence of ``llm_tokens``.
    vision_attn_tokens_sq, vision_window_tokens_sq: for ViTs whose attention segments vary in length
        (native resolution: one segment per image for full-attention layers, one per window for windowed ones),
        the sums of squared segment lengths in ViT tokens (tokens^2) of the two kinds of segments; None: the
        family's default for ``vision_items`` (families with fixed-size items, tiles, ignore them).
    cp: context-parallel ranks the micro-batch is split over (the trainer's --context-parallel-size): each
        rank runs ``rank_llm_tokens`` LLM tokens (every sample cut into 2 x CP chunks, balanced for causal
        attention, so ``rank_attn_tokens_sq`` of the attention work), all-gathers the keys and values of all
        ``llm_tokens``, and runs ``rank_vision_items`` of the ViT's items (whole tiles, as even as they allow; whole
        images of varying size: ``rank_vision_sq`` of their attention squares too, an approximation).
        The components' FLOPs and bytes are those of one (the busiest) CP rank.
    """

    vision_items: int
    llm_tokens: int
    dtype_bytes: int = 2
    llm_attn_tokens_sq: float | None = None
    vision_attn_tokens_sq: float | None = None
    vision_window_tokens_sq: float | None = None
    cp: int = 1

    def __post_init__(self):
        if self.cp < 1:
            raise UserError(f"MicroBatchShape: cp must be >= 1, got {self.cp}")
        if self.vision_items < 0 or self.llm_tokens < 0 or self.dtype_bytes <= 0:
            raise UserError(f"MicroBatchShape: vision_items and llm_tokens must be >= 0 and dtype_bytes > 0, got {self}")
        if self.llm_attn_tokens_sq is not None and not (
            0 <= self.llm_attn_tokens_sq <= float(self.llm_tokens) ** 2 + 1e-6
        ):
            raise UserError(
                f"MicroBatchShape: llm_attn_tokens_sq={self.llm_attn_tokens_sq} must lie in [0, llm_tokens^2]"
            )
        for name in ("vision_attn_tokens_sq", "vision_window_tokens_sq"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"MicroBatchShape: {name}={value} must be >= 0")

    @property
    def attn_tokens_sq(self) -> float:
        """sum(len_i^2) over the packed LLM samples, tokens^2."""
        if self.llm_attn_tokens_sq is None:
            return float(self.llm_tokens) ** 2
        return float(self.llm_attn_tokens_sq)

    @property
    def rank_llm_tokens(self) -> int:
        """LLM tokens one CP rank runs: T / CP (rounded up)."""
        return -(-self.llm_tokens // self.cp)

    @property
    def rank_attn_tokens_sq(self) -> float:
        """One CP rank's share of ``attn_tokens_sq``: the 2 x CP chunk split gives every rank the same
        attended pairs of every sample (chunks r and 2 CP - 1 - r attend to 2 CP + 1 chunks together)."""
        return self.attn_tokens_sq / self.cp

    @property
    def rank_vision_items(self) -> int:
        """ViT items (tiles, patches) of the busiest CP rank: ceil(items / CP)."""
        return -(-self.vision_items // self.cp)

    def rank_vision_sq(self, sum_sq: float) -> float:
        """One CP rank's share of a ViT sum of squared segment lengths (``vision_attn_tokens_sq``,
        ``vision_window_tokens_sq``): sum_sq / CP (whole images per rank: an approximation, a rank can get more)."""
        return sum_sq / self.cp

    def to_dict(self) -> dict:
        d = {"vision_items": self.vision_items, "llm_tokens": self.llm_tokens, "dtype_bytes": self.dtype_bytes,
             "llm_attn_tokens_sq": self.llm_attn_tokens_sq}
        for name in ("vision_attn_tokens_sq", "vision_window_tokens_sq"):  # written only when set
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d if self.cp == 1 else {**d, "cp": self.cp}

    @classmethod
    def from_dict(cls, d: dict) -> "MicroBatchShape":
        """Also reads profiles and plans written before ``vision_items`` (their key: ``tiles``)."""
        items = d["vision_items"] if "vision_items" in d else d["tiles"]
        return cls(int(items), int(d["llm_tokens"]), int(d.get("dtype_bytes", 2)), d.get("llm_attn_tokens_sq"),
                   d.get("vision_attn_tokens_sq"), d.get("vision_window_tokens_sq"),
                   cp=int(d.get("cp", 1)))
