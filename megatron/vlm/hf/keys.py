"""The tensor mapping between an HF InternVL checkpoint and our unit-keyed GLOBAL tensors.

Our global tensors are what ``VLMStage.sharded_state_dict()`` declares at any TP size (megatron/vlm/sharding.py):

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


# ---------------------------------------------------------------------------------------------------
# HF names of each layout
# ---------------------------------------------------------------------------------------------------
class Names:
    """HF tensor names of one layout (``style``: "legacy" = ``vision_tower.`` / ``language_model.model.`` /
    ``language_model.lm_head`` as save_pretrained writes them; "modern" = ``model.vision_tower.`` /
    ``model.language_model.`` / ``lm_head``, the in-memory names)."""

    def __init__(self, info: HFInfo, style: str = "legacy"):
        self.info, self.style = info, style
        if info.layout == "native":
            p = "model." if style == "modern" else ""
            self.vit = f"{p}vision_tower."
            self.proj = f"{p}multi_modal_projector."
            self.llm = f"{p}language_model." if style == "modern" else "language_model.model."
            self.head = "lm_head.weight" if style == "modern" else "language_model.lm_head.weight"
        else:
            self.vit, self.proj, self.llm = "vision_model.", "mlp1.", "language_model.model."
            self.head = "language_model.output.weight" if info.text_family == "internlm2" else "language_model.lm_head.weight"

    # ViT -------------------------------------------------------------------------------------------
    def vit_embed(self) -> dict[str, str]:
        e = self.vit + "embeddings."
        if self.info.layout == "native":
            return {"cls_token": e + "cls_token", "position": e + "position_embeddings",
                    "patch.weight": e + "patch_embeddings.projection.weight",
                    "patch.bias": e + "patch_embeddings.projection.bias"}
        return {"cls_token": e + "class_embedding", "position": e + "position_embedding",
                "patch.weight": e + "patch_embedding.weight", "patch.bias": e + "patch_embedding.bias"}

    def vit_layer(self, i: int) -> dict[str, str]:
        if self.info.layout == "native":
            p = f"{self.vit}encoder.layer.{i}."
            return {"q": p + "attention.q_proj.", "k": p + "attention.k_proj.", "v": p + "attention.v_proj.",
                    "q_norm": p + "attention.q_norm.weight", "k_norm": p + "attention.k_norm.weight",
                    "proj": p + "attention.projection_layer.", "ls1": p + "lambda_1", "ls2": p + "lambda_2",
                    "norm1": p + "layernorm_before.", "norm2": p + "layernorm_after.",
                    "fc1": p + "mlp.fc1.", "fc2": p + "mlp.fc2.", "prefix": p}
        p = f"{self.vit}encoder.layers.{i}."
        return {"qkv": p + "attn.qkv.", "q_norm": p + "attn.q_norm.weight", "k_norm": p + "attn.k_norm.weight",
                "proj": p + "attn.proj.", "ls1": p + "ls1", "ls2": p + "ls2", "norm1": p + "norm1.",
                "norm2": p + "norm2.", "fc1": p + "mlp.fc1.", "fc2": p + "mlp.fc2.", "prefix": p}

    def projector(self) -> dict[str, str]:
        if self.info.layout == "native":
            return {"norm": self.proj + "layer_norm.", "fc1": self.proj + "linear_1.", "fc2": self.proj + "linear_2."}
        return {"norm": self.proj + "0.", "fc1": self.proj + "1.", "fc2": self.proj + "3."}

    # LLM -------------------------------------------------------------------------------------------
    def embed(self) -> str:
        return self.llm + ("tok_embeddings.weight" if self.info.text_family == "internlm2" else "embed_tokens.weight")

    def llm_layer(self, i: int) -> dict[str, str]:
        p = f"{self.llm}layers.{i}."
        if self.info.text_family == "internlm2":
            return {"qkv": p + "attention.wqkv.weight", "o": p + "attention.wo.weight",
                    "gate": p + "feed_forward.w1.weight", "up": p + "feed_forward.w3.weight",
                    "down": p + "feed_forward.w2.weight", "norm1": p + "attention_norm.weight",
                    "norm2": p + "ffn_norm.weight"}
        return {"q": p + "self_attn.q_proj.", "k": p + "self_attn.k_proj.", "v": p + "self_attn.v_proj.",
                "o": p + "self_attn.o_proj.weight", "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
                "down": p + "mlp.down_proj.weight", "norm1": p + "input_layernorm.weight",
                "norm2": p + "post_attention_layernorm.weight"}

    def final_norm(self) -> str:
        return self.llm + "norm.weight"


def detect_style(names: set[str]) -> str:
    return "modern" if any(n.startswith("model.vision_tower.") for n in names) else "legacy"


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------
def _whole(name: str, shape: tuple[int, ...]) -> Recipe:
    return Recipe(tuple(shape), (Part(name, 0, shape[0]),))


def recipes(spec: ModelSpec, info: HFInfo, style: str = "legacy", units=None) -> tuple[dict[str, Recipe], dict]:
    """({our key: Recipe}, {HF name: HF shape}) of the units ``units`` (names; default: all)."""
    n = Names(info, style)
    v, lang = spec.vision, spec.language
    H, R, d, Fv = v.hidden_size, v.num_attention_heads, v.head_dim, v.ffn_hidden_size
    out: dict[str, Recipe] = {}
    shapes: dict[str, tuple] = {}
    wanted = None if units is None else set(units)

    def add(key, recipe):
        out[key] = recipe

    def hf(name, shape):
        shapes[name] = tuple(shape)
        return name

    for unit in build_units(spec):
        if wanted is not None and unit.name not in wanted:
            continue
        u = unit.name + "."
        if unit.kind == "vit_embed":
            e = n.vit_embed()
            P = v.seq_per_tile
            add(u + "cls_token", _whole(hf(e["cls_token"], (1, 1, H)), (1, 1, H)))
            add(u + "position", _whole(hf(e["position"], (1, P, H)), (1, P, H)))
            ps = (H, 3, v.patch_size, v.patch_size)
            add(u + "patch.weight", _whole(hf(e["patch.weight"], ps), ps))
            add(u + "patch.bias", _whole(hf(e["patch.bias"], (H,)), (H,)))
        elif unit.kind == "vit_layer":
            m = n.vit_layer(unit.layer)
            sa = u + "self_attention."
            if info.layout == "native":
                src = [(hf(m[x] + "weight", (H, H)), 0) for x in "qkv"]  # (name, first row of the H-row block)
                bsrc = [(hf(m[x] + "bias", (H,)), 0) for x in "qkv"] if v.qkv_bias else None
            else:
                qkv = hf(m["qkv"] + "weight", (3 * H, H))
                src = [(qkv, j * H) for j in range(3)]
                bsrc = [(hf(m["qkv"] + "bias", (3 * H,)), j * H) for j in range(3)] if v.qkv_bias else None
            per_head = lambda s: tuple(Part(name, r0 + h * d, r0 + (h + 1) * d) for h in range(R) for name, r0 in s)  # noqa: E731
            add(sa + "linear_qkv.weight", Recipe((R, 3 * d, H), per_head(src), 3 * d))
            if bsrc:
                add(sa + "linear_qkv.bias", Recipe((R, 3 * d), per_head(bsrc), 3 * d))
            proj = hf(m["proj"] + "weight", (H, H))
            add(sa + "linear_proj.weight", Recipe((R, H, d), tuple(Part(proj, 0, H, (h * d, (h + 1) * d)) for h in range(R)), H))
            add(sa + "linear_proj.bias", _whole(hf(m["proj"] + "bias", (H,)), (H,)))
            if v.qk_norm:
                for x in "qk":
                    name = hf(m[f"{x}_norm"], (H,))
                    add(sa + f"{x}_layernorm.weight", Recipe((R, d), tuple(Part(name, h * d, (h + 1) * d) for h in range(R)), d))
            norms = ("weight", "bias") if v.normalization == "LayerNorm" else ("weight",)
            for w in norms:
                add(sa + f"linear_qkv.layer_norm_{w}", _whole(hf(m["norm1"] + w, (H,)), (H,)))
                add(u + f"mlp.linear_fc1.layer_norm_{w}", _whole(hf(m["norm2"] + w, (H,)), (H,)))
            add(u + "mlp.linear_fc1.weight", _whole(hf(m["fc1"] + "weight", (Fv, H)), (Fv, H)))
            add(u + "mlp.linear_fc1.bias", _whole(hf(m["fc1"] + "bias", (Fv,)), (Fv,)))
            add(u + "mlp.linear_fc2.weight", _whole(hf(m["fc2"] + "weight", (H, Fv)), (H, Fv)))
            add(u + "mlp.linear_fc2.bias", _whole(hf(m["fc2"] + "bias", (H,)), (H,)))
            add(u + "self_attn_bda.scale", _whole(hf(m["ls1"], (H,)), (H,)))
            add(u + "mlp_bda.scale", _whole(hf(m["ls2"], (H,)), (H,)))
        elif unit.kind == "projector":
            m = n.projector()
            Pin, Hl = spec.projector_in_size, lang.hidden_size
            for w in ("weight", "bias"):
                add(u + f"norm.{w}", _whole(hf(m["norm"] + w, (Pin,)), (Pin,)))
            add(u + "fc1.weight", _whole(hf(m["fc1"] + "weight", (Hl, Pin)), (Hl, Pin)))
            add(u + "fc1.bias", _whole(hf(m["fc1"] + "bias", (Hl,)), (Hl,)))
            add(u + "fc2.weight", _whole(hf(m["fc2"] + "weight", (Hl, Hl)), (Hl, Hl)))
            add(u + "fc2.bias", _whole(hf(m["fc2"] + "bias", (Hl,)), (Hl,)))
        elif unit.kind == "llm_embed":
            add(u + "word.weight", _vocab(hf(n.embed(), (lang.vocab_real, lang.hidden_size)), spec))
        elif unit.kind == "llm_layer":
            add_llm_layer(add, hf, n.llm_layer(unit.layer), u, spec, info)
        elif unit.kind == "llm_head":
            Hl = lang.hidden_size
            add(u + "norm.weight", _whole(hf(n.final_norm(), (Hl,)), (Hl,)))
            head = n.embed() if lang.tie_word_embeddings else n.head
            add(u + "output.weight", _vocab(hf(head, (lang.vocab_real, Hl)), spec))
    return out, shapes


def _vocab(name: str, spec: ModelSpec) -> Recipe:
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
        add(sa + "linear_qkv.weight", _whole(hf(m["qkv"], (rows, H)), (rows, H)))
    else:
        q, k, vv = (hf(m[x] + "weight", ((heads if x == "q" else g) * d, H)) for x in "qkv")
        add(sa + "linear_qkv.weight", Recipe((rows, H), _grouped(q, k, vv, g, per, d)))
        if lang.qkv_bias:
            qb, kb, vb = (hf(m[x] + "bias", ((heads if x == "q" else g) * d,)) for x in "qkv")
            add(sa + "linear_qkv.bias", Recipe((rows,), _grouped(qb, kb, vb, g, per, d)))
    add(sa + "linear_proj.weight", _whole(hf(m["o"], (H, heads * d)), (H, heads * d)))
    add(sa + "linear_qkv.layer_norm_weight", _whole(hf(m["norm1"], (H,)), (H,)))
    add(u + "mlp.linear_fc1.layer_norm_weight", _whole(hf(m["norm2"], (H,)), (H,)))
    gate, up = hf(m["gate"], (F, H)), hf(m["up"], (F, H))
    add(u + "mlp.linear_fc1.weight", Recipe((2 * F, H), (Part(gate, 0, F), Part(up, 0, F))))
    add(u + "mlp.linear_fc2.weight", _whole(hf(m["down"], (H, F)), (H, F)))


def _grouped(q: str, k: str, v: str, groups: int, per: int, d: int) -> tuple[Part, ...]:
    parts = []
    for i in range(groups):
        parts += [Part(q, i * per * d, (i + 1) * per * d), Part(k, i * d, (i + 1) * d), Part(v, i * d, (i + 1) * d)]
    return tuple(parts)


# ---------------------------------------------------------------------------------------------------
# Import / export of whole tensors
# ---------------------------------------------------------------------------------------------------
def skipped_names(info: HFInfo, spec: ModelSpec, names: set[str], style: str) -> set[str]:
    """HF tensors legitimately left out: ViT layers after the one ``vision_feature_layer`` selects."""
    n = Names(info, style)
    prefixes = tuple(n.vit_layer(i)["prefix"] for i in range(spec.vision.num_layers, info.vit_layers_in_checkpoint))
    return {x for x in names if prefixes and x.startswith(prefixes)}


def check_names(table_shapes: dict, reader, spec: ModelSpec, info: HFInfo, style: str, folder: str,
                tied_equal=None) -> None:
    """Every HF tensor the table needs is there with its shape, and every tensor there is used."""
    have = reader.names()
    missing = sorted(set(table_shapes) - have)
    unused = sorted(have - set(table_shapes) - skipped_names(info, spec, have, style))
    if spec.language.tie_word_embeddings and Names(info, style).head in unused:
        unused.remove(Names(info, style).head)  # a tied head saved anyway: checked equal by the caller
        if tied_equal is not None:
            tied_equal(Names(info, style).head)
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
