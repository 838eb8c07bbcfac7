"""The tensor mapping between an HF checkpoint and our unit-keyed GLOBAL tensors.

Each unit's runtime component adds its tensors (``hf_recipes``; InternVL's own units:
megatron/vlm/families/internvl/hf.py, with the family's HF names; the GPT decoder's: ``add_llm_layer``,
``vocab_recipe`` here).  Our global tensors are what ``VLMStage.sharded_state_dict()`` declares at any TP size (megatron/vlm/sharding.py):

* ViT attention per real head: ``linear_qkv.weight [R, 3d, H]`` (head h: its q rows, k rows, v rows),
  ``linear_qkv.bias [R, 3d]``, ``linear_proj.weight [R, H, d]`` (head h's input columns of the output
  projection), ``q_layernorm/k_layernorm.weight [R, d]`` (the full-width qk-norm weight cut per head);
* LLM fused ``linear_qkv`` per key-value group (the group's q heads, its k head, its v head, ``d`` rows
  each) and gated ``linear_fc1 = cat(gate, up)`` (megatron's swiglu factory stores all gates, then all ups);
* ``llm.embed.word.weight`` and ``llm.head.output.weight`` with the PADDED vocabulary: real rows, then zero
  rows (dropped again on export); a tied output layer is saved under both keys (as the trainer saves it).

Every global tensor is a :class:`Recipe`: its rows (axis 0, of the tensor seen as
``[shape[0] * rows_per_index, ...]``) are the concatenation of :class:`Part` s, each a block of rows
(and optionally columns) of one HF tensor, or zeros. One table serves both directions: import reads the
parts (lazily, only the rows a TP rank needs: :meth:`Recipe.read`), export scatters our tensors back
into the HF tensors the parts name (:func:`to_hf`), so a round trip is bit-identical.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from omnibal_ext.errors import UserError
from omnibal_ext.model.units import ModelSpec, build_units

from .config import HFInfo


class HFKeysError(UserError):
    """HF tensors missing, unused or of another shape than the config says."""


class NotRowsView(ValueError):
    """The destination of :meth:`Recipe.read_into` cannot be seen as rows without a copy."""


@dataclasses.dataclass(frozen=True)
class Part:
    """Rows [start, stop) of HF tensor ``name`` (columns [cols[0], cols[1]) when given); ``name`` None: zeros."""

    name: str | None
    start: int
    stop: int
    cols: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Recipe:
    shape: tuple[int, ...]  # our global shape
    parts: tuple[Part, ...]  # concatenated along axis 0 of the tensor viewed as [shape[0] * rows_per_index, *row]
    rows_per_index: int = 1

    def read(self, reader, first: int = 0, last: int | None = None, dtype=None, cols: tuple[int, int] | None = None
             ) -> torch.Tensor:
        """Indices [first, last) of axis 0 of the global tensor (default: all), reading only those rows of
        the HF tensors; ``cols``: only columns [c0, c1) of a 2-D tensor made of one uncut part per row block."""
        last = self.shape[0] if last is None else last
        lo, hi = first * self.rows_per_index, last * self.rows_per_index
        pieces, at = [], 0
        for part in self.parts:
            a, b = max(lo, at), min(hi, at + part.rows)
            if a < b:
                pieces.append(self._part_rows(reader, part, a - at, b - at, dtype, cols))
            at += part.rows
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        shape = (last - first, *self.shape[1:])
        if cols is not None:
            shape = (*shape[:-1], cols[1] - cols[0])
        return out.reshape(shape)

    def read_into(self, reader, out: torch.Tensor, first: int = 0, last: int | None = None,
                  cols: tuple[int, int] | None = None, chunk_bytes: int = 16 << 20) -> None:
        """Like :meth:`read`, but written straight into ``out`` (any dtype; a view of a parameter is fine, as
        long as it can be seen as ``[rows, width]`` without a copy): each part's rows are read from the HF
        tensor a chunk of about ``chunk_bytes`` at a time and converted into their place, so no tensor of
        more than one chunk is made. Same values as ``read(...).to(out.dtype)`` (one rounding)."""
        last = self.shape[0] if last is None else last
        lo, hi = first * self.rows_per_index, last * self.rows_per_index
        try:
            flat = out.view(hi - lo, -1) if (out.dim() > 1 or self._row_width() is not None) else out.view(-1)
        except RuntimeError as e:
            raise NotRowsView(str(e)) from None
        if flat.shape[0] != hi - lo:
            raise ValueError(f"Recipe.read_into: {tuple(out.shape)} does not hold rows [{lo}, {hi})")
        at = 0
        for part in self.parts:
            a, b = max(lo, at), min(hi, at + part.rows)
            if a < b:
                dest = flat[a - lo:b - lo]
                if part.name is None:
                    dest.zero_()
                else:
                    row_bytes = max(1, dest[0].numel()) * max(out.element_size(), 4)
                    step = max(1, chunk_bytes // row_bytes)
                    for r in range(a, b, step):
                        s = min(b, r + step)
                        t = self._part_rows(reader, part, r - at, s - at, None, cols)
                        dest[r - a:s - a].copy_(t.reshape(dest[r - a:s - a].shape))
                        del t
            at += part.rows

    def _part_rows(self, reader, part: Part, a: int, b: int, dtype, cols) -> torch.Tensor:
        width = self._row_width()
        if part.name is None:
            w = width if cols is None else cols[1] - cols[0]
            return torch.zeros((b - a, *(() if w is None else (w,))), dtype=dtype or torch.float32)
        r0, r1 = part.start + a, part.start + b
        if part.cols is not None:
            if cols is not None:
                raise ValueError("Recipe.read: a column range of a column-cut part")
            t = reader.box(part.name, (r0, r1), part.cols)
        else:
            t = reader.box(part.name, (r0, r1), cols)
        t = t.reshape(b - a, -1) if t.dim() > 1 else t
        return t if dtype is None else t.to(dtype)

    def _row_width(self) -> int | None:
        if len(self.shape) == 1 and self.rows_per_index == 1:
            return None
        return math.prod(self.shape) // (self.shape[0] * self.rows_per_index)


def detect_style(names: set[str]) -> str:
    return "modern" if any(n.startswith("model.vision_tower.") for n in names) else "legacy"


# ---------------------------------------------------------------------------------------------------
# The table: each unit's runtime component adds its tensors (megatron.vlm.components.RuntimeComponent.hf_recipes)
# ---------------------------------------------------------------------------------------------------
def whole(name: str, shape: tuple[int, ...]) -> Recipe:
    return Recipe(tuple(shape), (Part(name, 0, shape[0]),))


@dataclasses.dataclass
class Table:
    """What a component's ``hf_recipes`` fills: ``add(our key, Recipe)``; ``hf(HF name, HF shape)`` records an
    HF tensor and returns its name; ``names``: the family's HF names of this checkpoint (``hf_names``)."""

    spec: ModelSpec
    info: HFInfo
    names: object
    out: dict = dataclasses.field(default_factory=dict)
    shapes: dict = dataclasses.field(default_factory=dict)

    def add(self, key: str, recipe: Recipe) -> None:
        self.out[key] = recipe

    def hf(self, name: str, shape) -> str:
        self.shapes[name] = tuple(shape)
        return name


