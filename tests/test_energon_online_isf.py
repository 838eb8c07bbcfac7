"""The online ISF drop-in on Energon's own loader (megatron/vlm/data/energon/{task_encoder,balancing}.py), through
its documented example: a plain PyTorch script, two gloo ranks, loader workers, a WebDataset written here and
prepared with Energon's own preparation API.  One launch: an epoch, a save mid-epoch, a resume in fresh loaders."""
from __future__ import annotations

import io
import json
import math
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402

SAMPLES, BUFFER, RESUME_AT = 160, 32, 6


def recount(folder: Path) -> dict[str, tuple[float, float]]:
    """Each sample's predicted (ViT, LLM) seconds recounted from the tars: the image's size from its decoded pixels
    (not its header), the caption's words, the example's stated rates and its 28 px items (4 per LLM token)."""
    from PIL import Image

    costs = {}
    for tar_path in sorted(folder.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in members.items():
            if not name.endswith(".jpg"):
                continue
            key = name[:-4]
            width, height = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).shape[1::-1]
            items = math.ceil(width / 28) * math.ceil(height / 28)
            tokens = len(members[key + ".txt"].decode().split()) + items // 4
            costs[key] = (2e-5 * items + 2e-9 * items ** 2, 6e-5 * tokens + 3e-9 * tokens ** 2)
    return costs


def step_dist_ratio(times: list[float]) -> float:
    t = np.asarray(times)
    return float((t.max() - t).sum() / (t.max() * len(t)))


@pytest.mark.slow
def test_example_two_ranks_with_workers_every_sample_once_balanced_and_resumed(tmp_path):
    from energon_online_isf import make_demo_dataset

    data = tmp_path / "demo"
    make_demo_dataset(str(data), samples=SAMPLES, shards=4)
    cmd = [str(ROOT / "examples" / "energon_online_isf.py"), "--data", str(data), "--workers", "2",
           "--buffer", str(BUFFER), "--record", str(tmp_path / "rec"), "--resume-check", str(RESUME_AT)]
    rc, out = benchlib.launch_ranks(cmd, 2, tmp_path, benchlib.trainer_env(), timeout=900)
    assert rc == 0, out[-4000:]
    runs = [json.loads((tmp_path / f"rec.{r}.json").read_text()) for r in (0, 1)]
    costs = recount(data)

    # every sample of the dataset served exactly once in the epoch (over both ranks), none in two groups
    served = [k for run in runs for step in run["steps"] for g in step["groups"] for k in g["keys"]]
    assert sorted(served) == sorted(costs)
    # the same number of steps on both ranks (the all-gather keeps them in step)
    assert len(runs[0]["steps"]) == len(runs[1]["steps"])

    # the ranks' groups match in predicted time, recounted from the samples (steady steps: no stream ended yet)
    steady = [k for k, (a, b) in enumerate(zip(runs[0]["steps"], runs[1]["steps"]))
              if not (a["ended"] or b["ended"])]
    assert len(steady) >= 10
    for which in (0, 1):  # ViT, LLM
        ratios = [step_dist_ratio([sum(costs[k][which] for g in run["steps"][s]["groups"] for k in g["keys"])
                                   for run in runs]) for s in steady]
        assert np.mean(ratios) <= 0.01
        # the costs the balancer carried are the recounted ones
        for run in runs:
            for s in steady:
                for g in run["steps"][s]["groups"]:
                    carried = g["vit_s" if which == 0 else "llm_s"]
                    assert carried == pytest.approx([costs[k][which] for k in g["keys"]], rel=1e-9)
    # random groups of the same sizes from the same data are far less balanced
    rng = np.random.default_rng(0)
    sizes = [len(g["keys"]) for s in steady for g in runs[0]["steps"][s]["groups"]]
    keys = list(costs)
    random_ratios = [step_dist_ratio([sum(costs[k][1] for k in rng.choice(keys, n, replace=False)) for _ in (0, 1)])
                     for n in sizes]
    assert np.mean(random_ratios) > 5 * 0.01

    # resumed from the state saved after step RESUME_AT in fresh loaders: the same remaining steps
    for run in runs:
        assert run["resumed"] == run["steps"][RESUME_AT:]
