"""The interleaved pipeline's pieces without processes: flags and their checks, the layout's chunks per rank,
the loader fanned out to chunks, the activation peak in the interleaved order."""
import pytest
import torch

from megatron.training.arguments import parse_flags
from megatron.training.specs import run_config
from megatron.training.interleaved import chunk_data, interleaved_peak
from omnibal_ext.errors import UserError
from omnibal_ext.model.layout import parse_layout
from omnibal_ext.model.simulate import schedule_order
from omnibal_ext.model.units import get_preset

LAYOUT = "Iv*2|v*2PE|t*2|t*2L"


def test_v_follows_the_layout_and_the_flag_is_checked_against_it():
    args = parse_flags(["--pipeline-model-parallel-size", "2", "--pipeline-layout", LAYOUT], world_size=2)
    plan = run_config(args, 2)
    assert plan.parallel.virtual_pipeline_size == 2
    layout = parse_layout(LAYOUT, get_preset("tiny"), 2, vpp=None)
    assert [layout.rank_stages(r, 2) for r in range(2)] == [[0, 2], [1, 3]]
    args = parse_flags(["--pipeline-model-parallel-size", "2", "--pipeline-layout", LAYOUT,
                       "--virtual-pipeline-model-parallel-size", "2"], world_size=2)
    assert run_config(args, 2).parallel.virtual_pipeline_size == 2
    # no layout: Megatron's default over V x PP stages
    args = parse_flags(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"], world_size=2)
    assert run_config(args, 2).parallel.virtual_pipeline_size == 2


@pytest.mark.parametrize("argv,world,match", [
    (["--pipeline-model-parallel-size", "2", "--pipeline-layout", LAYOUT, "--virtual-pipeline-model-parallel-size", "3"],
     2, r"4 stages given but --pipeline-model-parallel-size is 2 x --virtual-pipeline-model-parallel-size 3"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PE|t*4L"], 2, r"interleaved layout has V x 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-layout", LAYOUT, "--global-batch-size", "12"], 2,
     r"micro-batches per pipeline \(3 = .*multiple of --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-layout", "Iv|v|v|v|P|E|t*2|t*2L", "--micro-batch-size", "4",
      "--global-batch-size", "8"], 4, r"micro-batches per pipeline \(2 = "),
    (["--virtual-pipeline-model-parallel-size", "2"], 1, r"needs --pipeline-model-parallel-size >= 2"),
    (["--virtual-pipeline-model-parallel-size", "0", "--pipeline-model-parallel-size", "2"], 2, r"must be >= 1"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", "--omnibal-recompute", "auto"],
     2, r"--omnibal-recompute auto .* does not support"),
], ids=["flag-vs-layout", "not-a-multiple", "microbatches-not-multiple", "microbatches-below-pp", "pp1", "zero",
        "recompute-auto"])
def test_interleaving_errors_are_one_line(argv, world, match):
    with pytest.raises(UserError, match=match):
        parse_flags(argv, world_size=world)


def test_chunk_data_serves_every_chunk_every_micro_batch_once():
    loads = []

    def stream():
        for i in range(100):
            loads.append(i)
            yield {"i": i}

    it = stream()
    views = chunk_data(it, 2)
    # the interleaved order at PP 2, 4 micro-batches: chunk 0 reads 0, 1, chunk 1 reads 0, 1, chunk 0 reads 2, 3 ...
    got = [[], []]
    for kind, mb, chunk in schedule_order(2, 0, 4, 2):
        if kind == "fwd":
            got[chunk].append(next(views[chunk])["i"])
    assert got == [[0, 1, 2, 3], [0, 1, 2, 3]] and loads == [0, 1, 2, 3]
    assert not views[0].shared.buffer  # every micro-batch read by both chunks is dropped
    assert chunk_data(it, 1) is it


def test_interleaved_peak_replays_the_schedule():
    pp, vpp, m, rank = 2, 2, 4, 0
    fwd = [op for op in schedule_order(pp, rank, m, vpp) if op[0] == "fwd"]
    sizes = {(mb, c): 10 ** c * (mb + 1) for _, mb, c in fwd}  # chunk 1 ten times chunk 0
    measured = [sizes[(mb, c)] for _, mb, c in fwd]
    # brute force: the live set after every operation
    live, peak = set(), 0
    for kind, mb, c in schedule_order(pp, rank, m, vpp):
        (live.add if kind == "fwd" else live.discard)((mb, c))
        peak = max(peak, sum(sizes[k] for k in live))
    assert interleaved_peak(measured, rank, pp, vpp) == peak
    assert peak > max(sizes.values())  # several chunk micro-batches alive at once
