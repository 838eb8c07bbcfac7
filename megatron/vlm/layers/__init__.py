"""The runtime's layers, on the parallelism floor (``megatron.vlm.parallel``) only: the layer specs and recompute
segments (``blocks``), the layer implementation resolved once (``layer_impl``), the TransformerConfigs (``config``),
core attention within packed samples (``attention``), norms, rope, MoE, LoRA, drop path, per-unit seeding, the
output head (``head``) and the Gated DeltaNet with its delta rule."""
