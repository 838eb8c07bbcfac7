"""Hugging Face checkpoints in and out, for every family with an HF side (``FamilyRuntime.hf``).

* ``configs``: an HF ``config.json`` -> :class:`omnibal_ext.model.units.ModelSpec` plus an
  :class:`~megatron.vlm.hf.config.HFInfo` of what the spec does not hold (layout, LLM family, ids), by the family
  whose reader recognizes it (``megatron/vlm/families/<name>/hf.py``); and back (a ``config.json`` for export).
  ``config``: what the readers share; ``text_configs``: the text decoders' readers, shared.
* ``reader``: the safetensors shards of a folder, read lazily (whole tensors or slices).
* ``keys``: the tensor mapping between HF tensors and our unit-keyed GLOBAL tensors (the keys and
  global shapes ``VLMStage.sharded_state_dict()`` declares), both directions.
* ``convert``: ``omnibal hf import`` / ``omnibal hf export``.
"""
