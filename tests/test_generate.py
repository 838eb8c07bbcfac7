"""Generation on our stages against transformers' ``generate``, for every family (InternVL with Qwen2, InternVL3.5
dense and MoE, Qwen2.5-VL, Qwen3-VL dense and MoE, Qwen3.5 dense and MoE) on tiny random checkpoints whose
continuations vary (``generate_cases.vary``), each case a batch of three requests of different lengths packed in one
prefill (an image, an H.264 video, text only), each compared with transformers run on that prompt alone.

Equality as the acceptance states it (``generate_cases.compare``): greedy 32 new tokens equal to transformers' up to
its first near-tie (top-1 / top-2 gap below tau = max(1e-4, 4 x the max |delta logit| measured at that layout)), and
teacher-forced with its tokens our argmax equal to its token wherever the gap is at least tau; each case's first
near-tie is printed, and most reach 32 tokens without one. At TP1 (run as DP 2), TP2, PP2 with the ViT split over the
stages and EP2 for the MoE models, and from ``--load`` (the Qwen3.5 folder imported as a checkpoint, resharded to TP2),
all in one case of the 2-rank worker pool; sampling with a fixed seed gives the same tokens at TP1 and TP2. The
prompts are our reader's (``omnibal generate``'s path); the image prompts equal what transformers'
processor makes of the same request (the tokenizer's chat template and ``Qwen2VLImageProcessorPil``), and its inputs
are transformers' own for those; the videos' inputs are the reader's rows and grids (transformers' video processors
need torchvision; the reader's video rows are compared with the per-frame image processor in
tests/test_qwen_video_data.py)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("av")
import generate_cases as gc  # noqa: E402
from hf_tiny import world_of_one  # noqa: E402

from megatron.training.hf_checkpoints import import_hf  # noqa: E402

SAMPLING = {"max_new_tokens": gc.NEW_TOKENS, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7,
            "ignore_eos": True}
GREEDY = {"max_new_tokens": gc.NEW_TOKENS, "ignore_eos": True}


@contextlib.contextmanager
def one_thread():
    """transformers' runs on one thread (a shared machine's spinning BLAS threads slow tiny matrices 50x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Tiny:
    folder: Path
    model: object
    prompts: list
    rule: object
    oracle: list | None = None


class Families:
    """The tiny folders and transformers' greedy continuations, made when first asked for (module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self.requests = gc.write_requests(root / "media")
        self._made: dict[str, Tiny] = {}

    def get(self, name: str, oracle: bool = True) -> Tiny:
        if name not in self._made:
            with one_thread():
                model = gc.make_family(name, self.root / name)
                prompts, _, rule = gc.read_prompts(name, self.root / name, self.requests)
            self._made[name] = Tiny(self.root / name, model, prompts, rule)
        tiny = self._made[name]
        if oracle and tiny.oracle is None:
            with one_thread():
                tiny.oracle = [gc.hf_greedy(tiny.model, self.hf_inputs(name, tiny, k)) for k in range(len(tiny.prompts))]
        return tiny

    def hf_inputs(self, name: str, tiny: Tiny, k: int) -> dict:
        """transformers' inputs of prompt ``k``: the processor's for an image request of a Qwen family, else made of
        the reader's sample (``generate_cases.hf_inputs``)."""
        if k == 0 and name in gc.QWEN_FAMILIES:
            return gc.processor_inputs(name, tiny.folder, gc.REQUESTS[0], self.requests.parent)
        return gc.hf_inputs(name, tiny.prompts[k].sample, tiny.rule, tiny.model)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return Families(tmp_path_factory.mktemp("generate"))


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_image_prompts_are_what_the_processor_makes(families, name):
    """The reader's image prompt (``omnibal generate``'s) is transformers' processor output for the same request:
    token ids (chat template, generation prompt, expanded image tokens) and pixel rows, bit for bit."""
    tiny = families.get(name, oracle=False)
    want = gc.processor_inputs(name, tiny.folder, gc.REQUESTS[0], families.requests.parent)
    ours = gc.hf_inputs(name, tiny.prompts[0].sample, tiny.rule, tiny.model)
    assert torch.equal(ours["input_ids"], want["input_ids"])
    assert torch.equal(ours["pixel_values"], want["pixel_values"])
    assert torch.equal(ours["image_grid_thw"], want["image_grid_thw"])


