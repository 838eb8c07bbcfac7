"""Recipes: how one of our unit-keyed GLOBAL tensors is made of rows (and columns) of Hugging Face tensors.

Every global tensor is a :class:`Recipe`: its rows (axis 0, of the tensor seen as
``[shape[0] * rows_per_index, ...]``) are the concatenation of :class:`Part` s, each a block of rows
(and optionally columns) of one HF tensor, or zeros. One table serves both directions: import reads the
parts (lazily, only the rows a TP rank needs: :meth:`Recipe.read`), export scatters our tensors back
into the HF tensors the parts name (``keys.to_hf``), so a round trip is bit-identical. Each unit's kind names
its Hugging Face mapping (``UnitKind.hf``, an ``HFMapping``), which fills a :class:`Table` with the unit's recipes;
the GPT decoder's kinds' (``text_embed_recipes``, ``text_layer_recipes``, ``moe_text_layer_recipes``,
``head_recipes``, on ``add_llm_layer`` and ``vocab_recipe``) are here, a family's own kinds' in its ``hf`` module.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import ModelSpec, Unit

from .config import HFInfo


class HFKeysError(UserError):
    """HF tensors missing, unused or of another shape than the config says."""


class NotRowsView(ValueError):
    """The destination of :meth:`Recipe.read_into` cannot be seen as rows without a copy."""


@dataclasses.dataclass(frozen=True)
class Part:
    """Rows [start, stop) of HF tensor ``name`` (columns [cols[0], cols[1]) when given); ``name`` None: zeros.

    ``index``: the rows are of ``name[index]`` (a 3-D HF tensor of stacked blocks: fused experts), and with
    ``transposed`` they are its columns [start, stop) (the file holds the block transposed)."""

    name: str | None
    start: int
    stop: int
    cols: tuple[int, int] | None = None
    index: int | None = None
    transposed: bool = False

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
        if part.index is not None:
            if cols is not None or part.cols is not None:
                raise ValueError("Recipe.read: a column range of a part of a stacked (3-D) tensor")
            t = reader.block(part.name, part.index, (r0, r1), part.transposed)
        elif part.cols is not None:
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
# The table: each unit's kind adds its tensors (its HFMapping, which UnitKind.hf names)
# ---------------------------------------------------------------------------------------------------
def whole(name: str, shape: tuple[int, ...]) -> Recipe:
    return Recipe(tuple(shape), (Part(name, 0, shape[0]),))


@dataclasses.dataclass
class Table:
    """What a kind's ``HFMapping`` fills: ``add(our key, Recipe)``; ``hf(HF name, HF shape)`` records an HF tensor
    and returns its name; ``names``: the family's HF names of this checkpoint (``hf_names``)."""

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


class HFMapping(Protocol):
    """A unit kind's Hugging Face mapping (``omnibal_ext.model.unit_kind.UnitKind.hf`` names one, ``"module:function"``;
    ``megatron.vlm.hf.keys.hf_mapping_of`` imports it)."""

    def __call__(self, unit: Unit, table: Table) -> None:
        """Add ``unit``'s tensors to ``table``: its keys (``unit.name`` + ``.`` + the module's parameter path) and
        the recipe of HF tensors each is made of."""


def vocab_recipe(name: str, spec: ModelSpec) -> Recipe:
    lang = spec.language
    parts = [Part(name, 0, lang.vocab_real)]
    if lang.vocab_size > lang.vocab_real:
        parts.append(Part(None, 0, lang.vocab_size - lang.vocab_real))  # padded rows: zeros
    return Recipe((lang.vocab_size, lang.hidden_size), tuple(parts))


def add_llm_layer(add, hf, m: dict, u: str, spec: ModelSpec, info: HFInfo) -> None:
    """A dense decoder layer: attention and both norms (``add_llm_attention``), the gated MLP."""
    add_llm_attention(add, hf, m, u, spec, info)
    H, F = spec.language.hidden_size, spec.language.ffn_hidden_size
    gate, up = hf(m["gate"], (F, H)), hf(m["up"], (F, H))
    add(u + "mlp.linear_fc1.weight", Recipe((2 * F, H), (Part(gate, 0, F), Part(up, 0, F))))
    add(u + "mlp.linear_fc2.weight", whole(hf(m["down"], (H, F)), (H, F)))


