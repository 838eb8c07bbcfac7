"""The family conformance suite: the same checks on every registered family and on the tests' plugin family (the toy,
``tests/toy_family.py``), each on a tiny Hugging Face folder of the family (``family_kits``):

* logits: our model's (``scripts/hf_logits.py``) against transformers' at TP1, TP2 and PP2 (the family's own cut),
  tied and untied embeddings;
* the HF round trip: import -> export bit-identical, transformers loading the export to the source's logits;
* training from the folder equal to the serial run (losses and gradient norms, 3 iterations) at PP2, at TP2 with
  sequence parallelism and at CP2;
* each recipe: a frozen ViT at PP2 equal to the serial frozen run, its ViT untouched and its projector trained; LoRA
  on every target the family declares at PP2; ViT drop path at TP2 (its masks do not depend on TP) against the
  serial run with the same rate, which differs from the run without;
* a short fine-tune at PP2 under ISF: the loss falls; its first iteration again at TP2 from `omnibal hf import`'s
  weights-only checkpoint; `omnibal hf export` of the result loads in transformers, whose logits equal ours on it.

What a family skips, it declares: its ``Capabilities`` (``family_registry.undeclared``: sequence parallelism, CP,
LoRA targets, drop path), and for a comparison with transformers, the architecture its HF side writes
(``family_registry.transformers_reference``). The serial runs come from the session's canonical runs; every run
is a case of the worker pools.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sklearn")

import family_registry  # noqa: E402
import hf_check  # noqa: E402
import pool  # noqa: E402
from family_kits import KITS  # noqa: E402
from launch import ROOT, checkpoint_tensors, run_training  # noqa: E402

pytestmark = pytest.mark.slow

FAMILIES = family_registry.conformance_families()
RUN = ["--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "8"]  # no ISF: the same micro-batches
TP2 = ["--tensor-model-parallel-size", "2"]


def test_every_family_has_a_kit():
    assert sorted(KITS) == sorted(FAMILIES)


def pp2(family: str) -> list[str]:
    return ["--pipeline-model-parallel-size", "2", "--pipeline-layout", KITS[family].pp2]


def skip_unless_declared(family: str, check: str) -> None:
    why = family_registry.undeclared(family, check)
    if why:
        pytest.skip(why)


class Folders:
    """The session's tiny HF folders of each family, written once: ``models(f)``: {"untied"|"tied": (folder,
    transformers' model or None)}; ``training(f)``: the flags of a run from a folder with its tokenizer and data."""

    def __init__(self, factory, data_cache):
        self.factory, self.data_cache = factory, data_cache
        self._models, self._training = {}, {}

    def models(self, family: str) -> dict:
        if family not in self._models:
            kit, out = KITS[family], {}
            for seed, tie in ((0, False), (1, True)):
                folder = self.factory.mktemp(f"{family}_{'tied' if tie else 'untied'}") / "hf"
                out["tied" if tie else "untied"] = (folder, kit.make(folder, seed, tie))
            self._models[family] = out
        return self._models[family]

    def training(self, family: str) -> list[str]:
        if family not in self._training:
            kit = KITS[family]
            folder = self.factory.mktemp(f"{family}_training")
            kit.make_tuned(folder / "hf", 3)
            self._training[family] = [*kit.family_flags(), "--hf-checkpoint", str(folder / "hf"),
                                      *kit.data(folder, self.data_cache), *kit.run, *RUN]
        return list(self._training[family])


@pytest.fixture(scope="session")
def folders(tmp_path_factory, data_cache):
    return Folders(tmp_path_factory, data_cache)


def assert_equal_runs(got, want, family):
    kit = KITS[family]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        for key, tol in (("lm loss", kit.tol), ("grad norm", kit.grad_tol)):
            assert abs(g[key] - w[key]) <= tol * abs(w[key]), (key, g, w)


# ------------------------------------------------------------------------------------------------------- logits
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_at_tp1_tp2_pp2(family, folders, tmp_path):
    kit, models = KITS[family], folders.models(family)
    reference, why = family_registry.transformers_reference(models["untied"][0])
    if reference is None:
        pytest.skip(f"{family}: no transformers model to compare with: {why}")
    batch = kit.inputs()
    cases = [(pair, "tp1", 1, []) for pair in models] + [(pair, "tp2", 2, TP2) for pair in models]
    cases += [(pair, layout, 2, ["--pipeline-model-parallel-size", "2", "--pipeline-layout", layout])
              for pair, layout in kit.pp2_logits()]
    for k, (pair, name, nproc, flags) in enumerate(cases):
        folder, model = models[pair]
        want = kit.hf_logits(model, batch)
        got = hf_check.torchrun_logits([(folder, flags)], batch, tmp_path / f"case{k}", nproc)[0]
        assert got.shape == want.shape, (pair, name)
        diff = (got - want).abs().max().item()
        assert diff <= kit.logits_tol, (pair, name, diff)


