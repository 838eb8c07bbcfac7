"""Checkpoints: megatron-core distributed checkpoints (``torch_dist``), resharded at load.

Layout (Megatron's)::

    SAVE/latest_checkpointed_iteration.txt   iteration of the newest complete checkpoint
    SAVE/iter_0000006/                       one megatron-core distributed checkpoint:
        .metadata, __<rank>_<n>.distcp       PyTorch DCP: every rank writes the shards it owns
        common.pt, metadata.json             the common state (rank 0)
        omnibal_manifest.json                size and XXH3-64 checksum of every file above, written last

What is in it:
- the model under the global unit names (``vit.layer.7.…``, ``llm.layer.31.…``; see
  megatron/vlm/parallel/sharding.py), each tensor with its tensor-parallel split declared, ViT heads unpadded;
- the optimizer state in model space: Adam's moments per parameter, keyed like the parameter (for the
  distributed optimizer megatron-core's ``fully_reshardable`` form, which also holds the fp32 main
  parameters); so it loads under any TP/PP/DP, layout, recompute plan and optimizer kind;
- per-rank RNG states (restored when TP, PP and DP are unchanged; re-seeded from --seed and the iteration
  otherwise);
- common state: iteration, consumed samples, LR scheduler, the data position (a DP change continues the
  epoch, see omnibal_ext.data.sampler) and a description of the run (model sizes, parallel sizes, layout).

Saving is atomic: everything goes into ``iter_N.tmp``; once every rank has written its shards, the
manifest is written, the folder renamed to ``iter_N`` and the tracker file written under a temporary name
and renamed, last. A kill at any moment leaves the previous complete checkpoint loadable; a leftover
``.tmp`` folder is ignored and removed by the next save. A failed write (a full disk) stops every rank with one
line and removes the ``.tmp`` folder.

A ``--save`` folder has one owner (lock.py: a lock file held by the run's rank 0) and holds one lineage
(lineage.py: a run moves other lineages' checkpoints aside before its first save; ``--keep-checkpoints`` prunes
only its own lineage's older ones).

Loading checks before any weight is touched: the manifest (every file present, of its size and checksum),
the model description and every tensor's global shape. A problem stops the run with one paragraph that
names the file or tensor and the iteration, and the newest older complete checkpoint (``--ckpt-step``).
"""
from .layout import FORMAT, MANIFEST, TRACKER, Checkpoint, CheckpointError, iteration_dir
from .load import find_checkpoint, load_checkpoint, load_weights, read_global_tensors
from .save import SaveError, fault_point, prepare_save_folder, save_checkpoint, save_global_tensors
from .space import checkpoint_bytes
from .state import describe_run, rng_state, run_description, set_rng_state, to_arrays, to_tensors

__all__ = ["FORMAT", "MANIFEST", "TRACKER", "Checkpoint", "CheckpointError", "SaveError", "checkpoint_bytes",
           "describe_run", "fault_point", "find_checkpoint", "iteration_dir", "load_checkpoint", "load_weights",
           "prepare_save_folder", "read_global_tensors", "rng_state", "run_description", "save_checkpoint",
           "save_global_tensors", "set_rng_state", "to_arrays", "to_tensors"]
