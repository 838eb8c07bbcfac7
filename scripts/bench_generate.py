"""Generation on our stages (``megatron.vlm.inference``) against transformers' ``generate`` on the same model, side by
side in one process on the CPU: tokens per second and the time to the first token, at batch 1 and 8.

The model: a small random Qwen2.5-VL written here (ViT of 2 layers, LLM of 4 layers of width 256, the built-in
byte tokenizer); the prompts: an image of 112 x 112 px (64 patches, 16 image tokens) and a question, the same
length for every request (transformers then needs no padding), ``--new-tokens`` greedy tokens each without stopping.
Ours reads the requests with the trainer's reader and packs a batch in one prefill, then decodes with its caches
(TP1, one process); transformers runs ``generate`` (eager attention, fp32) on the same token ids and pixel rows.
Both run ``--repeats`` times alternately after a warm-up, at ``--threads`` torch threads; the medians are reported,
with whether the tokens agree.

    python scripts/bench_generate.py [--json OUT] [--new-tokens 64] [--repeats 3] [--threads 1] [--quick]

Prints a table and one JSON line (``--json`` writes it to a file too).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

IMAGE_PX = 112
QUESTION = "<image>What is in this picture? Answer in one sentence."


def write_model(folder: str, hidden: int = 256, layers: int = 4) -> None:
    """A random Qwen2.5-VL folder whose token ids are the byte tokenizer's (``<img>`` / ``</img>`` /
    ``<IMG_CONTEXT>`` as vision start / end / image pad), weights scaled so the continuations vary."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from megatron.vlm.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    half = hidden // 8 // 2  # head dim 2: rotary pairs, cut 2:3:3 as the published 16:24:24
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=hidden,
                           window_size=56, fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        text_config=dict(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, vocab_size=tok.vocab_size, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8]},
                         bos_token_id=None, eos_token_id=None, tie_word_embeddings=False),
        image_token_id=tok.img_context_id, video_token_id=tok.eos_id, vision_start_token_id=tok.img_start_id,
        vision_end_token_id=tok.img_end_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" not in name and name.endswith(("q_proj.weight", "k_proj.weight", "embed_tokens.weight")):
                p.mul_(4.0)
    model.save_pretrained(folder)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 14, "merge_size": 2,
                   "temporal_patch_size": 2, "min_pixels": IMAGE_PX * IMAGE_PX, "max_pixels": IMAGE_PX * IMAGE_PX}, f)


def write_requests(folder: str, n: int) -> list:
    """``n`` requests (one image each, the same question) with their images in ``folder``."""
    import numpy as np
    from PIL import Image

    from megatron.vlm.inference.requests import GenerationRequest

    out = []
    for k in range(n):
        rng = np.random.default_rng(k)
        path = os.path.join(folder, f"img{k}.png")
        Image.fromarray(rng.integers(0, 255, (IMAGE_PX, IMAGE_PX, 3), dtype=np.uint8)).save(path)
        out.append(GenerationRequest(({"role": "user", "content": QUESTION},), images=(path,)))
    return out


class Clock:
    """Time of the first token and of the end of a generation (seconds since ``start``)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first = None

    def tick(self, *_):
        if self.first is None:
            self.first = time.perf_counter() - self.start


def ours(engine, prompts, new_tokens: int):
    from megatron.vlm.inference.requests import SamplingParams

    clock = Clock()
    states = engine.run(prompts, [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts),
                        on_token=clock.tick)
    return time.perf_counter() - clock.start, clock.first, [s.stream.tokens for s in states]


def theirs(model, inputs: dict, new_tokens: int):
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stream(BaseStreamer):
        def __init__(self, clock):
            self.clock, self.calls = clock, 0

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call is the prompt
                self.clock.tick()

        def end(self):
            pass

    clock = Clock()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, streamer=Stream(clock))
    total = time.perf_counter() - clock.start
    return total, clock.first, out[:, inputs["input_ids"].shape[1]:].tolist()


def hf_inputs(prompts, rule, image_token_id: int) -> dict:
    """transformers' inputs of prompts of one length (token ids stacked, pixel rows and grids concatenated)."""
    import torch

    ids = torch.stack([torch.as_tensor(p.sample["input_ids"]) for p in prompts])
    grids = [rule.grid(*(int(v) for v in p.sample["image_sizes"][0])) for p in prompts]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.cat([p.sample["pixel_values"] for p in prompts]),
            "image_grid_thw": torch.tensor(grids), "mm_token_type_ids": (ids == image_token_id).long()}


def run(args, tmp: str) -> list[dict]:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy
    from megatron.vlm.inference.build import generator_from_args

    torch.set_num_threads(args.threads)
    rows = []
    folder = os.path.join(tmp, "model")
    write_model(folder, hidden=128 if args.quick else 256, layers=2 if args.quick else 4)
    # transformers' model is loaded outside the CPU patches (they would spoil the rotary tables it computes there)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, attn_implementation="eager").eval()
    with cpu_compat.patched():
        try:
            engine = generator_from_args(["--hf-checkpoint", folder])
            for batch in args.batches:
                requests = write_requests(tmp, batch)
                prompts = engine.read_requests(requests)
                inputs = hf_inputs(prompts, engine.reader_config.images, engine.tokenizer.img_context_id)
                ours(engine, prompts, 2), theirs(model, inputs, 2)  # warm-up
                mine, hf = [], []
                for _ in range(args.repeats):
                    mine.append(ours(engine, prompts, args.new_tokens))
                    hf.append(theirs(model, inputs, args.new_tokens))
                tokens = batch * args.new_tokens
                row = {"batch": batch, "new_tokens": args.new_tokens, "prompt_tokens": prompts[0].length,
                       "ours_tokens_per_s": tokens / statistics.median(m[0] for m in mine),
                       "hf_tokens_per_s": tokens / statistics.median(h[0] for h in hf),
                       "ours_ttft_ms": 1e3 * statistics.median(m[1] for m in mine),
                       "hf_ttft_ms": 1e3 * statistics.median(h[1] for h in hf),
                       "same_tokens": mine[0][2] == hf[0][2]}
                row["speedup"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
                rows.append(row)
        finally:
            destroy()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| batch | prompt tokens | new tokens | ours tokens/s | transformers tokens/s | ratio | ours TTFT ms | "
             "transformers TTFT ms | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['ours_tokens_per_s']:.1f} | "
                     f"{r['hf_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['ours_ttft_ms']:.1f} | "
                     f"{r['hf_ttft_ms']:.1f} | {'yes' if r['same_tokens'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of both (default 1)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--quick", action="store_true", help="a smaller model, for a smoke test")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        rows = run(args, tmp)
    result = {"bench": "generate", "threads": args.threads, "rows": rows}
    print(table(rows))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