def layouts(name: str) -> dict[str, list[str]]:
    """The acceptance's layouts of ``name`` in a world of 2: TP1 (DP 2), TP2, PP2 with the ViT split, EP2 (MoE)."""
    sp = ["--sequence-parallel"] if name in gc.MOE else []  # the trainer's rule for MoE layers under TP
    out = {"TP1": [], "TP2": ["--tensor-model-parallel-size", "2", *sp],
           "PP2": ["--pipeline-model-parallel-size", "2", "--pipeline-layout", gc.VIT_SPLIT[name]]}
    if name in gc.MOE:
        out["EP2"] = ["--expert-model-parallel-size", "2"]
    return out


@pytest.mark.slow
def test_generation_equals_transformers_at_every_layout(families, tmp_path):
    cases = []
    for name in gc.FAMILIES:
        tiny = families.get(name)
        base = ["--hf-checkpoint", str(tiny.folder), *gc.trainer_flags(name)]
        for layout, flags in layouts(name).items():
            cases.append(gc.Case(f"{name} {layout}", (*base, *flags), families.requests, GREEDY,
                                 [h.tokens for h in tiny.oracle]))
    # --load: the Qwen3.5 folder imported as a checkpoint of ours (TP1), generated from at TP2 (resharded at load)
    ckpt = tmp_path / "imported"
    with world_of_one():
        import_hf(str(families.get("qwen3_5").folder), str(ckpt))
    cases.append(gc.Case("qwen3_5 load-TP2", ("--hf-checkpoint", str(families.get("qwen3_5").folder), "--load",
                                              str(ckpt), *layouts("qwen3_5")["TP2"]), families.requests, GREEDY,
                         [h.tokens for h in families.get("qwen3_5").oracle]))
    sampled = ("qwen3_5", "internvl3_5_moe")
    for name in sampled:
        base = ["--hf-checkpoint", str(families.get(name).folder), *gc.trainer_flags(name)]
        cases += [gc.Case(f"{name} sampled TP1", tuple(base), families.requests, SAMPLING),
                  gc.Case(f"{name} sampled TP2", (*base, *layouts(name)["TP2"]), families.requests, SAMPLING)]
    got = gc.generate_in_pool(cases, tmp_path)

    rows, full = [], 0
    for case in cases:
        if "sampled" in case.name:
            continue
        name = case.name.split()[0]
        tiny = families.get(name)
        out = got[case.name]
        for k, hf in enumerate(tiny.oracle):
            assert out["prompt_ids"][k] == tiny.prompts[k].sample["input_ids"].tolist(), case.name
            verdict = gc.compare(out["tokens"][k], out["forced_argmax"][k], out["forced_logits"][k], hf,
                                 f"{case.name} prompt {k}")
            full += verdict.near_tie is None
            rows.append(f"{case.name:<24} prompt {k} ({len(out['prompt_ids'][k]):>3} tokens): max |dlogit| "
                        f"{verdict.max_dlogit:.1e}, tau {verdict.tau:.1e}, first near-tie "
                        f"{'none' if verdict.near_tie is None else verdict.near_tie}")
    print("\n".join(rows))
    assert full >= 0.75 * len(rows), f"only {full} of {len(rows)} cases reach {gc.NEW_TOKENS} tokens without a near-tie"
    for name in sampled:
        tp1, tp2 = got[f"{name} sampled TP1"], got[f"{name} sampled TP2"]
        assert tp1["tokens"] == tp2["tokens"], name  # one generator per request over the gathered fp32 logits
        assert tp1["tokens"] != [h.tokens for h in families.get(name).oracle], name  # it sampled
        assert all(len(t) == gc.NEW_TOKENS for t in tp1["tokens"])
