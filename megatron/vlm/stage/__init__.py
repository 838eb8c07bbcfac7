"""The pipeline stage and its micro-batch, above the layers and the data: the typed micro-batch (``micro_batch``),
the loader that serves it (``batches``), the per-micro-batch stage cache and side tensors (``side``), the LLM's
text embedding and block inputs (``text``), the runtime component of a unit kind and a family's runtime side
(``components``) and the stage module itself (``build``: ``StageBuild``, ``build_stage``, ``VLMStage``)."""
