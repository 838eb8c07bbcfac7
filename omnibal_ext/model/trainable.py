"""Which units train: the freeze flags turned into one bool per pipeline unit, and what that does to costs.

Tensor-free.  :class:`Freeze` is what the flags ask (``--freeze-vit``, ``--freeze-projector``,
``--freeze-llm``, ``--unfreeze-vit-layers N``, ``--unfreeze-lm-head``); :meth:`Freeze.trainable` resolves
it against a model's unit list into a :class:`Trainable` (per unit: trains or frozen), by role:

* the ViT = roles ``I`` and ``v`` (``--unfreeze-vit-layers N`` trains the ViT layers ``[N:]`` again, in
  Python's slice sense: ``-4`` the last four, ``2`` all but the first two);
* the projector = role ``P``;
* the LLM = roles ``E``, ``t`` and ``L`` (``--unfreeze-lm-head`` trains ``L`` again).

LoRA (``--lora-*``, ``omnibal_ext.model.lora``) freezes the base weights of every model its targets name (as
``--freeze-llm`` / ``--freeze-vit`` would) and gives the adapted layers trained adapters: such a unit is frozen
(its weights: no gradient, no optimizer state) but has something trainable (``Trainable.adapters``), so it and
everything after it run with autograd.

A frozen unit keeps its weights: no gradient, no optimizer state.  What it still costs depends on
what is upstream of it (units before it in the list):

* nothing trainable upstream (a frozen *prefix* of the model): it runs without autograd, forward
  only: no backward time and no activations kept;
* something trainable upstream: its backward computes the input gradient only, not the weight
  gradient, ``INPUT_GRAD_SHARE`` of the full backward (the backward's two matmuls per forward matmul
  become one), and it keeps its activations;
* a frozen unit with adapters: the input-gradient backward plus its adapters' weight gradients, counted as
  the weight-gradient share of the backward scaled by adapter parameters / unit parameters.

:meth:`Trainable.apply` writes that into a :class:`~omnibal_ext.model.costs.CostTable` (and marks
frozen units ``frozen``, so the memory model counts only their weights as static bytes); the
partition search, the simulator, the memory model and the recompute planner then read the adjusted
table unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from ..errors import UserError
from .lora import Lora, add_lora_flags
from .spec import HEAD, PROJECTOR, TEXT_EMBED, TEXT_LAYER, VISION_EMBED, VISION_LAYER, Unit
from .units import build_units, unit_components

# Share of a unit's backward that remains when only the input gradient is computed (its weights are
# frozen): a matmul's backward is two matmuls of the forward's size, input and weight gradient.
INPUT_GRAD_SHARE = 0.5

VIT_ROLES = (VISION_EMBED, VISION_LAYER)
LLM_ROLES = (TEXT_EMBED, TEXT_LAYER, HEAD)


class FreezeError(UserError):
    """Freeze flags that do not fit together or leave nothing to train."""


@dataclass(frozen=True)
class Freeze:
    """The freeze flags (what a user asks)."""

    vit: bool = False
    projector: bool = False
    llm: bool = False
    unfreeze_vit_layers: int | None = None  # with ``vit``: the ViT layers [N:] train again
    unfreeze_lm_head: bool = False  # with ``llm``: the output head trains again
    lora: Lora = Lora()  # LoRA adapters (--lora-*): the models they adapt are frozen, the adapters train

    @classmethod
    def from_args(cls, args) -> "Freeze":
        """From parsed flags (attributes ``freeze_vit``, ``freeze_projector``, ``freeze_llm``,
        ``unfreeze_vit_layers``, ``unfreeze_lm_head`` and the ``lora_*`` ones; missing ones: off)."""
        return cls(bool(getattr(args, "freeze_vit", False)), bool(getattr(args, "freeze_projector", False)),
                   bool(getattr(args, "freeze_llm", False)), getattr(args, "unfreeze_vit_layers", None),
                   bool(getattr(args, "unfreeze_lm_head", False)), Lora.from_args(args))

    @property
    def any(self) -> bool:
        return self.vit or self.projector or self.llm or self.lora.on

    @property
    def vit_frozen(self) -> bool:
        """The ViT's base weights are frozen: --freeze-vit, or LoRA adapts it."""
        return self.vit or self.lora.adapts("vit")

    @property
    def llm_frozen(self) -> bool:
        """The LLM's base weights are frozen: --freeze-llm, or LoRA adapts it."""
        return self.llm or self.lora.adapts("llm")

    def check(self) -> None:
        """Raise FreezeError (LoraError) for combinations that mean nothing."""
        self.lora.check()
        if self.unfreeze_vit_layers is not None and not self.vit_frozen:
            raise FreezeError("--unfreeze-vit-layers needs --freeze-vit (it trains some frozen ViT layers again)")
        if self.unfreeze_lm_head and not self.llm_frozen:
            raise FreezeError("--unfreeze-lm-head needs --freeze-llm (it trains the frozen output head again)")

    def flags(self) -> list[str]:
        """The trainer/CLI flags that ask for this."""
        out = [f for f, on in (("--freeze-vit", self.vit), ("--freeze-projector", self.projector),
                               ("--freeze-llm", self.llm)) if on]
        if self.unfreeze_vit_layers is not None:
            out += ["--unfreeze-vit-layers", str(self.unfreeze_vit_layers)]
        if self.unfreeze_lm_head:
            out.append("--unfreeze-lm-head")
        return out + self.lora.flags()

    def trainable(self, units: Sequence[Unit], tie_word_embeddings: bool = False, spec=None) -> "Trainable":
        """Per unit of ``units`` (a model's whole unit list, in order): trains or not, and its adapters (with
        LoRA: ``spec``, the ModelSpec, sizes them)."""
        self.check()
        vit_layers = [u.index for u in units if u.code == VISION_LAYER]
        unfrozen_vit = set(vit_layers[slice(self.unfreeze_vit_layers, None)]) \
            if self.unfreeze_vit_layers is not None else set()
        trains = []
        for u in units:
            if u.code in VIT_ROLES:
                t = not self.vit_frozen or u.index in unfrozen_vit
            elif u.code == PROJECTOR:
                t = not self.projector
            elif u.code in LLM_ROLES:
                t = not self.llm_frozen or (u.code == HEAD and self.unfreeze_lm_head)
            else:  # a role no flag names trains
                t = True
            trains.append(t)
        adapters = ()
        if self.lora.on:
            if spec is None:
                raise ValueError("Freeze.trainable with LoRA needs the model spec (adapter sizes)")

            adapters = tuple(self.lora.unit_adapter_params(c) for c in unit_components(spec))
        if spec is not None:
            adapters = _trained_parts(units, trains, adapters, spec)
        out = Trainable(tuple(trains), adapters)
        if not any(trains) and not out.adapted_units:
            raise FreezeError(f"{' '.join(self.flags())} freeze every unit: nothing would train")
        if tie_word_embeddings:
            e = [trains[u.index] for u in units if u.code == TEXT_EMBED]
            h = [trains[u.index] for u in units if u.code == HEAD]
            if e and h and e[0] != h[0]:
                raise FreezeError("--unfreeze-lm-head with tied word embeddings: the output layer is the frozen "
                                  "input embedding's weight (give --no-tie-word-embeddings or drop the flag)")
        return out


