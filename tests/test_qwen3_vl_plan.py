"""`omnibal plan` for Qwen3-VL: qwen3-vl-8b on 64 GPUs on native stats (16 px patches, the published pixel budget)
plans a layout, and the DeepStack features sent across each of its boundaries are the closed form: live features x
image-token rows x LLM width x bytes per value (rows: the ISF cap's patches / 4 merged tokens; a feature of ViT layer
i is live from the boundary after it to LLM layer k that adds it)."""
from __future__ import annotations

import json

import numpy as np

from omnibal_ext.data.native import derive_native_stats, records_of
from omnibal_ext.data.stats import from_arrays
from omnibal_ext.model.layout import parse_layout
from omnibal_ext.model.units import get_preset

# Qwen3-VL-8B-Instruct's published facts (tests/test_qwen3_vl_model.py: PUBLISHED): 27 ViT layers, DeepStack at
# ViT layers 8, 16, 24 into LLM layers 0, 1, 2; LLM hidden 4096; the image processor's 16 px patches, 2 x 2 merged,
# 65536..16777216 px per image
VIT_LAYERS, DEEPSTACK, HIDDEN = 27, (8, 16, 24), 4096


def live_features(boundary: int) -> int:
    """DeepStack features crossing the boundary before unit ``boundary`` of I v*27 P E t*36 L (unit 0: the ViT
    embedding, ViT layer i: unit 1 + i, LLM layer k: unit 30 + k)."""
    return sum(1 + i < boundary <= VIT_LAYERS + 3 + k for k, i in enumerate(DEEPSTACK))


def test_plan_qwen3_vl_8b_on_64_gpus_counts_the_deepstack_bytes(tmp_path, capsys):
    from omnibal_cli import main

    rng = np.random.default_rng(3)
    tiles = rng.choice([1, 3, 5, 7], 2000)
    stats = derive_native_stats(from_arrays(tiles, 256 * tiles + rng.integers(50, 600, 2000)), max_num=6, patch=16,
                                min_pixels=65536, max_pixels=16777216)
    f, out = tmp_path / "native.json", tmp_path / "plan.json"
    f.write_text(json.dumps(records_of(stats)))
    assert main(["plan", "--data", str(f), "--model", "qwen3-vl-8b", "--gpus", "64", "--gpu-memory", "80",
                 "--tp", "4", "--pp", "4", "--global-batch-size", "512", "--sim-iterations", "1", "--json", str(out)]) == 0
    assert "side tensors (DeepStack features)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    spec = get_preset("qwen3-vl-8b")
    caps = doc["shapes"]["isf_caps"]
    rows = caps["vision_items"] / 4  # merged tokens of the largest group the caps allow (patches)
    value_bytes = 2  # bf16 on the A100 preset
    assert doc["trainer_flags"]["--bf16"] and caps["dtype_bytes"] == value_bytes
    for row in doc["rows"]:
        layout = parse_layout(row["layout_flag"], spec, doc["pp"], vpp=row["vpp"])
        starts = [r.start for r in layout.stage_slices()[1:]]
        want = [live_features(b) * rows * HIDDEN * value_bytes for b in starts]
        assert row["boundary_side_bytes"] == want, (row["setting"], row["layout_flag"])
    final = doc["rows"][-1]
    assert final["setting"] == "+memory" and any(final["boundary_side_bytes"])  # the plan cuts across features