# --------------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_round_trip(family, folders, tmp_path):
    """import -> export of the tied and the untied folder: the same tensors bit for bit and the same config.json;
    transformers loads each export to its source's logits."""
    kit, models = KITS[family], folders.models(family)
    sources = {pair: folder for pair, (folder, _) in models.items()}
    for pair, folder in sources.items():  # `omnibal hf import`, then `export` (the pool; a plugin imported first)
        omnibal(family, "hf", "import", "--hf-checkpoint", folder, "--save", tmp_path / pair / "ckpt")
        omnibal(family, "hf", "export", "--load", tmp_path / pair / "ckpt", "--out", tmp_path / pair / "out")
        out = tmp_path / pair / "out"
        hf_check.assert_same_tensors(folder, out, pair)
        source_config = hf_check.config_of(folder)
        assert hf_check.config_of(out) == {**source_config, "dtype": source_config.get("dtype", "float32")}, pair
    reference, _ = family_registry.transformers_reference(sources["untied"])
    if reference is not None:
        pairs = [(folder, tmp_path / pair / "out") for pair, folder in sources.items()]
        hf_check.assert_transformers_loads_the_same(reference, pairs, kit.inputs(), tmp_path)


# ----------------------------------------------------------------------------------------------------- training
PARALLEL = {"pp2": None, "tp2_sp": TP2 + ["--sequence-parallel"], "cp2": ["--context-parallel-size", "2"]}


@pytest.mark.parametrize("parallel", list(PARALLEL))
@pytest.mark.parametrize("family", FAMILIES)
def test_training_equals_serial(family, parallel, folders, canonical_runs, tmp_path):
    skip_unless_declared(family, parallel)
    flags = folders.training(family)
    serial = canonical_runs.records(1, flags)
    got, out = run_training(2, flags + (PARALLEL[parallel] or pp2(family)), tmp_path, parallel)
    assert "loaded weights from --hf-checkpoint" in out
    assert_equal_runs(got, serial, family)


# ------------------------------------------------------------------------------------------------------ recipes
def omnibal(family: str, *argv) -> None:
    """An `omnibal` command in a world of one of the pool (``plugin_cli``: the family's plugin imported first)."""
    args = ["--family-module", KITS[family].plugin] if KITS[family].plugin else []
    run = pool.run_case("plugin_cli:main", [*args, *map(str, argv)], 1, ROOT)
    assert run.returncode == 0, run.output[-3000:]


def imported(family: str, flags: list[str], workdir) -> dict:
    """The model tensors of `omnibal hf import` of the run's folder (a weights-only checkpoint of iteration 0)."""
    hf = flags[flags.index("--hf-checkpoint") + 1]
    omnibal(family, "hf", "import", "--hf-checkpoint", hf, "--save", workdir / "imported")
    return checkpoint_tensors(workdir / "imported" / "iter_0000000")


@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_vit_at_pp2_equals_serial(folders, canonical_runs, tmp_path, family):
    flags = folders.training(family) + ["--freeze-vit"]
    serial = canonical_runs.records(1, flags)
    got, out = run_training(2, flags + pp2(family) + ["--save", str(tmp_path / "ckpt")], tmp_path, "frozen")
    assert_equal_runs(got, serial, family)
    before, after = imported(family, flags, tmp_path), checkpoint_tensors(tmp_path / "ckpt" / "iter_0000003")
    assert set(before) == set(after)
    projector_parts = KITS[family].trains_with_projector
    vit = [k for k in before if k.startswith("vit.") and not any(p in k for p in projector_parts)]
    projector = [k for k in before if k.startswith("projector.") or any(p in k for p in projector_parts)]
    assert vit and all(torch.equal(before[k], after[k]) for k in vit)  # frozen: not a bit moved
    moved = [k for k in projector if k.endswith("weight") and not torch.equal(before[k], after[k])]
    assert moved == [k for k in projector if k.endswith("weight")], moved  # the projector's weights trained



