"""Fine-tune tiny Hugging Face Qwen2.5-VL, Qwen3-VL and Qwen3.5 folders (their tokenizer and chat template, a small
video processor budget in ``video_preprocessor_config.json``) at PP2 with the ViT split and ``--omnibal-isf`` on H.264
videos made with PyAV here (1-3 s, 6-30 fps, 64x48 to 224x160) mixed with images: the loss falls (slow); a
truncated video in the same data is refused naming its file:line, and --skip-bad-samples trains on the rest."""
import json

import numpy as np
import pytest

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("av")
import hf_tiny_qwen as q25  # noqa: E402
import hf_tiny_qwen3_5 as q35  # noqa: E402
import hf_tiny_qwen3_vl as q3  # noqa: E402

from megatron.vlm.data.video_synthetic import write_coded_video  # noqa: E402

pytestmark = pytest.mark.slow

FAMILIES = {  # make the folder, its video budget, PP2 layout with the ViT split
    "qwen2_5_vl": (q25.make_tiny_with_tokenizer, {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}},
                   "Iv*2|v*2PEt*2L"),
    "qwen3_vl": (q3.make_tiny_with_tokenizer, {"size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 16},
                                               "patch_size": 16}, "Iv*2|v*2PEt*3L"),
    "qwen3_5": (q35.make_tiny_with_tokenizer, {"size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 16},
                                               "patch_size": 16}, "Iv|vPEt*5L")}
SHADES = ("red", "green", "blue")
COLOURS = ((220, 30, 30), (30, 200, 30), (30, 30, 220))


def write_data(folder, bad: bool = False) -> str:
    """16 records: videos (a shade, the answer names it) and images; ``bad``: line 5 a truncated video file."""
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = []
    for k in range(16):
        c = k % 3
        if k % 4 == 3:
            Image.fromarray(np.full((40 + 4 * k, 56, 3), COLOURS[c], np.uint8)).save(folder / f"i{k}.png")
            lines.append({"messages": [{"role": "user", "content": "<image>Which shade?"},
                                       {"role": "assistant", "content": SHADES[c]}], "images": [f"i{k}.png"]})
            continue
        fps = int(rng.choice([6, 12, 30]))
        width, height = [(64, 48), (96, 64), (224, 160)][k % 3]
        path = folder / f"v{k}.mp4"
        write_coded_video(str(path), fps * (1 + k % 3), fps, width, height)
        lines.append({"messages": [{"role": "user", "content": "<video>Which shade is it?"},
                                   {"role": "assistant", "content": SHADES[c]}], "videos": [f"v{k}.mp4"]})
    if bad:
        data = (folder / "v4.mp4").read_bytes()
        (folder / "v4.mp4").write_bytes(data[:len(data) // 3])
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qwen_trains_on_a_video_and_image_mix_at_pp2_with_isf(family, tmp_path):
    make, budget, layout = FAMILIES[family]
    hf = tmp_path / "hf"
    make(hf, seed=3)
    (hf / "video_preprocessor_config.json").write_text(json.dumps(budget))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    flags = ["--hf-checkpoint", str(hf), "--data-path", write_data(data_dir, bad=True), "--max-pixels",
             str(28 * 28 * 8), "--video-max-frames", "4", "--pipeline-model-parallel-size", "2",
             "--pipeline-layout", layout, "--omnibal-isf", "--train-iters", "12", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1", "--eval-interval", "0",
             "--seq-length", "256", "--data-cache-dir", str(tmp_path / "cache"), "--seed", "5"]
    _, out = run_training(2, flags, tmp_path, f"{family}_bad", expect_ok=False)
    assert "train.jsonl:5" in out and "v4.mp4" in out and "Traceback" not in out, out[-3000:]
    records, out = run_training(2, flags + ["--skip-bad-samples"], tmp_path, family)
    assert "> ISF:" in out
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
