"""The runtime's parallelism, its ground floor (imports nothing else of ``megatron.vlm``): context parallelism
(``context_parallel``: the split of packed micro-batches, gathers over the CP group), sequence parallelism
(``sequence_parallel``: the region's edges, padding to TP), ViT heads padded for TP (``padded_heads``), checkpoint
keys by unit (``sharding``) and the tied-embedding group (``tied``)."""
