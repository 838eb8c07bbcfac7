"""Training from Energon datasets (slow): photos (JPEG/PNG crops of real photographs) and H.264 clips converted by
``omnibal data to-energon`` train every family at PP2 with online ISF, and from the JSONL at PP2 with offline ISF,
every sample once per epoch in each form (sample ids counted in the JSON log); at PP2 x DP2 online ISF's per-step
DistRatio in predicted time is within max(2 x offline ISF's, 0.02) on the same data as JSONL, and a run killed with
SIGKILL resumes with the uninterrupted run's samples and losses; a bad sample stops the run naming its shard and
key, and --skip-bad-samples trains on the rest."""
from __future__ import annotations

import json
import re

import pytest

from launch import run_single, run_training

pytest.importorskip("transformers")
pytest.importorskip("av")
pytest.importorskip("megatron.energon")
import energon_media  # noqa: E402
import hf_tiny  # noqa: E402
import hf_tiny_qwen as q25  # noqa: E402
import hf_tiny_qwen3_5 as q35  # noqa: E402
import hf_tiny_qwen3_vl as q3  # noqa: E402

from megatron.vlm.data.energon.convert import to_energon  # noqa: E402

pytestmark = pytest.mark.slow

QWEN_VIDEO = {"size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 16}, "patch_size": 16}
FAMILIES = {  # the folder maker, its video budget (None: the family's own), the layout converted to, its flags
    "internvl": (lambda folder: hf_tiny.make_tiny_with_tokenizer(folder, seed=3, vit="rms-qknorm", text="qwen2"),
                 None, "omnibal", ["--max-num-tiles", "2"]),
    "qwen2_5_vl": (lambda folder: q25.make_tiny_with_tokenizer(folder, seed=3),
                   {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}}, "bridge",
                   ["--max-pixels", str(28 * 28 * 8), "--pipeline-layout", "Iv*2|v*2PEt*2L"]),
    "qwen3_vl": (lambda folder: q3.make_tiny_with_tokenizer(folder, seed=3), QWEN_VIDEO, "omnibal",
                 ["--max-pixels", str(32 * 32 * 8), "--pipeline-layout", "Iv*2|v*2PEt*3L"]),
    "qwen3_5": (lambda folder: q35.make_tiny_with_tokenizer(folder, seed=3), QWEN_VIDEO, "bridge",
                ["--max-pixels", str(32 * 32 * 8), "--pipeline-layout", "Iv|vPEt*5L"])}


def served(records: list[dict]) -> list[list[int]]:
    """Each data-parallel rank's sample ids in the order it trained them (``--log-sample-ids``)."""
    ranks = len(records[0]["sample ids"])
    return [[i for r in records for mb in r["sample ids"][k] for i in mb] for k in range(ranks)]


def first_epoch(ids: list[int]) -> list[int]:
    """``ids`` up to (not including) the first one seen again."""
    seen = []
    for i in ids:
        if i in seen:
            return seen
        seen.append(i)
    raise AssertionError(f"no sample came twice in {len(ids)}: the run did not finish an epoch")


def each_once_per_epoch(records: list[dict], num_samples: int) -> None:
    """Every data-parallel rank serves its whole share of an epoch before any sample again, and the shares are the
    dataset, disjoint."""
    shares = [first_epoch(ids) for ids in served(records)]
    union = [i for share in shares for i in share]
    assert len(union) == len(set(union)) == num_samples, [len(s) for s in shares]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_from_jsonl_and_energon_at_pp2_with_isf(family, tmp_path):
    make, budget, layout, family_flags = FAMILIES[family]
    make(tmp_path / "hf")
    if budget is not None:
        (tmp_path / "hf" / "video_preprocessor_config.json").write_text(json.dumps(budget))
    data = energon_media.write_data(tmp_path / "media")
    done = to_energon(data, str(tmp_path / "energon"), layout=layout, samples_per_shard=3)
    n = sum(done.samples.values())
    evaluate = []
    if family == "internvl":  # validation: the 'val' split converted into the same folder
        to_energon(data, str(tmp_path / "energon"), layout=layout, split="val", samples_per_shard=4)
        evaluate = ["--valid-data-path", done.path, "--eval-interval", "6", "--eval-iters", "1"]
    common = ["--hf-checkpoint", str(tmp_path / "hf"), "--video-max-frames", "4", "--pipeline-model-parallel-size", "2",
              "--omnibal-isf", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
              "--lr-warmup-iters", "1", "--seq-length", "512", "--num-workers", "1",
              "--data-cache-dir", str(tmp_path / "cache"), "--seed", "5", "--log-sample-ids", *family_flags]
    flags = [*common, "--data-path", done.path, "--omnibal-isf-buffer", "8", "--train-iters", "12",
             *(evaluate or ["--eval-interval", "0"])]
    records, out = run_training(2, flags, tmp_path, family)
    assert "online ISF (buffer 8 samples per rank)" in out
    each_once_per_epoch(records, n)
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    if evaluate:
        assert len(re.findall(r"validation iteration +(?:6|12)/ +12 \| lm loss: \d", out)) == 2, out[-3000:]
    # the same records as JSONL (offline ISF over the scanned records): every sample once per epoch there too
    jsonl = [*common, "--data-path", data, "--train-iters", "6", "--eval-interval", "0"]
    records, _ = run_training(2, jsonl, tmp_path, family + "_jsonl")
    each_once_per_epoch(records, n)


