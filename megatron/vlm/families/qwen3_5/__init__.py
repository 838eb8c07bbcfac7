"""Qwen3.5 family (dense and MoE): the model (``family``: modules, components, Hugging Face side ``hf``) is imported by
``megatron.vlm.families``, not here; the ViT, the image data side and the logits-check micro-batches are Qwen3-VL's
(``megatron.vlm.families.qwen3_vl``) with no DeepStack."""
