import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the published OmniBal stats (ai2d, chartqa, docvqa) shipped with the repository, gzip-compressed
STATS_DIR = ROOT / "data" / "omnibal_stats"
STATS_FILES = sorted(STATS_DIR.glob("*.json.gz"))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One folder for the built-in digits dataset, shared by every training run of the session."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def megatron_world():
    """A world of one (gloo) with megatron's model-parallel groups, inside the CPU patches, for building
    and running stages in-process; torn down (patches removed) after the module."""
    import os

    import torch.distributed as dist

    from megatron.training import cpu_compat
    from megatron.training.initialize import initialize_distributed, set_seeds

    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 1, 1)
        set_seeds(0)
        yield
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