def hf_names(spec: ModelSpec, info: HFInfo, style: str = "legacy"):
    """The HF tensor names of ``spec``'s family for a checkpoint of ``info``'s layout in ``style``."""
    from megatron.vlm.families import runtime_family

    family = runtime_family(spec)
    if family.hf_names is None:
        raise UserError(f"model family {family.name!r} has no Hugging Face mapping")
    return family.hf_names(info, style)


def recipes(spec: ModelSpec, info: HFInfo, style: str = "legacy", units=None) -> tuple[dict[str, Recipe], dict]:
    """({our key: Recipe}, {HF name: HF shape}) of the units ``units`` (names; default: all)."""
    from megatron.vlm.families import component_of

    table = Table(spec, info, hf_names(spec, info, style))
    wanted = None if units is None else set(units)
    for unit in build_units(spec):
        if wanted is None or unit.name in wanted:
            component_of(spec, unit).hf_recipes(unit, table)
    return table.out, table.shapes


def vocab_recipe(name: str, spec: ModelSpec) -> Recipe:
    lang = spec.language
    parts = [Part(name, 0, lang.vocab_real)]
    if lang.vocab_size > lang.vocab_real:
        parts.append(Part(None, 0, lang.vocab_size - lang.vocab_real))  # padded rows: zeros
    return Recipe((lang.vocab_size, lang.hidden_size), tuple(parts))


