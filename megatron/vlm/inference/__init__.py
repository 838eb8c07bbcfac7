"""Generation on the training layout's stages (TP, PP, EP, the ViT anywhere): ``requests`` (what a request is and
what comes back, torch-free), the decode caches, sampling, the engine and ``omnibal generate``.
docs/generation.md describes it."""