@pytest.mark.parametrize("family", FAMILIES)
def test_lora_at_pp2_equals_serial(family, folders, canonical_runs, tmp_path):
    """LoRA (rank 4) on every target the family declares: PP2 gives the serial run's losses (LoRA at TP2, padded
    heads refused: tests/test_lora.py)."""
    skip_unless_declared(family, "lora")
    targets = family_registry.capabilities(family).lora_targets
    flags = folders.training(family) + ["--lora-rank", "4", "--lora-targets", ",".join(targets)]
    serial = canonical_runs.records(1, flags)
    got, out = run_training(2, flags + pp2(family), tmp_path, "lora")
    assert "LoRA adapters on" in out
    assert_equal_runs(got, serial, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_drop_path_at_tp2_equals_serial(family, folders, canonical_runs, tmp_path):
    """--vision-drop-path-rate 0.3: TP2 gives the serial run's losses (the masks depend on the seed, iteration,
    sample and image only), which differ from those of the run without drop path (the rate is honoured)."""
    skip_unless_declared(family, "drop_path")
    flags = folders.training(family)
    dropped = canonical_runs.records(1, flags + ["--vision-drop-path-rate", "0.3"])
    got, _ = run_training(2, flags + ["--vision-drop-path-rate", "0.3"] + TP2, tmp_path, "drop_path")
    assert_equal_runs(got, dropped, family)
    plain = canonical_runs.records(1, flags)
    diffs = [abs(d["grad norm"] - p["grad norm"]) / p["grad norm"] for d, p in zip(dropped, plain)]
    assert max(diffs) > 10 * KITS[family].grad_tol, diffs  # ten times what called TP2 equal to serial


# ---------------------------------------------------------------------------------------------------- fine-tune
@pytest.mark.parametrize("family", FAMILIES)
def test_short_finetune(family, data_cache, tmp_path):
    kit = KITS[family]
    iters, ratio = kit.finetune
    hf = tmp_path / "hf"
    model, batch = kit.make_tuned(hf, 3)
    data = kit.data(tmp_path, data_cache)
    sizes = ["--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
             "--seed", "5", "--omnibal-isf"]
    flags = [*kit.family_flags(), "--hf-checkpoint", str(hf), *data, *sizes]
    records, out = run_training(2, flags + pp2(family) + ["--train-iters", str(iters), "--save", str(tmp_path / "ckpt")],
                                tmp_path, "finetune")
    assert "loaded weights from --hf-checkpoint" in out and "> ISF:" in out
    if model is not None:  # the folder's own tokenizer
        assert "conversations are rendered with the tokenizer's own chat template" in out
    losses = [r["lm loss"] for r in records]
    assert len(losses) == iters
    assert sum(losses[-5:]) / 5 < ratio * sum(losses[:5]) / 5, losses

    # the offline import is a weights-only checkpoint that loads at any parallel layout: at TP2 its first iteration
    # is that of the folder loaded at TP2 (ISF in predicted time groups by the run's TP, so TP2 against TP2)
    imported(family, flags, tmp_path)
    one = flags + TP2 + ["--train-iters", "1"]
    again, out = run_training(2, one + ["--load", str(tmp_path / "imported")], tmp_path, "imported")
    assert "loaded checkpoint of iteration 0" in out
    direct, _ = run_training(2, one, tmp_path, "direct")
    assert [(r["lm loss"], r["grad norm"]) for r in again] == [(r["lm loss"], r["grad norm"]) for r in direct]

    omnibal(family, "hf", "export", "--load", tmp_path / "ckpt", "--out", tmp_path / "out")
    from safetensors.torch import load_file

    if model is not None:  # the folder's tokenizer goes with the export
        assert (tmp_path / "out" / "tokenizer.json").exists()
    source, tuned = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(source) == set(tuned) and sum(not torch.equal(source[k], tuned[k]) for k in source) > len(source) // 2
    reference, _ = family_registry.transformers_reference(hf)
    if reference is not None:  # transformers' logits on the export equal our model's on it
        import transformers

        hf_tuned = getattr(transformers, reference).from_pretrained(str(tmp_path / "out"),
                                                                    attn_implementation="eager").eval()
        want = kit.hf_logits(hf_tuned, batch)
        got = hf_check.torchrun_logits([(tmp_path / "out", [])], batch, tmp_path / "logits", 1)[0]
        assert (got - want).abs().max() <= (kit.tuned_logits_tol or kit.logits_tol)
