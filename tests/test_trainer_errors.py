"""Bad input stops pretrain_vlm.py before training, with the file/line or flag named."""
import json

import pytest
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
    assert proc.returncode == 2, proc.stderr[-3000:]
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
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expect in proc.stderr
    assert "iteration" not in proc.stdout


def test_bad_flag_exits_2_with_one_line_and_no_traceback(tmp_path):
    proc = run_single(["--log-interval", "0"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: --log-interval 0: must be >= 1"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_only_user_errors_lose_their_traceback(monkeypatch, capsys):
    """cli() prints a UserError as one line (exit 2); any other exception (here a library's ValueError)
    propagates with its traceback."""
    import pretrain_vlm
    from omnibal_ext.errors import UserError

    def user_mistake(argv=None):
        raise UserError("--data-path x.json: no such file\n  (second line)")

    monkeypatch.setattr(pretrain_vlm, "main", user_mistake)
    assert pretrain_vlm.cli() == 2
    assert capsys.readouterr().err == "error: --data-path x.json: no such file; (second line)\n"

    def library_bug(argv=None):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(pretrain_vlm, "main", library_bug)
    with pytest.raises(ValueError, match="broadcast"):
        pretrain_vlm.cli()
