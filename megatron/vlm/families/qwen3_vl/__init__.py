"""Qwen3-VL family (dense): the model (``family``: modules, components, Hugging Face side ``hf``, logits-check
micro-batches ``batch``) is imported by ``megatron.vlm.families``, not here; the data side (image processing,
positions, the training micro-batches) lives beside it."""
