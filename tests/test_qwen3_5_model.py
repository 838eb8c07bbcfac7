"""Qwen3.5 model family (dense): planning side (presets at the published sizes, the two LLM layer kinds), config.json
and its refusals, and the model against transformers on tiny random checkpoints (``hf_tiny_qwen3_5``: every
parameter perturbed, layers linear/full/full/linear/linear, partial rotary, linear heads unlike the attention
heads, tied and untied): logits within 1e-5 (fp32, eager, transformers' torch delta rule) at every pipeline cut in
one process; dropping the output gate or the zero-centring is caught; import -> export bit-identical and loadable
by transformers; TP2 and PP2 (the boundary between a linear and a full-attention layer) under torchrun (slow)."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
import hf_tiny_qwen3_5 as q  # noqa: E402

from omnibal_ext.errors import UserError  # noqa: E402
from omnibal_ext.model.units import build_units, get_preset, role_summary  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"untied"|"tied": (folder, transformers model)}."""
    out = {}
    for i, tie in enumerate((False, True)):
        name = "tied" if tie else "untied"
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, q.make_tiny(folder, seed=i, tie=tie))
    return out


def test_logits_match_transformers_at_every_cut(megatron_world, tiny):
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits

    batch = q.inputs()
    for name, (folder, model) in tiny.items():
        src = HFSource.open(str(folder))
        kinds = [u.kind for u in build_units(src.spec) if u.code == "t"]
        assert kinds == ["qwen3_5_linear_layer", "qwen3_5_attention_layer", "qwen3_5_attention_layer",
                         "qwen3_5_linear_layer", "qwen3_5_linear_layer"]
        want = q.hf_logits(model, batch)
        got = chained_logits(src, batch)
        assert got.shape == want.shape == (batch["input_ids"].shape[1], q.VOCAB)
        assert (got - want).abs().max() <= TOL, name
        for cut in range(1, len(build_units(src.spec))):
            assert (chained_logits(src, batch, [cut]) - want).abs().max() <= TOL, (name, cut)
