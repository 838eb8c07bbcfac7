"""Data at scale: --skip-bad-samples (bad records left out, listed with file:line and reason, counted in the
log; the default stays: stop), --truncate-long-samples, and --load of a file refused."""
import os

import pytest

from test_data_reader import SIZE, TOK, TPT, make_data, qa

from launch import run_single
from megatron.vlm.data import DataValidationError, RecordDataset, TileImages


def bad_data(tmp_path):
    long_text = "x" * 300
    lines = [qa(), qa(a="one"), "not json", qa(a=long_text), qa(image="missing.png"), qa(a="two")]
    return make_data(tmp_path, lines)


def config_for(tmp_path, **flags):
    """The run configuration of the tiny model at SIZE px tiles (4 px patches) with ``flags``."""
    from megatron.training.flags import build_parser
    from megatron.training.specs import run_config

    flags = build_parser().parse_args(["--data-cache-dir", str(tmp_path / "cache"), "--seq-length", "200",
                                       "--image-size", str(SIZE), "--patch-size", "4",
                                       *sum(([f"--{k}"] if v is True else [f"--{k}", str(v)]
                                             for k, v in flags.items()), [])])
    return run_config(flags, 1)


def test_default_still_stops_on_bad_records(tmp_path):
    meta, ann = bad_data(tmp_path)
    with pytest.raises(DataValidationError) as e:
        RecordDataset(meta, TOK, TileImages(SIZE, TPT, 6), 200)
    assert str(e.value).startswith("3 problem(s)")
    assert "--truncate-long-samples" in str(e.value) and "--skip-bad-samples" in str(e.value)


def test_skip_bad_samples_leaves_them_out_and_reports_them(tmp_path, capsys):
    from megatron.training.setup import build_dataset, skipped_report_path

    meta, ann = bad_data(tmp_path)
    config = config_for(tmp_path, **{"skip-bad-samples": True, "max-skipped-fraction": 0.5})
    ds = build_dataset(config, config.model.spec, TOK, meta)
    assert len(ds) == 3
    assert [int(line) for line in ds.scan.rec_line] == [1, 2, 6]  # the good records, in file order
    report = skipped_report_path(config.data, meta)
    lines = open(report).read().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"{ann}:3: not valid JSON")
    assert lines[1].startswith(f"{ann}:4: sample is") and "> max_seq_length 200" in lines[1]
    assert lines[2].startswith(f"{ann}:5: image file not found")
    out = capsys.readouterr().out
    assert f"> data: 3 bad record(s) of {meta} skipped" in out and report in out
    # the scan cache keeps the list: a restart reports the same records without scanning again
    os.remove(report)
    again = build_dataset(config, config.model.spec, TOK, meta)
    assert len(again) == 3 and open(report).read().splitlines() == lines
    assert "is read from" in capsys.readouterr().out
    # ... and a run without the flag does not take that cached scan: it stops
    with pytest.raises(DataValidationError):
        build_dataset(config_for(tmp_path), config.model.spec, TOK, meta)


def test_skipping_more_than_the_threshold_stops_before_training(tmp_path):
    """A wrong image root: 5 of the 6 records name missing images; --skip-bad-samples alone (threshold 0.1)
    refuses to train on what is left, naming the count, the flag and the first problem."""
    from megatron.training.setup import build_dataset, skipped_report_path

    meta, ann = make_data(tmp_path, [qa(image="elsewhere/a.png")] * 5 + [qa(image=None, q="Hi?")])
    config = config_for(tmp_path, **{"skip-bad-samples": True})
    with pytest.raises(DataValidationError) as e:
        build_dataset(config, config.model.spec, TOK, meta)
    assert str(e.value) == (
        f"--skip-bad-samples: 5 of the 6 records of {meta} fail the scan (83%), more than --max-skipped-fraction 0.1: "
        f"the data is more likely wrong (an image root?) than a few records bad; the first: {ann}:1: image file not "
        f"found: {tmp_path / 'elsewhere' / 'a.png'} (all in {skipped_report_path(config.data, meta)})")
    lenient = config_for(tmp_path, **{"skip-bad-samples": True, "max-skipped-fraction": 0.9})
    kept = build_dataset(lenient, lenient.model.spec, TOK, meta)
    assert len(kept) == 1


def test_skip_lists_of_two_files_of_one_name_are_kept_apart(tmp_path):
    from megatron.training.setup import build_dataset, skipped_report_path

    config = config_for(tmp_path, **{"skip-bad-samples": True, "max-skipped-fraction": 0.5})
    metas = [make_data(tmp_path / part, [qa(), "not json", qa(a=part)])[0] for part in ("train", "valid")]
    assert os.path.basename(metas[0]) == os.path.basename(metas[1])
    reports = [skipped_report_path(config.data, meta) for meta in metas]
    assert reports[0] != reports[1]
    for meta in metas:
        build_dataset(config, config.model.spec, TOK, meta)
    for meta, report in zip(metas, reports):
        assert open(report).read().startswith(f"{os.path.dirname(meta)}/ann.jsonl:2: not valid JSON")


def test_data_path_without_a_validation_set_says_there_is_no_evaluation(tmp_path, capsys):
    from megatron.training.setup import build_datasets

    meta, _ = make_data(tmp_path, [qa()])
    config = config_for(tmp_path, **{"data-path": meta})
    train, valid = build_datasets(config, config.model.spec, TOK)
    assert valid is None and len(train) == 1
    assert (f"> no evaluation: --eval-interval 200 needs --valid-data-path (--data-path {meta} has no held-out "
            "split)") in capsys.readouterr().out


def test_a_data_path_that_is_a_folder_is_named(tmp_path):
    from megatron.training.flags import ArgumentError
    from megatron.training.setup import data_paths

    with pytest.raises(ArgumentError, match=f"--data-path {tmp_path} is a folder: give a meta JSON or an annotation "
                                            "JSONL file"):
        config = config_for(tmp_path, **{"data-path": str(tmp_path)})
        data_paths(config.data, config.model.spec)


def test_skip_bad_samples_with_nothing_left_is_an_error(tmp_path):
    meta, ann = make_data(tmp_path, ["not json", qa(image="missing.png")])
    with pytest.raises(DataValidationError, match="every record has a problem"):
        RecordDataset(meta, TOK, TileImages(SIZE, TPT, 6), 200, skip_bad=True)


@pytest.mark.filterwarnings("ignore:.*truncated to max_seq_length:UserWarning")
def test_truncate_long_samples_flag(tmp_path):
    from megatron.training.setup import build_dataset

    meta, ann = bad_data(tmp_path)
    config = config_for(tmp_path, **{"truncate-long-samples": True, "skip-bad-samples": True, "max-skipped-fraction": 0.5})
    ds = build_dataset(config, config.model.spec, TOK, meta)
    assert len(ds) == 4  # the long record is cut, not left out
    tokens, _ = ds.sample_lengths()
    assert tokens.max() == 200 and ds.scan.num_truncated == 1


def test_load_of_a_file_is_an_error(tmp_path):
    f = tmp_path / "latest_checkpointed_iteration.txt"
    f.write_text("4")
    run = run_single(["--load", str(f), "--train-iters", "1"], tmp_path)
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: --load {f} is a file: give the checkpoint folder (the one holding "
        "latest_checkpointed_iteration.txt and iter_N/)")
