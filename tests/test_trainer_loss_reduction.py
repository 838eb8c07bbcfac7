"""--loss-reduction square/sample and --vision-drop-path-rate under torchrun: one global batch of 8 samples
split as DP1 x micro-batch 4, DP2 x micro-batch 2 and PP2 (the ViT split over both stages) x micro-batch 2
gives the serial run's losses (1e-5 relative) and gradient norms; the closed forms against per-sample losses
are tests/test_loss_reduction.py's."""
import pytest

from launch import run_training

pytestmark = pytest.mark.slow

BASE = ["--train-iters", "3", "--global-batch-size", "8", "--lr-warmup-iters", "0", "--lr", "2e-3",
        "--log-interval", "1", "--seed", "7", "--eval-interval", "0"]
SPLITS = [  # (processes, flags): DP1 x mbs 4 is the serial reference
    (1, ["--micro-batch-size", "4"]),
    (2, ["--micro-batch-size", "2"]),  # DP2
    (2, ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PEt*4L"]),
]


@pytest.mark.parametrize("flags", [["--loss-reduction", "square", "--vision-drop-path-rate", "0.3"],
                                   ["--loss-reduction", "sample"]], ids=["square-droppath", "sample"])
def test_reduction_does_not_depend_on_the_split(tmp_path, data_cache, flags):
    runs = []
    for nproc, split in SPLITS:
        records, _ = run_training(nproc, BASE + flags + split + ["--data-cache-dir", str(data_cache)], tmp_path,
                                  f"split{len(runs)}")
        assert [r["iteration"] for r in records] == [1, 2, 3]
        assert all(r["global batch size"] == 8 for r in records)
        runs.append(records)
    serial = runs[0]
    for other in runs[1:]:
        for a, b in zip(other, serial):
            assert abs(a["lm loss"] - b["lm loss"]) <= 1e-5 * abs(b["lm loss"]), (other, serial)
            assert abs(a["grad norm"] - b["grad norm"]) <= 1e-4 * abs(b["grad norm"]), (other, serial)
