"""Load an HF InternVL folder straight into this rank's pipeline stage: only the stage's units, and of each
tensor only this TP rank's slice (``safetensors`` slices: never the whole model, nor a whole tensor that is
split over TP).

The stage's own ``sharded_state_dict()`` says what it holds (checkpoint key, global shape, this rank's
offset and shape, per-head ViT pieces, swiglu halves); each piece is read from the HF tensors through the
key's :class:`~megatron.vlm.hf.keys.Recipe`, and megatron-core's factory merges put the pieces back into
the stage's parameters (padded ViT heads become zeros), exactly as a checkpoint load would.
"""
from __future__ import annotations

import torch

from .keys import recipes


def read_piece(recipe, reader, sh, dtype) -> torch.Tensor:
    """The part of ``recipe``'s global tensor that ShardedTensor ``sh`` describes, shaped like ``sh.data``."""
    if sh.flattened_range is not None:
        raise NotImplementedError(f"{sh.key}: flattened views are not read from HF checkpoints")
    shape = tuple(sh.global_shape)
    local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    offset = tuple(sh.global_offset)
    partial = [i for i in range(1, len(shape)) if offset[i] != 0 or local[i] != shape[i]]
    first, last = offset[0], offset[0] + local[0]
    if not partial:
        t = recipe.read(reader, first, last, dtype)
    elif partial == [1] and len(shape) == 2:
        t = recipe.read(reader, first, last, dtype, cols=(offset[1], offset[1] + local[1]))
    else:  # not made by our stages today; correct, not lazy
        t = recipe.read(reader, first, last, dtype)
        for i in partial:
            t = t.narrow(i, offset[i], local[i])
    return t.reshape(sh.data.shape).to(sh.data.dtype)


def load_hf_into_stage(stage, src) -> int:
    """Load ``src`` (an :class:`~megatron.vlm.hf.convert.HFSource`) into ``stage`` (a VLMStage, unwrapped),
    one tensor at a time (at most one tensor's slice is held besides the parameters); returns the number of
    pieces read."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    table, _ = recipes(src.spec, src.info, src.style, [u.name for u in stage.units])
    params = {id(p) for p in stage.parameters()}
    count = 0

    def fill(x):
        nonlocal count
        if isinstance(x, ShardedTensor):
            count += 1
            return read_piece(table[x.key], src.reader, x, torch.float32)
        return x

    loaded = set()
    with torch.no_grad():
        for path, item in stage.sharded_state_dict().items():
            if isinstance(item, ShardedObject):
                continue  # modules' (empty) extra state
            if isinstance(item, ShardedTensorFactory):  # per-head ViT tensors, swiglu halves: build, fill, merge
                built = item.build()
                built = fill(built) if isinstance(built, ShardedTensor) else dict_list_map_inplace(fill, built)
                value = item.merge_fn(built)
                target = item.data
            elif isinstance(item, ShardedTensor):
                value, target = fill(item), item.data
            else:
                raise RuntimeError(f"load_hf_into_stage: unexpected entry {path}: {type(item).__name__}")
            if id(target) not in params:
                raise RuntimeError(f"load_hf_into_stage: {path} is not a parameter of the stage")
            target.copy_(value.reshape(target.shape))
            loaded.add(id(target))
            del value
    missing = [n for n, p in stage.named_parameters() if id(p) not in loaded]
    if missing:
        raise RuntimeError(f"load_hf_into_stage: parameters not loaded: {missing}")
    return count