def _trained_parts(units, trains: list[bool], adapters: tuple, spec) -> tuple:
    """``adapters`` (per unit: trained parameters of a frozen unit, all and replicated over TP) plus the parts of
    another role that train in frozen units (``CostComponent.params_of_role``: DeepStack mergers follow
    the projector inside frozen ViT layer units). A trained unit's frozen parts (the mergers under
    --freeze-projector with the ViT training) are counted as trained: a small overcount."""

    role_trains = {u.code: trains[u.index] for u in reversed(units)}
    comps = unit_components(spec)
    out = list(adapters) if adapters else [(0, 0)] * len(units)
    changed = False
    for u, c in zip(units, comps):
        if trains[u.index]:
            continue
        for role, on in role_trains.items():
            if role != u.code and on:
                n, rep = c.params_of_role(role)
                if n:
                    out[u.index] = (out[u.index][0] + n, out[u.index][1] + rep)
                    changed = True
    return tuple(out) if (changed or adapters) else ()


@dataclass(frozen=True)
class Trainable:
    """Per pipeline unit (in unit-list order): True = trains, False = frozen; with LoRA, per unit its adapter
    parameters (all, replicated over TP), whole model (``Lora.unit_adapter_params``; () = no adapters)."""

    trains: tuple[bool, ...]
    adapters: tuple[tuple[int, int], ...] = ()

    @classmethod
    def everything(cls, num_units: int) -> "Trainable":
        return cls((True,) * num_units)

    def __len__(self) -> int:
        return len(self.trains)

    @property
    def all_train(self) -> bool:
        return all(self.trains) and not self.adapted_units

    @property
    def adapted_units(self) -> tuple[int, ...]:
        """Units with LoRA adapters."""
        return tuple(i for i, (a, _) in enumerate(self.adapters) if a)

    def has_trainable(self, index: int) -> bool:
        """Unit ``index`` trains or holds adapters (which train)."""
        return self.trains[index] or (bool(self.adapters) and self.adapters[index][0] > 0)

    @property
    def frozen_units(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.trains) if not t)

    @property
    def frozen_prefix(self) -> int:
        """Units at the start of the list with nothing trainable up to and including them (they run
        without autograd): the index of the first trainable unit."""
        return next((i for i in range(len(self.trains)) if self.has_trainable(i)), len(self.trains))

    def apply(self, costs, input_grad_share: float = INPUT_GRAD_SHARE):
        """``costs`` (a CostTable over the same units) as they are with these units frozen (see the module
        docstring); unchanged when everything trains."""
        if len(costs.units) != len(self.trains):
            raise FreezeError(f"trainable set has {len(self.trains)} units but the cost table {len(costs.units)}")
        if self.all_train:
            return costs
        prefix = self.frozen_prefix
        units = []
        for i, (u, t) in enumerate(zip(costs.units, self.trains)):
            if t:
                units.append(u)
            elif i < prefix:  # forward only, no autograd: nothing kept, no backward, nothing to recompute
                units.append(dataclasses.replace(u, bwd_s=0.0, act_bytes=0.0, act_bytes_full=0.0,
                                                 act_bytes_selective=0.0, selective_recompute_s=0.0, frozen=True))
            elif self.has_trainable(i):  # frozen base with adapters: input gradient + adapters' weight gradients
                lora, replicated = self.adapters[i]
                share = input_grad_share + (1.0 - input_grad_share) * lora / max(u.param_count, 1)
                units.append(dataclasses.replace(u, bwd_s=u.bwd_s * share, frozen=True, lora_params=lora,
                                                 lora_replicated=replicated))
            else:
                units.append(dataclasses.replace(u, bwd_s=u.bwd_s * input_grad_share, frozen=True))
        meta = {**costs.meta, "frozen_units": list(self.frozen_units), "input_grad_share": input_grad_share}
        if self.adapted_units:
            meta["lora_units"] = list(self.adapted_units)
        return dataclasses.replace(costs, units=tuple(units), meta=meta)

    def describe(self, units: Sequence[Unit]) -> str:
        """The frozen units by role for logs: ``frozen I v*4 (ViT prefix without autograd) t*4``."""
        if self.all_train:
            return "every unit trains"
        frozen = [units[i] for i in self.frozen_units]
        parts, i = [], 0
        while i < len(frozen):
            j = i
            while j + 1 < len(frozen) and frozen[j + 1].code == frozen[i].code and \
                    frozen[j + 1].index == frozen[j].index + 1:
                j += 1
            n = j - i + 1
            parts.append(frozen[i].code if n == 1 else f"{frozen[i].code}*{n}")
            i = j + 1
        lora = f"; LoRA adapters on {len(self.adapted_units)} of them" if self.adapted_units else ""
        return (f"frozen {' '.join(parts)} ({len(frozen)} of {len(units)} units{lora}; the first "
                f"{self.frozen_prefix} run without autograd)")


