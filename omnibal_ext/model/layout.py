"""Pipeline layouts: which contiguous slice of the unit list each pipeline stage holds.

Flag syntax (``--pipeline-layout``), an extension of Megatron's ``--pipeline-model-parallel-layout``:
stages are separated by ``|``; each stage lists its units by one-letter code, in order, with
``X*N`` for N repeats: ``I`` ViT patch embedding, ``v`` ViT layer, ``P`` projector, ``E`` LLM
embedding, ``t`` LLM layer, ``L`` output head and loss.  Example (4 ViT and 4 LLM layers, PP=2,
the ViT split across both stages)::

    Iv*3|vPEt*4L

A plain comma list of unit counts per stage (``"5,7"``) is accepted too.

Interleaved (virtual) pipeline, Megatron's convention: a layout of ``V x PP`` stages runs layout stage ``i`` on
pipeline rank ``i mod PP`` as its model chunk ``i div PP`` (``PipelineLayout.rank_stages``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UserError
from .spec import ROLES, TEXT_LAYER, ModelSpec, Unit
from .units import build_units, code_runs, role_summary

_TOKEN = re.compile(r"\s*([A-Za-z])(?:\s*\*\s*(\d+))?\s*,?")


class LayoutError(UserError):
    """A layout that does not fit the model (raised with the flag named)."""


@dataclass(frozen=True)
class PipelineLayout:
    """Unit counts per pipeline stage over the model's unit list."""

    stage_units: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_units)

    def stage_range(self, stage: int) -> range:
        start = sum(self.stage_units[:stage])
        return range(start, start + self.stage_units[stage])

    def stage_slices(self) -> list[range]:
        return [self.stage_range(s) for s in range(self.num_stages)]

    def rank_stages(self, rank: int, pp: int) -> list[int]:
        """The layout stages pipeline rank ``rank`` of ``pp`` runs, in chunk order (``rank``, ``rank + pp``, ...)."""
        return list(range(rank, self.num_stages, pp))

    def to_flag(self, units: list[Unit]) -> str:
        return "|".join("".join(code_runs(units[i].code for i in rng)) for rng in self.stage_slices())


def validate_layout(layout: PipelineLayout, num_units: int, pp: int, flag: str = "--pipeline-layout",
                    vpp: int | None = 1) -> None:
    """``vpp``: model chunks per pipeline rank (the layout has ``vpp x pp`` stages); None: any whole multiple
    of ``pp`` stages (an interleaved layout)."""
    if vpp is None:
        if layout.num_stages % pp:
            raise LayoutError(f"{flag}: {layout.num_stages} stages given but --pipeline-model-parallel-size is {pp} "
                              f"(an interleaved layout has V x {pp} stages)")
    elif layout.num_stages != pp * vpp:
        extra = f" x --virtual-pipeline-model-parallel-size {vpp}" if vpp > 1 else ""
        raise LayoutError(f"{flag}: {layout.num_stages} stages given but --pipeline-model-parallel-size is {pp}{extra}")
    if any(n <= 0 for n in layout.stage_units):
        raise LayoutError(f"{flag}: every stage needs at least one unit, got counts {list(layout.stage_units)}")
    if sum(layout.stage_units) != num_units:
        raise LayoutError(
            f"{flag}: stages hold {sum(layout.stage_units)} units in all but the model has {num_units}"
        )


def parse_layout(text: str, spec: ModelSpec, pp: int, flag: str = "--pipeline-layout",
                 vpp: int | None = 1) -> PipelineLayout:
    """Parse ``text`` (code syntax or counts) and check it covers ``spec``'s units in order, in ``vpp x pp``
    stages (``vpp`` None: any multiple of ``pp``, see ``validate_layout``)."""
    units = build_units(spec)
    text = text.strip()
    if re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        layout = PipelineLayout(tuple(int(x) for x in text.split(",")))
        validate_layout(layout, len(units), pp, flag, vpp)
        return layout
    counts, pos = [], 0
    for s, stage_text in enumerate(text.split("|")):
        n, i = 0, 0
        stage_text = stage_text.strip()
        while i < len(stage_text):
            m = _TOKEN.match(stage_text, i)
            if not m or m.end() == i:
                raise LayoutError(f"{flag}: cannot read {stage_text[i:]!r} in stage {s} of {text!r}")
            code, rep = m.group(1), int(m.group(2) or 1)
            if code not in ROLES:
                raise LayoutError(
                    f"{flag}: unknown unit code {code!r} in stage {s}; codes: "
                    + ", ".join(f"{c}={n}" for c, n in ROLES.items())
                )
            for _ in range(rep):
                if pos >= len(units):
                    raise LayoutError(f"{flag}: more units than the model has ({len(units)}) at stage {s}")
                if units[pos].code != code:
                    raise LayoutError(
                        f"{flag}: stage {s} gives {code!r} ({ROLES[code]}) where the model's unit "
                        f"{pos} is {units[pos].name!r}; the layout must list "
                        f"{role_summary(spec)} in order"
                    )
                pos, n = pos + 1, n + 1
            i = m.end()
        counts.append(n)
    layout = PipelineLayout(tuple(counts))
    validate_layout(layout, len(units), pp, flag, vpp)
    return layout


def default_layout(spec: ModelSpec, pp: int) -> PipelineLayout:
    """Megatron's behaviour: the whole ViT and projector on stage 0, LLM layers split uniformly.

    LLM embedding joins stage 0 and the head joins the last stage; when the LLM layers do not
    divide evenly the first stages get one more (Megatron requires divisibility; we do not).
    """
    units = build_units(spec)
    n_llm = spec.language.num_layers
    if pp < 1:
        raise LayoutError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if pp > 1 and n_llm < pp - 1:
        raise LayoutError(
            f"--pipeline-model-parallel-size {pp} is larger than the layer count allows for the default "
            f"layout: stages 1..{pp - 1} need one LLM layer each but --num-layers is {n_llm}"
        )
    if pp == 1:
        return PipelineLayout((len(units),))
    head = next(u.index for u in units if u.code == TEXT_LAYER)  # every unit before the first LLM layer
    # Stage 0 gets the ViT and its uniform share of LLM layers when there are enough; Megatron puts
    # num_layers / pp LLM layers on every stage.
    base, extra = divmod(n_llm, pp)
    per_stage = [base + (1 if s < extra else 0) for s in range(pp)]
    if per_stage[-1] == 0 or any(n == 0 for n in per_stage[1:]):
        per_stage = [0] + [n_llm // (pp - 1) + (1 if s < n_llm % (pp - 1) else 0) for s in range(pp - 1)]
    counts = [head + per_stage[0]] + per_stage[1:]
    counts[-1] += 1  # llm.head
    layout = PipelineLayout(tuple(counts))
    validate_layout(layout, len(units), pp)
    return layout