def add_moe_llm_layer(add, hf, m: dict, u: str, spec: ModelSpec, info: HFInfo, experts=None) -> None:
    """An MoE decoder layer (megatron-core's MoELayer): attention and both norms, the router ``[E, H]`` (HF
    ``m["router"]``), the experts as our global ``mlp.experts.experts.linear_fc1.weight [E, 2F, H]`` (expert e:
    its gate rows, then its up rows) and ``linear_fc2.weight [E, H, F]``, expert by expert along axis 0, so that
    an EP rank reads only its experts' rows. ``experts(e)``: (gate, up, down) Parts of expert ``e`` (default:
    one HF tensor per expert and matrix, ``m["experts"]{e}.gate_proj.weight`` ..., as Qwen3-MoE's files hold)."""
    add_llm_attention(add, hf, m, u, spec, info)
    lang = spec.language
    H, E, F = lang.hidden_size, lang.moe.num_experts, lang.moe.ffn_hidden_size
    add(u + "mlp.router.weight", whole(hf(m["router"], (E, H)), (E, H)))
    if experts is None:
        def experts(e):
            p = f"{m['experts']}{e}."
            return (Part(hf(p + "gate_proj.weight", (F, H)), 0, F), Part(hf(p + "up_proj.weight", (F, H)), 0, F),
                    Part(hf(p + "down_proj.weight", (H, F)), 0, H))
    parts = [experts(e) for e in range(E)]
    x = u + "mlp.experts.experts."
    add(x + "linear_fc1.weight", Recipe((E, 2 * F, H), tuple(p for gate, up, _ in parts for p in (gate, up)), 2 * F))
    add(x + "linear_fc2.weight", Recipe((E, H, F), tuple(down for _, _, down in parts), H))


def add_llm_attention(add, hf, m: dict, u: str, spec: ModelSpec, info: HFInfo) -> None:
    """A decoder layer's attention (fused QKV per group, biases, Qwen3's q/k norms, output projection) and its two
    norms (before attention, before the MLP)."""
    lang = spec.language
    H, heads, g, d = lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.kv_channels
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
    if lang.qk_norm:  # Qwen3's per-head norms: one [head_dim] weight each, replicated over TP
        for x in "qk":
            add(sa + f"{x}_layernorm.weight", whole(hf(m[f"{x}_norm"], (d,)), (d,)))
    add(sa + "linear_proj.weight", whole(hf(m["o"], (H, heads * d)), (H, heads * d)))
    add(sa + "linear_qkv.layer_norm_weight", whole(hf(m["norm1"], (H,)), (H,)))
    add(u + "mlp.linear_fc1.layer_norm_weight", whole(hf(m["norm2"], (H,)), (H,)))


def _grouped(q: str, k: str, v: str, groups: int, per: int, d: int) -> tuple[Part, ...]:
    parts = []
    for i in range(groups):
        parts += [Part(q, i * per * d, (i + 1) * per * d), Part(k, i * d, (i + 1) * d), Part(v, i * d, (i + 1) * d)]
    return tuple(parts)


# ---------------------------------------------------------------------------------------------------
# The GPT decoder's kinds (megatron.vlm.stage.kinds): their HFMappings
# ---------------------------------------------------------------------------------------------------
def text_embed_recipes(unit: Unit, table: Table) -> None:
    """The word embedding, its vocabulary padded (``vocab_recipe``)."""
    lang = table.spec.language
    table.add(unit.name + ".word.weight",
              vocab_recipe(table.hf(table.names.embed(), (lang.vocab_real, lang.hidden_size)), table.spec))


def text_layer_recipes(unit: Unit, table: Table) -> None:
    """A dense decoder layer (``add_llm_layer``)."""
    add_llm_layer(table.add, table.hf, table.names.llm_layer(unit.layer), unit.name + ".", table.spec, table.info)


def moe_text_layer_recipes(unit: Unit, table: Table) -> None:
    """An MoE decoder layer, one HF tensor per expert and matrix (``add_moe_llm_layer``)."""
    add_moe_llm_layer(table.add, table.hf, table.names.llm_layer(unit.layer), unit.name + ".", table.spec,
                      table.info)


def head_recipes(unit: Unit, table: Table) -> None:
    """The final norm and the output layer (the word embedding's HF tensor where the embeddings are tied), its
    vocabulary padded."""
    lang, names = table.spec.language, table.names
    H = lang.hidden_size
    table.add(unit.name + ".norm.weight", whole(table.hf(names.final_norm(), (H,)), (H,)))
    head = names.embed() if lang.tie_word_embeddings else names.head
    table.add(unit.name + ".output.weight", vocab_recipe(table.hf(head, (lang.vocab_real, H)), table.spec))
