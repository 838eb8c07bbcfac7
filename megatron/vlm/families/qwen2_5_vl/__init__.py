"""Qwen2.5-VL family, data side: image preprocessing to patch rows (``image_processing``), the 3-D
multimodal RoPE position ids of a sample (``positions``), the vision encoder's window permutation,
sequence boundaries and 2-D rotary ids (``vision_windows``): plain functions over numpy/PIL; the training data
side (``data``: the reader's image rule and the micro-batch maker; records are read by
``megatron/vlm/data/internvl.py``, ``messages`` records by ``megatron/vlm/data/messages.py``).  The model
(``family``: modules, components, Hugging Face side ``hf``, logits-check micro-batches ``batch``) is registered by
``megatron.vlm.families``'s discovery, not imported here."""
