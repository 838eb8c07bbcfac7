import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One folder for the built-in digits dataset, shared by every training run of the session."""
    return tmp_path_factory.mktemp("data_cache")
