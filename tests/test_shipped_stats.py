"""The OmniBal stats shipped in data/omnibal_stats/ (gzip-compressed published JSON) and the loader's
transparent gzip reading: what the README, the scripts and the tests use is in the repository."""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import re

import numpy as np
import pytest

from conftest import ROOT, STATS_DIR, STATS_FILES
from omnibal_ext.cli import data_files
from omnibal_ext.data.stats import StatsError, load_stats, load_stats_file

SAMPLES = {"ai2d_train_12k_wh_token_lengths.json.gz": 12413, "chartqa_train_18k_wh_token_lengths.json.gz": 18317,
           "docvqa_train_10k_wh_token_lengths.json.gz": 10211}
# the developers' copy of the originals beside the checkout; a clean clone has none
ORIGINALS = ROOT.parent / "shared" / "data" / "internvl_sft_stats"


def test_shipped_stats_load_with_their_checksums():
    assert [f.name for f in STATS_FILES] == sorted(SAMPLES)
    readme = (STATS_DIR / "README.md").read_text()
    assert "github.com/ModelTC/OmniBal" in readme and "Apache" in readme
    assert "Apache License" in (STATS_DIR / "LICENSE").read_text()
    for f in STATS_FILES:
        raw = gzip.decompress(f.read_bytes())
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{f.name}`"))
        assert hashlib.sha256(raw).hexdigest() in row, f.name  # the published bytes, as the README records
        vit, tokens = load_stats_file(f)
        records = json.loads(raw)
        assert len(vit) == len(records) == SAMPLES[f.name]
        assert vit.tolist() == [r["vit_num"] for r in records]
        assert tokens.tolist() == [r["token_num"] for r in records]
    assert len(load_stats(STATS_FILES)) == sum(SAMPLES.values())


@pytest.mark.skipif(not ORIGINALS.is_dir(), reason=f"no original stats to compare with at {ORIGINALS} "
                    "(a clean clone has none; the shipped files are checked against their sha256 instead)")
def test_shipped_stats_equal_the_originals():
    for f in STATS_FILES:
        original = ORIGINALS / f.name[:-len(".gz")]
        assert gzip.decompress(f.read_bytes()) == original.read_bytes(), f.name
        for a, b in zip(load_stats_file(f), load_stats_file(original)):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_gzip_stats_read_like_plain_ones(tmp_path):
    records = [{"vit_num": k % 4, "token_num": 30 + 7 * k} for k in range(50)]
    plain, packed = tmp_path / "a.json", tmp_path / "b.json.gz"
    plain.write_text(json.dumps(records))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for a, b in zip(load_stats_file(plain), load_stats_file(packed)):
        assert np.array_equal(a, b)
    assert data_files([str(tmp_path)], "--stats") == [str(plain), str(packed)]  # a folder: both kinds, sorted
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(packed.read_bytes()[:-20])
    with pytest.raises(StatsError, match="cut.json.gz: cannot read stats file"):
        load_stats_file(cut)
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(gzip.compress(b"[{"))
    with pytest.raises(StatsError, match="bad.json.gz: not valid JSON"):
        load_stats_file(bad)


def test_readme_data_paths_are_in_the_repository():
    """Every data/... path or glob in the README and the docs pages names files of the repository (no ../shared)."""
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    assert "../shared" not in readme
    paths = set(re.findall(r"(?<![\w/.])data/omnibal_stats/[\w*.]*", readme))
    assert "data/omnibal_stats/*.json.gz" in paths
    for p in paths:
        assert glob.glob(str(ROOT / p)), p
