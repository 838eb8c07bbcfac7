"""scripts/hf_logits.py as a user runs it: the trainer's parse-time checks before any weight is read (a Qwen3.5
checkpoint with one key/value head at TP2, which megatron-core's output gate would crash on), and an MoE checkpoint at
TP2 with an odd token count (39): the input is padded to a multiple of TP for the sequence-parallel MoE layers and
the logits of its 39 real tokens equal transformers'."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import hf_check  # noqa: E402
import hf_tiny_qwen3_5 as tiny_q35  # noqa: E402
import hf_tiny_qwen3_vl as tiny_vl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import hf_logits  # noqa: E402

TOL = 1e-5


def test_one_kv_head_at_tp2_refused_before_any_work(tmp_path, monkeypatch, capsys):
    from transformers import Qwen3_5ForConditionalGeneration

    config = tiny_q35.hf_config()
    config.text_config.num_key_value_heads = 1
    Qwen3_5ForConditionalGeneration(config).save_pretrained(str(tmp_path / "q35"))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 sets it; no process group is started
    code = hf_logits.main(["--hf-checkpoint", str(tmp_path / "q35"), "--inputs", str(tmp_path / "absent.pt"),
                           "--out", str(tmp_path / "out.pt"), "--tensor-model-parallel-size", "2"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hf_logits: error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err  # one line, no traceback
    assert "--tensor-model-parallel-size 2" in lines[0] and "--num-query-groups 1 (LLM key/value groups)" in lines[0], \
        lines[0]  # issue 33 item 21: the one group is named by its own flag
    assert not (tmp_path / "out.pt").exists()


def _inputs_of_length(tokens: int) -> dict:
    """``tiny_vl.inputs`` of one image with random text tokens appended up to ``tokens``."""
    batch = tiny_vl.inputs(grids=tiny_vl.GRIDS[:1])
    extra = tokens - batch["input_ids"].shape[1]
    assert extra > 0
    text = torch.randint(0, tiny_vl.VISION_START, (1, extra), generator=torch.Generator().manual_seed(5))
    batch["input_ids"] = torch.cat([batch["input_ids"], text], dim=1)
    batch["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(text)], dim=1)
    return batch


@pytest.mark.slow
def test_moe_at_tp2_pads_an_odd_input(tmp_path):
    folder = tmp_path / "moe"
    model = tiny_vl.make_tiny_moe(folder, seed=7, published=True)
    batch = _inputs_of_length(39)
    want = tiny_vl.hf_logits(model, batch)
    (got,) = hf_check.torchrun_logits([(folder, ["--tensor-model-parallel-size", "2"])], batch, tmp_path / "run")
    assert got.shape == want.shape == (39, tiny_vl.VOCAB)
    assert (got - want).abs().max() <= TOL
