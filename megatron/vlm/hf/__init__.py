"""Hugging Face InternVL checkpoints in and out.

* ``config``: an HF ``config.json`` (native ``InternVLForConditionalGeneration`` layout, or the original
  OpenGVLab ``InternVLChatModel`` layout) -> :class:`omnibal_ext.model.units.ModelSpec` plus an
  :class:`~megatron.vlm.hf.config.HFInfo` of what the spec does not hold (layout, LLM family, ids);
  and back (a native ``config.json`` for export).
* ``reader``: the safetensors shards of a folder, read lazily (whole tensors or slices).
* ``keys``: the tensor mapping between HF tensors and our unit-keyed GLOBAL tensors (the keys and
  global shapes ``VLMStage.sharded_state_dict()`` declares), both directions.
* ``convert``: ``omnibal hf import`` / ``omnibal hf export``.
"""
