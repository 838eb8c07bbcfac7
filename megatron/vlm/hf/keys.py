"""The tensor mapping between an HF checkpoint and our unit-keyed GLOBAL tensors.

Each unit's kind adds its tensors (its ``HFMapping``, which ``UnitKind.hf`` names: a family's own kinds' in its
folder's hf.py, with the family's HF names; the GPT decoder's in recipes.py).  Our global tensors are what
``VLMStage.sharded_state_dict()`` declares at any TP size (megatron/vlm/parallel/sharding.py):

* ViT attention per real head: ``linear_qkv.weight [R, 3d, H]`` (head h: its q rows, k rows, v rows),
  ``linear_qkv.bias [R, 3d]``, ``linear_proj.weight [R, H, d]`` (head h's input columns of the output
  projection), ``q_layernorm/k_layernorm.weight [R, d]`` (the full-width qk-norm weight cut per head);
* LLM fused ``linear_qkv`` per key-value group (the group's q heads, its k head, its v head, ``d`` rows
  each) and gated ``linear_fc1 = cat(gate, up)`` (megatron's swiglu factory stores all gates, then all ups);
* ``llm.embed.word.weight`` and ``llm.head.output.weight`` with the PADDED vocabulary: real rows, then zero
  rows (dropped again on export); a tied output layer is saved under both keys (as the trainer saves it).

Every global tensor is a recipe of HF tensor parts (``recipes.py``); this module asks each unit's
family for them and reads, checks and writes whole tensors with them (:func:`to_hf`).
"""
from __future__ import annotations

import functools

import torch

from omnibal_ext.model.unit_kind import UnitKind
from omnibal_ext.model.units import ModelSpec, build_units, family_of

from .config import HFInfo
from .configs import hf_side
from .recipes import HFKeysError, HFMapping, Recipe, Table


def hf_names(spec: ModelSpec, info: HFInfo, style: str = "legacy"):
    """The HF tensor names of ``spec``'s family for a checkpoint of ``info``'s layout in ``style``."""
    return hf_side(spec).names(info, style)


def recipes(spec: ModelSpec, info: HFInfo, style: str = "legacy", units=None) -> tuple[dict[str, Recipe], dict]:
    """({our key: Recipe}, {HF name: HF shape}) of the units ``units`` (names; default: all)."""
    table = Table(spec, info, hf_names(spec, info, style))
    wanted = None if units is None else set(units)
    family = family_of(spec)
    for unit in build_units(spec):
        if wanted is None or unit.name in wanted:
            hf_mapping_of(family.kind(unit.kind))(unit, table)
    return table.out, table.shapes


@functools.cache
def hf_mapping_of(kind: UnitKind) -> HFMapping:
    """The Hugging Face mapping ``kind.hf`` names, imported on first use and checked to be callable (a TypeError
    naming the kind otherwise: a bug of its family; a kind without one: a UserError)."""
    try:
        mapping = kind.load_hf()
    except (ImportError, AttributeError) as e:
        raise TypeError(f"unit kind {kind.name!r}: its Hugging Face mapping {kind.hf!r} does not import: {e}") from e
    if not callable(mapping):
        raise TypeError(f"unit kind {kind.name!r}: its Hugging Face mapping {kind.hf!r} is not callable")
    return mapping


# ---------------------------------------------------------------------------------------------------
# Import / export of whole tensors
# ---------------------------------------------------------------------------------------------------
def skipped_names(info: HFInfo, spec: ModelSpec, names: set[str], style: str) -> set[str]:
    """HF tensors the family leaves out on purpose (ViT layers after a feature layer, say)."""
    return hf_side(spec).skipped_names(info, spec, names, style)


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
            if part.index is not None:  # a block of a stacked tensor (held transposed: its columns)
                rows = block.reshape(part.rows, -1)
                if part.transposed:
                    target[part.index][:, part.start:part.stop] = rows.t()
                else:
                    target[part.index][part.start:part.stop] = rows
                continue
            view = target.reshape(target.shape[0], -1) if target.dim() > 1 else target
            if part.cols is not None:
                view[part.start:part.stop, part.cols[0]:part.cols[1]] = block.reshape(part.rows, -1)
            else:
                view[part.start:part.stop] = block.reshape(view[part.start:part.stop].shape)
    return hf