def add_freeze_flags(p) -> None:
    """The freeze flags on an argparse parser (the trainer and ``omnibal plan|partition|memory`` alike;
    Megatron's ``--freeze-ViT`` / ``--freeze-LM`` are accepted as aliases)."""
    g = p.add_argument_group("freezing (frozen units keep their weights: no gradient, no optimizer state)")
    g.add_argument("--freeze-vit", "--freeze-ViT", dest="freeze_vit", action="store_true",
                   help="freeze the ViT (its patch embedding and layers)")
    g.add_argument("--freeze-projector", action="store_true", help="freeze the ViT-to-LLM projector")
    g.add_argument("--freeze-llm", "--freeze-LM", dest="freeze_llm", action="store_true",
                   help="freeze the whole LLM: embedding, layers and output head")
    g.add_argument("--unfreeze-vit-layers", type=int, default=None, metavar="N",
                   help="with --freeze-vit: the ViT layers [N:] (Python's slice) train again; -4 = the last four")
    g.add_argument("--unfreeze-lm-head", action="store_true", help="with --freeze-llm: the output head trains again")
    add_lora_flags(p)


def trainable_of(args, spec) -> Trainable:
    """The Trainable of parsed freeze flags for the model ``spec`` (a ModelSpec)."""

    return Freeze.from_args(args).trainable(build_units(spec), spec.language.tie_word_embeddings, spec)
