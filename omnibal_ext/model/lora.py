"""LoRA: what the ``--lora-*`` flags ask, and how many adapter parameters each unit gets.

Tensor-free.  A low-rank adapter of rank ``r`` on a linear layer ``y = W x`` (W ``[out, in]``) adds
``(alpha / r) * B A dropout(x)`` with A ``[r, in]`` and B ``[out, r]`` (B starts at zero, so a fresh adapter
changes nothing).  Targets name a layer linear of the ViT or the LLM (``vit.qkv``, ``llm.fc2``, ...); an
adapter is split over tensor parallelism like its base layer:

* column-parallel base (qkv, fc1: output split): A replicated, B split by rows;
* row-parallel base (proj, fc2: input split): A split by columns, B replicated.

With LoRA on, the base weights of every model a target names are frozen (the LLM: embedding, layers and
head; the ViT: its patch embedding and layers); the rest follows the freeze flags (``trainable.Freeze``).
Planning counts an adapted unit as frozen (weights only, input-gradient backward) plus its adapters, which
train: their parameters, gradients and optimizer state (``UnitCost.lora_params``) and their weight
gradients' share of the backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .spec import TEXT_LAYER, VISION_LAYER

# the linear layers an adapter can sit on: short name -> tensor-parallel kind of its base
LINEARS = {"qkv": "column", "proj": "row", "fc1": "column", "fc2": "row"}
SIDES = {"vit": VISION_LAYER, "llm": TEXT_LAYER}  # target prefix -> role of the layers it adapts
TARGETS = tuple(f"{side}.{name}" for side in SIDES for name in LINEARS)
DEFAULT_TARGETS = tuple(f"llm.{name}" for name in LINEARS)


class LoraError(UserError):
    """LoRA flags that cannot work."""


@dataclass(frozen=True)
class Lora:
    """The LoRA flags: rank 0 = off; alpha None = 2 x rank; dropout on the adapter's input; targets from
    ``TARGETS``."""

    rank: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @classmethod
    def from_args(cls, args) -> "Lora":
        targets = getattr(args, "lora_targets", None)
        return cls(int(getattr(args, "lora_rank", 0) or 0), getattr(args, "lora_alpha", None),
                   float(getattr(args, "lora_dropout", 0.0) or 0.0),
                   DEFAULT_TARGETS if targets is None else tuple(parse_targets(targets)))

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank: the adapter output's factor."""
        return (2.0 * self.rank if self.alpha is None else float(self.alpha)) / self.rank

    def check(self) -> None:
        if self.rank < 0:
            raise LoraError(f"--lora-rank {self.rank}: must be >= 0 (0 = no LoRA)")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"--lora-dropout {self.dropout}: must be in [0, 1)")
        if self.alpha is not None and self.alpha <= 0:
            raise LoraError(f"--lora-alpha {self.alpha}: must be > 0")
        if not self.on and (self.alpha is not None or self.dropout or self.targets != DEFAULT_TARGETS):
            raise LoraError("--lora-alpha/--lora-dropout/--lora-targets need --lora-rank > 0")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad:
            raise LoraError(f"--lora-targets {','.join(bad)}: not a LoRA target (choose from {', '.join(TARGETS)})")
        if self.on and not self.targets:
            raise LoraError("--lora-targets is empty: name at least one of " + ", ".join(TARGETS))

    def linears(self, role: str) -> tuple[str, ...]:
        """The adapted linears (short names, ``LINEARS`` order) of the layers of ``role`` (a layout letter)."""
        if not self.on:
            return ()
        return tuple(n for n in LINEARS if any(t == f"{s}.{n}" and r == role for t in self.targets
                                                for s, r in SIDES.items()))

    def adapts(self, side: str) -> bool:
        """Whether a target names the model ``side`` ("vit" or "llm")."""
        return self.on and any(t.startswith(side + ".") for t in self.targets)

    def flags(self) -> list[str]:
        if not self.on:
            return []
        out = ["--lora-rank", str(self.rank)]
        if self.alpha is not None:
            out += ["--lora-alpha", f"{self.alpha:g}"]
        if self.dropout:
            out += ["--lora-dropout", f"{self.dropout:g}"]
        if self.targets != DEFAULT_TARGETS:
            out += ["--lora-targets", ",".join(self.targets)]
        return out

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "scaling": self.scaling if self.on else None,
                "dropout": self.dropout, "targets": list(self.targets)}

    def unit_adapter_params(self, component, tp: int = 1) -> tuple[int, int]:
        """(all, replicated over TP) adapter parameters of one unit of ``component`` (a CostComponent: its
        ``linears(tp)`` gives each linear's (in, out)), whole model: a TP rank holds
        ``(all - replicated) / tp + replicated``."""
        shapes = component.linears(tp)
        total = replicated = 0
        for name in self.linears(component.code):
            fan_in, fan_out = shapes[name]
            a, b = self.rank * fan_in, fan_out * self.rank
            total += a + b
            replicated += a if LINEARS[name] == "column" else b
        return total, replicated


def parse_targets(text: str) -> list[str]:
    """``llm.qkv,vit.fc1`` -> the list (``llm`` / ``vit`` alone: all four of that side); LoraError names a bad one."""
    out: list[str] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        expanded = [f"{part}.{n}" for n in LINEARS] if part in SIDES else [part]
        for t in expanded:
            if t not in TARGETS:
                raise LoraError(f"--lora-targets {part}: not a LoRA target (choose from {', '.join(TARGETS)}, "
                                "or llm / vit for all four)")
            if t not in out:
                out.append(t)
    return out


def add_lora_flags(p) -> None:
    """The LoRA flags on an argparse parser (the trainer and ``omnibal plan|partition|memory`` alike)."""
    g = p.add_argument_group("LoRA (low-rank adapters; the adapted model's base weights are frozen)")
    g.add_argument("--lora-rank", type=int, default=0, metavar="R", help="adapter rank (0: no LoRA)")
    g.add_argument("--lora-alpha", type=float, default=None, help="adapter scale alpha (output x alpha / rank; "
                                                                  "default 2 x rank)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapter's input (default 0)")
    g.add_argument("--lora-targets", default=None,
                   help=f"comma-separated linears to adapt, of {', '.join(TARGETS)} (llm / vit: all four of "
                        "that model; default: the LLM's four)")
