"""Load an HF folder straight into this rank's pipeline stage: only the stage's units, and of each
tensor only this TP rank's slice (``safetensors`` slices: never the whole model, nor a whole tensor that is
split over TP).

The stage's own ``sharded_state_dict()`` says what it holds (checkpoint key, global shape, this rank's
offset and shape, per-head ViT pieces, swiglu halves); each piece is read from the HF tensors through the
key's :class:`~megatron.vlm.hf.recipes.Recipe` straight into its place in the parameter (a chunk of rows at a
time, converted on the way: no full-size intermediate, no ``cat``), which is where megatron-core's factory
merges would put it (padded ViT heads become zeros); a factory whose pieces are not views of the parameter
falls back to fill, merge and copy. The shards are closed after each parameter, so the pages read stop
counting in the resident memory.
"""
from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from .keys import recipes
from .recipes import NotRowsView
from megatron.vlm.layers.lora import is_adapter


def _box(sh):
    """(first, last, cols, partial axes) of ShardedTensor ``sh`` within its global tensor."""
    if sh.flattened_range is not None:
        raise NotImplementedError(f"{sh.key}: flattened views are not read from HF checkpoints")
    shape = tuple(sh.global_shape)
    local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    offset = tuple(sh.global_offset)
    partial = [i for i in range(1, len(shape)) if offset[i] != 0 or local[i] != shape[i]]
    cols = (offset[1], offset[1] + local[1]) if partial == [1] and len(shape) == 2 else None
    return offset[0], offset[0] + local[0], cols, partial, offset, local


def read_piece(recipe, reader, sh, dtype) -> torch.Tensor:
    """The part of ``recipe``'s global tensor that ShardedTensor ``sh`` describes, shaped like ``sh.data``."""
    first, last, cols, partial, offset, local = _box(sh)
    if not partial or cols is not None:
        t = recipe.read(reader, first, last, dtype, cols=cols)
    else:  # not made by our stages today; correct, not lazy
        t = recipe.read(reader, first, last, dtype)
        for i in partial:
            t = t.narrow(i, offset[i], local[i])
    return t.reshape(sh.data.shape).to(sh.data.dtype)


def read_piece_into(recipe, reader, sh, out: torch.Tensor) -> None:
    """:func:`read_piece` written into ``out`` (shaped like ``sh.data``; e.g. a view of a parameter): each part
    goes straight to its place, a chunk at a time, with no full-size intermediate."""
    first, last, cols, partial, _, _ = _box(sh)
    if partial and cols is None:
        out.copy_(read_piece(recipe, reader, sh, torch.float32))
        return
    try:
        recipe.read_into(reader, out, first, last, cols=cols)
    except NotRowsView:  # ``out`` cannot be seen as rows without a copy: fill a copy, then write it back
        tmp = torch.empty(out.shape, dtype=out.dtype)
        recipe.read_into(reader, tmp, first, last, cols=cols)
        out.copy_(tmp)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def load_hf_into_stage(stage, src) -> int:
    """Load ``src`` (an :class:`~megatron.vlm.hf.convert.HFSource`) into ``stage`` (a VLMStage, unwrapped),
    one tensor piece at a time, written straight into the parameters (besides them, at most a chunk of one
    piece is held, plus the safetensors pages read; LoRA adapters keep their fresh values); returns the number
    of pieces read."""


    table, _ = recipes(src.spec, src.info, src.style, [u.name for u in stage.units])
    params = {id(p) for p in stage.parameters()}
    count = 0

    def fill(x):
        nonlocal count
        if isinstance(x, ShardedTensor):
            count += 1
            read_piece_into(table[x.key], src.reader, x, x.data)
        return x

    def fill_at(sh, out):
        nonlocal count
        count += 1
        read_piece_into(table[sh.key], src.reader, sh, out)

    loaded = set()
    with torch.no_grad():
        for path, item in stage.sharded_state_dict().items():
            if isinstance(item, ShardedObject):
                continue  # modules' (empty) extra state
            target = item.data
            if is_adapter(item.key):  # LoRA adapters: an HF model has none, they keep their fresh values
                loaded.add(id(target))
                continue
            if id(target) not in params:
                raise RuntimeError(f"load_hf_into_stage: {path} is not a parameter of the stage")
            if isinstance(item, ShardedTensorFactory):  # per-head ViT tensors, swiglu halves
                load_views = getattr(item, "load_views", None)
                if load_views is not None:  # the factory names where each loaded piece goes in the tensor
                    views = load_views(target)
                    built = item.build_fn(item.key, target.to("meta"), item.replica_id, None)  # metadata only
                    target.zero_()  # what the merge leaves outside the pieces (padded heads)
                    for name, sh in (built.items() if isinstance(built, dict) else ()):
                        if name in views:
                            fill_at(sh, views[name])
                else:
                    built = item.build()
                    leaves = list(nested_values(built)) if not isinstance(built, ShardedTensor) else [built]
                    if all(_shares(x.data, target) for x in leaves) and \
                            sum(x.data.numel() for x in leaves) == target.numel():  # views tiling the tensor
                        for x in leaves:
                            fill(x)  # in place (swiglu: gate rows, then up rows)
                    else:  # pieces held apart: fill them, merge, copy
                        built = fill(built) if isinstance(built, ShardedTensor) else dict_list_map_inplace(fill, built)
                        value = item.merge_fn(built)
                        target.copy_(value.reshape(target.shape))
                        del value
            elif isinstance(item, ShardedTensor):
                fill(item)  # item.data is the parameter: written in place
            else:
                raise RuntimeError(f"load_hf_into_stage: unexpected entry {path}: {type(item).__name__}")
            loaded.add(id(target))
            release = getattr(src.reader, "release", None)
            if release is not None:
                release()  # the safetensors pages of this tensor stop counting in the resident memory
    missing = [n for n, p in stage.named_parameters() if id(p) not in loaded]
    if missing:
        raise RuntimeError(f"load_hf_into_stage: parameters not loaded: {missing}")
    return count
