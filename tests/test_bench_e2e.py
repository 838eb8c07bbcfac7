"""scripts/bench_e2e.py --quick: the four rows are produced and each trained the same tokens (its ``main`` here, its
runs in the worker pools); --repeats: the rows run again alternating, with the first run's layout and plan, and each
row's speed pools its runs."""
import json
import sys

import pytest

from conftest import ROOT

KEYS = {"name", "ms_per_iter", "samples_per_s", "tokens_per_s", "speedup", "predicted_ms_per_iter", "tokens_seen"}


@pytest.mark.bench
def test_bench_e2e_quick(tmp_path, pooled_benchlib):
    import bench_e2e

    out = tmp_path / "e2e.json"
    bench_e2e.main(["--quick", "--repeats", "1", "--json", str(out), "--out", str(tmp_path / "runs")])
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [r["name"] for r in rows] == ["baseline", "+data", "+model", "+memory"]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["ms_per_iter"] > 0 and r["samples_per_s"] > 0 and r["predicted_ms_per_iter"] > 0
        assert r["samples_seen"] == res["samples"]  # exactly one epoch
    # the same samples, so the same tokens: the dataset's total, counted independently from its lengths
    from megatron.vlm.data import RecordDataset, TileImages
    from megatron.vlm.data.tokenizer import build_tokenizer

    ds = RecordDataset(res["data"]["meta"], build_tokenizer(None), TileImages(image_size=32, tokens_per_tile=4,
                                                                              max_num_tiles=6))
    total = int(ds.sample_lengths()[0].sum())
    assert len(ds) == res["samples"]
    assert {r["tokens_seen"] for r in rows} == {total}
    # one run of every row (repeats, their alternation and pooling: test_repeats_alternate_and_pool_their_speed)
    assert all(r["runs"] == 1 and r["tokens_seen_per_run"] == [total] for r in rows)
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert rows[1]["pad_ratio"] == 0.0 and rows[0]["pad_ratio"] > 0  # ISF packs, random batching pads
    assert rows[3]["recompute"] != "full" and rows[2]["layout"] == rows[3]["layout"]
    # the budget is a device on which the baseline cannot run without recompute; every row fits it
    ref = res["budget_reference"]
    assert ref["tokens_seen"] == total
    assert res["budget_bytes"] < max(ref["total_bytes_per_stage"])
    assert all(r["peak_total_bytes"] <= res["budget_bytes"] for r in rows), [r["peak_total_bytes"] for r in rows]
    assert (tmp_path / "runs" / "e2e.png").stat().st_size > 0


def test_qwen_bench_model_counts_what_the_reader_makes():
    """--model qwen2.5-vl: a data image (a stats tile) of ``image_px`` is, by the family's reader at its default
    pixel limits, ``items_per_image`` patches and ``tokens_per_image`` LLM tokens, one window and one image segment
    of ``segment_tokens`` patches."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_e2e

    from megatron.vlm.lineages.qwen.data import PatchImages

    model = bench_e2e.MODELS["qwen2.5-vl"]
    spec = bench_e2e.spec_of(model)
    rule = PatchImages()
    patches = rule.items(model.image_px, model.image_px, 1)
    assert patches == model.items_per_image == model.segment_tokens
    assert rule.image_tokens(patches) == model.tokens_per_image
    assert spec.vision.window_size == model.image_px  # one window per image
    hetero = bench_e2e.spec_of(bench_e2e.MODELS["internvl"])
    assert (hetero.vision.image_size, hetero.tokens_per_tile) == (32, 4) == (
        bench_e2e.MODELS["internvl"].image_px, bench_e2e.MODELS["internvl"].tokens_per_image)


def test_qwen3_bench_model_counts_what_the_reader_makes():
    """--model qwen3-vl: a data image of ``image_px``, read by the family's reader with the bench's pixel flags
    (transformers' smart_resize within them), is ``items_per_image`` patches (one full-attention segment of
    ``segment_tokens``) and ``tokens_per_image`` LLM tokens."""
    from types import SimpleNamespace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_e2e

    from megatron.vlm.lineages.qwen.qwen3_vit.data import image_rule

    model = bench_e2e.MODELS["qwen3-vl"]
    spec = bench_e2e.spec_of(model)
    args = SimpleNamespace(min_pixels=model.flags["--min-pixels"], max_pixels=model.flags["--max-pixels"])
    rule = image_rule(args, spec, None)
    patches = rule.items(model.image_px, model.image_px, 1)
    h, w = smart_resize(model.image_px, model.image_px, factor=32, min_pixels=args.min_pixels,
                        max_pixels=args.max_pixels)
    assert patches == (h // 16) * (w // 16) == model.items_per_image == model.segment_tokens
    assert rule.image_tokens(patches) == model.tokens_per_image


def test_repeats_alternate_and_pool_their_speed(monkeypatch, tmp_path):
    """bench_e2e.repeat_rows with benchlib's launcher replaced by a fake: the repeats run the rows in turn with
    their flags, a row's pooled speed is that of its runs' steady iterations together (by hand), and a repeat
    that ran another layout or plan than the first run is an error."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_e2e
    import benchlib as bl

    calls, layouts = [], {}
    ms = {"baseline": [[100, 10, 30], [90, 20, 50]], "+data": [[80, 5, 7], [70, 9, 11]],
          "+model": [[60, 4, 4], [60, 6, 6]], "+memory": [[50, 3, 5], [50, 1, 2]]}

    def record(t):
        return {bl.ITER_KEY: t, "global batch size": 8, "tokens/s": 64e3 / t, "images/s": 4000.0 / t}

    def fake_run(flags, workdir, name, nproc=2, **_):
        row, rep = flags[0], len([c for c in calls if c[0] == flags[0]])
        calls.append((row, name, nproc))
        return bl.RunResult(name, flags, [record(t) for t in ms[row][rep]], None, "", 0.0, 0,
                            layouts.get(row, f"L-{row}"), "p" if row == "+memory" else None)

    monkeypatch.setattr(bl, "run_trainer", fake_run)
    flags = {name: [name] for name in bench_e2e.ROWS}
    first = {name: fake_run(flags[name], tmp_path, f"first_{name}", 2) for name in bench_e2e.ROWS}
    calls.clear()
    calls.extend((name, "first", 2) for name in bench_e2e.ROWS)
    runs = bench_e2e.repeat_rows(first, flags, 2, str(tmp_path), 2, warmup=1)
    assert [c[0] for c in calls[4:]] == list(bench_e2e.ROWS)  # one more pass, the rows in turn
    assert [c[1] for c in calls[4:]] == [f"e2e_rep_{n}_0" for n in bench_e2e.ROWS]
    pooled = bl.pooled_rates(runs["baseline"], warmup=1)
    assert pooled["runs"] == 2 and pooled["ms_per_iter"] == pytest.approx(25.0)  # median of 10, 30, 20, 50
    assert pooled["samples_per_s"] == pytest.approx(4 * 8 / 0.110)
    assert pooled["tokens_per_s"] == pytest.approx(4 * 64 / 0.110)  # 64 tokens an iteration
    assert bench_e2e.repeat_rows(first, flags, 1, str(tmp_path), 2, warmup=1) == {n: [first[n]] for n in bench_e2e.ROWS}
    calls.clear()
    layouts["+model"] = "another"
    with pytest.raises(RuntimeError, match=r"\+model: a repeat ran layout another"):
        bench_e2e.repeat_rows(first, flags, 2, str(tmp_path), 2, warmup=1)
