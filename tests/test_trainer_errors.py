"""Bad input stops pretrain_vlm.py before training, with the file/line or flag named."""
import json

import pytest
import torch
from PIL import Image

from launch import run_single


def write_dataset(root, lines):
    (root / "img").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), (200, 10, 10)).save(root / "img" / "a.png")
    ann = root / "train.jsonl"
    ann.write_text("\n".join(lines) + "\n")
    meta = root / "meta.json"
    meta.write_text(json.dumps({"toy": {"root": str(root), "annotation": str(ann)}}))
    return meta, ann


GOOD = json.dumps({"image": "img/a.png", "conversations": [
    {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "red"}]})


@pytest.mark.parametrize("bad_line,expect", [
    (json.dumps({"image": "img/missing.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "x"}]}), "img/missing.png"),
    ('{"image": "img/a.png", "conversations": [', "JSON"),
    (json.dumps({"image": ["img/a.png", "img/a.png"], "conversations": [
        {"from": "human", "value": "<image>\nWhich?"}, {"from": "gpt", "value": "x"}]}), "<image>"),
], ids=["missing-image", "not-json", "image-count"])
def test_bad_records_are_named(tmp_path, bad_line, expect):
    meta, ann = write_dataset(tmp_path, [GOOD, bad_line, GOOD])
    proc = run_single(["--data-path", str(meta), "--train-iters", "2"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert f"{ann}:2" in err and expect in err
    assert "iteration" not in proc.stdout


@pytest.mark.parametrize("flags,expect", [
    (["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*3|vPEt*3L"], "--pipeline-layout"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*4PEt*4L|L"], "--pipeline-layout"),
    (["--pipeline-model-parallel-size", "13"], "--pipeline-model-parallel-size 13"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
], ids=["layout-short", "layout-long", "pp-too-large", "tp-heads"])
def test_bad_flags_are_named(tmp_path, flags, expect):
    proc = run_single(flags + ["--train-iters", "2"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert expect in proc.stderr
    assert "iteration" not in proc.stdout


def test_bad_flag_exits_2_with_one_line_and_no_traceback(tmp_path):
    proc = run_single(["--log-interval", "0"], tmp_path, fresh=True)  # the real command line's exit status
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: --log-interval 0: must be >= 1"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_only_user_errors_lose_their_traceback(monkeypatch, capsys):
    """cli() prints a UserError as one line (exit 1, as a RunStopped); any other exception (here a library's
    ValueError) propagates with its traceback."""
    import pretrain_vlm
    from omnibal_ext.errors import UserError

    def user_mistake(argv=None):
        raise UserError("--data-path x.json: no such file\n  (second line)")

    monkeypatch.setattr(pretrain_vlm, "main", user_mistake)
    assert pretrain_vlm.cli() == 1
    assert capsys.readouterr().err == "error: --data-path x.json: no such file; (second line)\n"

    def run_stopped(argv=None):  # a run that stopped itself to protect its work: exit status 1
        from megatron.training.checkpointing.lock import SaveLockError

        raise SaveLockError("--save ckpt is in use by another run")

    monkeypatch.setattr(pretrain_vlm, "main", run_stopped)
    assert pretrain_vlm.cli() == 1
    assert capsys.readouterr().err == "error: --save ckpt is in use by another run\n"

    def library_bug(argv=None):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(pretrain_vlm, "main", library_bug)
    with pytest.raises(ValueError, match="broadcast"):
        pretrain_vlm.cli()


def tiny_dataset(meta):
    import torch

    from megatron.training.arguments import parse_config
    from megatron.training.setup import build_dataset
    from megatron.vlm.data.tokenizer import build_tokenizer

    config = parse_config(["--data-cache-dir", str(meta.parent / "data_cache")])
    return build_dataset(config, config.model.spec, build_tokenizer(None), str(meta))


def test_truncated_image_is_named_before_training(tmp_path):
    """The header of a JPEG cut in half reads fine; the scan decodes it and names file:line."""
    meta, ann = write_dataset(tmp_path, [GOOD, GOOD.replace("a.png", "cut.jpg"), GOOD])
    whole = tmp_path / "whole.jpg"
    Image.effect_noise((64, 48), 60).convert("RGB").save(whole, quality=95)
    data = whole.read_bytes()
    (tmp_path / "img" / "cut.jpg").write_bytes(data[: len(data) // 2])
    with Image.open(tmp_path / "img" / "cut.jpg") as im:
        assert im.size == (64, 48)  # the header alone does not tell
    proc = run_single(["--data-path", str(meta), "--train-iters", "2"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"{ann}:2: cannot decode image" in proc.stderr and "cut.jpg" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_empty_annotation_file_is_named(tmp_path):
    from megatron.vlm.data.records import DataValidationError

    meta, ann = write_dataset(tmp_path, [GOOD])
    ann.write_text("\n")
    with pytest.raises(DataValidationError, match=f"{ann}: annotation file holds no records "
                                                   f"\\(entry 'toy' of {meta}\\)"):
        tiny_dataset(meta)


def test_isf_cap_below_one_sample_names_it_and_the_flag(tmp_path):
    from megatron.training.arguments import parse_config
    from megatron.training.flags import ArgumentError
    from megatron.training.isf import check_samples_fit_caps

    long_answer = json.dumps({"image": "img/a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "red " * 40}]})
    meta, ann = write_dataset(tmp_path, [GOOD, long_answer, GOOD])
    dataset = tiny_dataset(meta)
    tokens, tiles = dataset.sample_lengths()
    cap = int(tokens[0])  # the short samples fit, the long one does not
    config = parse_config(["--omnibal-isf", "--omnibal-isf-qv", "100", "--omnibal-isf-qt", str(cap)])
    with pytest.raises(ArgumentError) as e:
        check_samples_fit_caps(config, config.model.spec, dataset)
    message = str(e.value)
    assert f"--omnibal-isf-qt {cap} is below a single sample: {ann}:2 has {int(tokens[1])} tokens" in message
    assert f"raise --omnibal-isf-qt to at least {int(tokens[1])}" in message
    # counted to a multiple (context parallelism's padding): the cap holds the padded tokens
    m = int(tokens[1]) + 1
    config = parse_config(["--omnibal-isf", "--omnibal-isf-qv", "100", "--omnibal-isf-qt", str(int(tokens[1])),
                           "--omnibal-isf-token-multiple", str(m)])
    with pytest.raises(ArgumentError, match=f"has {m} tokens padded to a multiple of {m}"):
        check_samples_fit_caps(config, config.model.spec, dataset)
    config = parse_config(["--omnibal-isf", "--omnibal-isf-qv", str(int(tiles.max()) - 1), "--omnibal-isf-qt", "100000"])
    with pytest.raises(ArgumentError, match="--omnibal-isf-qv .* tiles"):
        check_samples_fit_caps(config, config.model.spec, dataset)