def test_online_isf_balances_dp_ranks_and_a_killed_run_resumes_exactly(tmp_path):
    """Qwen2.5-VL at PP2 x DP2 (4 processes) on the same photos and clips: offline ISF over the JSONL, online ISF over
    its Energon conversion (loader workers); the online DistRatio in predicted time within max(2 x offline's,
    0.02); each sample once per epoch; SIGKILL before iteration 7, then a resume from the last checkpoint (6's, with
    samples in the ISF buffer): the same samples with the same losses; the checkpoint at data-parallel size 1 is
    refused by name."""
    q25.make_tiny_with_tokenizer(tmp_path / "hf", seed=3)
    data = energon_media.write_data(tmp_path / "media", shapes=((0, 0, 640, 427), (100, 50, 420, 410),
                                                                (0, 200, 640, 300), (300, 0, 380, 427)))
    lines = open(data).read().splitlines()  # photos first, then the clips: interleaved from both ends, so that each
    half = len(lines) // 2                  # rank's shards (Energon gives a rank a contiguous part) mix both kinds
    mixed = [x for k in range(half) for x in (lines[k], lines[-1 - k])] + lines[half:len(lines) - half]
    open(data, "w").write("".join(x + "\n" for x in mixed))
    done = to_energon(data, str(tmp_path / "energon"), samples_per_shard=2)
    n = sum(done.samples.values())
    common = ["--hf-checkpoint", str(tmp_path / "hf"), "--max-pixels", str(28 * 28 * 12), "--video-max-frames", "4",
              "--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PEt*2L", "--omnibal-isf",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
              "--eval-interval", "0", "--seq-length", "512", "--data-cache-dir", str(tmp_path / "cache"),
              "--seed", "5", "--train-iters", "10", "--log-sample-ids"]
    offline, _ = run_training(4, common + ["--data-path", data], tmp_path, "offline")
    online_flags = common + ["--data-path", done.path, "--num-workers", "1", "--omnibal-isf-buffer", "6",
                             "--save-interval", "3"]
    online, out = run_training(4, online_flags + ["--save", str(tmp_path / "ckpt")], tmp_path, "online")

    def mean(records, key):
        return sum(r[key] for r in records) / len(records)

    for key in ("dist ratio vit time", "dist ratio llm time"):
        assert mean(online, key) <= max(2 * mean(offline, key), 0.02), (key, mean(online, key), mean(offline, key))
    each_once_per_epoch(online, n)
    # SIGKILL of rank 1 before iteration 7, then a resume from the last checkpoint (6's, with samples in the ISF
    # buffer); the kill takes the 4-rank pool down and the resume starts it again
    again = ["--save", str(tmp_path / "again"), "--load", str(tmp_path / "again")]
    killed, out = run_training(4, online_flags + again, tmp_path, "killed", expect_ok=False, kill_in_pool=True,
                               env={"OMNIBAL_FAULT": "train:7"})
    assert "died" in out and [r["iteration"] for r in killed] == [1, 2, 3, 4, 5, 6], out[-3000:]
    resumed, out = run_training(4, online_flags + again, tmp_path, "resumed")
    assert "loaded checkpoint of iteration 6" in out
    assert [r["iteration"] for r in resumed] == [7, 8, 9, 10]
    for r, want in zip(killed + resumed, online):
        assert r["sample ids"] == want["sample ids"], r["iteration"]
        assert r["lm loss"] == want["lm loss"], r["iteration"]
    # the checkpoint's LR schedule kept (--train-iters 12 changes it, which is refused first otherwise)
    dp1 = online_flags + ["--load", str(tmp_path / "again"), "--save", str(tmp_path / "dp1"), "--train-iters", "12",
                          "--use-checkpoint-opt_param-scheduler"]
    _, out = run_training(2, dp1, tmp_path, "dp1", expect_ok=False)
    assert "Energon restores a loader only with the same data-parallel size" in out and "Traceback" not in out


def test_a_bad_sample_stops_the_run_naming_it_and_skip_bad_samples_trains_on_the_rest(tmp_path):
    """The built-in tiny model in a world of one: a corrupt image member stops the run with one line naming its
    shard and key (exit 1, no traceback); --skip-bad-samples trains, prints and lists it."""
    from test_energon_data import corrupt_member, small_data

    to_energon(small_data(tmp_path / "media", 6), str(tmp_path / "en"), samples_per_shard=3)
    corrupt_member(tmp_path / "en", "s000-000000005", "img0.png", b"garbage" * 30)
    flags = ["--data-path", str(tmp_path / "en"), "--train-iters", "4", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--eval-interval", "0", "--seq-length", "512",
             "--data-cache-dir", str(tmp_path / "cache")]
    proc = run_single(flags, tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: train-shard-000001.tar/s000-000000005: cannot decode image member img0.png" in proc.stderr
    proc = run_single(flags + ["--skip-bad-samples", "--json-log", str(tmp_path / "log.jsonl"), "--log-sample-ids"],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "> data: skipped train-shard-000001.tar/s000-000000005" in proc.stdout
    report = (tmp_path / "cache" / "skipped" / "en.txt").read_text().splitlines()
    assert len(report) == 1 and report[0].startswith("train-shard-000001.tar/s000-000000005: ")
    records = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    each_once_per_epoch([r for r in records if not r.get("prefix")], 5)
