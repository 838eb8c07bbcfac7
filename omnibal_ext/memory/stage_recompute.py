"""One pipeline stage's recompute settings (``StageRecompute``) and its ``--recompute-plan`` syntax
(see omnibal_ext/memory/recompute.py's docstring): the type the memory model and the recompute planner share."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from ..errors import UserError

_ITEM = re.compile(r"([vt])(\d+)(s?)")


class RecomputeFlagError(UserError):
    """A ``--recompute-plan`` value that cannot be read or does not fit the layout."""


@dataclass(frozen=True)
class StageRecompute:
    """Recompute settings of one pipeline stage (see the module docstring)."""

    vit_full_layers: int = 0  # first N ViT layers of the stage fully recomputed
    vit_selective: bool = False  # selective recompute for the stage's other ViT layers
    llm_full_layers: int = 0  # first N LLM layers of the stage fully recomputed
    llm_selective: bool = False  # selective recompute for the stage's other LLM layers

    def __post_init__(self):
        for name in ("vit_full_layers", "llm_full_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"StageRecompute.{name} must be an integer >= 0, got {v!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StageRecompute":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"StageRecompute: unknown keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(int(d.get("vit_full_layers", 0)), bool(d.get("vit_selective", False)),
                   int(d.get("llm_full_layers", 0)), bool(d.get("llm_selective", False)))

    def to_flag(self) -> str:
        items = []
        if self.vit_full_layers or self.vit_selective:
            items.append(f"v{self.vit_full_layers}" + ("s" if self.vit_selective else ""))
        if self.llm_full_layers or self.llm_selective:
            items.append(f"t{self.llm_full_layers}" + ("s" if self.llm_selective else ""))
        return ",".join(items) or "-"

    @classmethod
    def from_flag(cls, text: str, stage: int = 0, flag: str = "--recompute-plan") -> "StageRecompute":
        text = text.strip()
        if text in ("", "-"):
            return cls()
        fields: dict = {}
        for item in text.split(","):
            m = _ITEM.fullmatch(item.strip())
            if not m:
                raise RecomputeFlagError(
                    f"{flag}: cannot read {item.strip()!r} in stage {stage}; items are v<N>[s] (ViT) and "
                    f"t<N>[s] (LLM), e.g. 'v2s,t3|t0s'")
            block = "vit" if m.group(1) == "v" else "llm"
            if f"{block}_full_layers" in fields:
                raise RecomputeFlagError(f"{flag}: stage {stage} gives {m.group(1)!r} twice in {text!r}")
            fields[f"{block}_full_layers"] = int(m.group(2))
            fields[f"{block}_selective"] = m.group(3) == "s"
        return cls(**fields)
