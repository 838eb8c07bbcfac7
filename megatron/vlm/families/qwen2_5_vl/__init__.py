"""Qwen2.5-VL family, data side: image preprocessing to patch rows (``image_processing``), the 3-D
multimodal RoPE position ids of a sample (``positions``), the vision encoder's window permutation,
sequence boundaries and 2-D rotary ids (``vision_windows``), and the ``messages`` JSONL record reader
(``conversations``): plain functions over numpy/PIL.  The model (``family``: modules, components, Hugging Face
side ``hf``, logits-check micro-batches ``batch``) is imported by ``megatron.vlm.families``, not here."""