def add_llm_layer(add, hf, m: dict, u: str, spec: ModelSpec, info: HFInfo) -> None:
    lang = spec.language
    H, heads, g, d, F = lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.kv_channels, lang.ffn_hidden_size
    per = heads // g
    rows = (heads + 2 * g) * d
    sa = u + "self_attention."
    if info.text_family == "internlm2":  # wqkv is already grouped as megatron's fused QKV
        add(sa + "linear_qkv.weight", whole(hf(m["qkv"], (rows, H)), (rows, H)))
    else:
        q, k, vv = (hf(m[x] + "weight", ((heads if x == "q" else g) * d, H)) for x in "qkv")
        add(sa + "linear_qkv.weight", Recipe((rows, H), _grouped(q, k, vv, g, per, d)))
        if lang.qkv_bias:
            qb, kb, vb = (hf(m[x] + "bias", ((heads if x == "q" else g) * d,)) for x in "qkv")
            add(sa + "linear_qkv.bias", Recipe((rows,), _grouped(qb, kb, vb, g, per, d)))
    add(sa + "linear_proj.weight", whole(hf(m["o"], (H, heads * d)), (H, heads * d)))
    add(sa + "linear_qkv.layer_norm_weight", whole(hf(m["norm1"], (H,)), (H,)))
    add(u + "mlp.linear_fc1.layer_norm_weight", whole(hf(m["norm2"], (H,)), (H,)))
    gate, up = hf(m["gate"], (F, H)), hf(m["up"], (F, H))
    add(u + "mlp.linear_fc1.weight", Recipe((2 * F, H), (Part(gate, 0, F), Part(up, 0, F))))
    add(u + "mlp.linear_fc2.weight", whole(hf(m["down"], (H, F)), (H, F)))


def _grouped(q: str, k: str, v: str, groups: int, per: int, d: int) -> tuple[Part, ...]:
    parts = []
    for i in range(groups):
        parts += [Part(q, i * per * d, (i + 1) * per * d), Part(k, i * d, (i + 1) * d), Part(v, i * d, (i + 1) * d)]
    return tuple(parts)


# ---------------------------------------------------------------------------------------------------
# Import / export of whole tensors
# ---------------------------------------------------------------------------------------------------
def skipped_names(info: HFInfo, spec: ModelSpec, names: set[str], style: str) -> set[str]:
    """HF tensors the family leaves out on purpose (InternVL: ViT layers after ``vision_feature_layer``)."""
    from megatron.vlm.families import runtime_family

    skipped = runtime_family(spec).hf_skipped_names
    return set() if skipped is None else skipped(info, spec, names, style)


def check_names(table_shapes: dict, reader, spec: ModelSpec, info: HFInfo, style: str, folder: str,
                tied_equal=None) -> None:
    """Every HF tensor the table needs is there with its shape, and every tensor there is used."""
    have = reader.names()
    missing = sorted(set(table_shapes) - have)
    unused = sorted(have - set(table_shapes) - skipped_names(info, spec, have, style))
    head = hf_names(spec, info, style).head
    if spec.language.tie_word_embeddings and head in unused:
        unused.remove(head)  # a tied head saved anyway: checked equal by the caller
        if tied_equal is not None:
            tied_equal(head)
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config asks for are missing: {', '.join(missing[:8])}"
                        + (" ..." if len(missing) > 8 else ""))
    if unused:
        problems.append(f"{len(unused)} tensor(s) are not used by this model: {', '.join(unused[:8])}"
                        + (" ..." if len(unused) > 8 else ""))
    bad = [f"{k} is {list(reader.shape(k))}, the config gives {list(s)}" for k, s in sorted(table_shapes.items())
           if k in have and tuple(reader.shape(k)) != tuple(s)]
    if bad:
        problems.append(f"{len(bad)} tensor(s) have another shape: {'; '.join(bad[:4])}" + (" ..." if len(bad) > 4 else ""))
    if problems:
        raise HFKeysError(f"--hf-checkpoint {folder}: the weights do not match config.json ({info.layout} layout, "
                          f"{info.text_family} LLM): " + "; ".join(problems))


def to_hf(spec: ModelSpec, info: HFInfo, tensors: dict[str, torch.Tensor], style: str = "legacy",
          dtype=None) -> dict[str, torch.Tensor]:
    """HF tensors (native or ``info``'s layout) from our global tensors: every part scattered back."""
    table, shapes = recipes(spec, info, style)
    hf = {}
    for key, recipe in table.items():
        if spec.language.tie_word_embeddings and key.endswith("llm.head.output.weight"):
            continue  # the tied head is the embedding
        flat = tensors[key].reshape(recipe.shape[0] * recipe.rows_per_index, -1) if len(recipe.shape) > 1 \
            else tensors[key]
        at = 0
        for part in recipe.parts:
            block = flat[at:at + part.rows]
            at += part.rows
            if part.name is None:
                continue
            if part.name not in hf:
                hf[part.name] = torch.empty(shapes[part.name], dtype=dtype or tensors[key].dtype)
            target = hf[part.name]
            view = target.reshape(target.shape[0], -1) if target.dim() > 1 else target
            if part.cols is not None:
                view[part.start:part.stop, part.cols[0]:part.cols[1]] = block.reshape(part.rows, -1)
            else:
                view[part.start:part.stop] = block.reshape(view[part.start:part.stop].shape)
    return hf
