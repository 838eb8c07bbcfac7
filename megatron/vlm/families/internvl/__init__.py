"""InternVL at run time: InternViT (patch embedding, layers with padded heads, layer scale, qk-norm), the
pixel-shuffle MLP projector and the shared GPT decoder; its Hugging Face names and config reader.

Planning side: ``omnibal_ext.model.families.internvl``. The ``RuntimeFamily`` (``family``) is registered by
``megatron.vlm.families``'s discovery, not imported here."""
