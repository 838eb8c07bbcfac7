#!/usr/bin/env python
"""Online ISF with a plain Energon loader per data-parallel rank, in a plain PyTorch script (no pretrain_vlm.py).

What another Megatron codebase does to balance its VLM steps on Energon data:

1. a task encoder that mixes in ``OnlineISFTaskEncoderMixin`` and says what a sample costs from cheap metadata
   (``sample_cost``: the image's header and the caption's length, no pixel decoded) and how to decode it
   (``postencode_sample``);
2. Energon's own savable loader, one per DP rank, of that dataset with ``batch_size=None``;
3. ``OnlineISFLoader`` around it: every step it hands this rank its groups (micro-batches), matched in predicted
   ViT and LLM time across the ranks through one small all-gather, and decodes only the samples it selected;
4. ``save_state`` / ``restore_state`` of the balancer in the checkpoint (Energon's state, the online ISF's and the
   restore keys of the buffered samples).

    python examples/energon_online_isf.py --demo-data /tmp/demo          # write a small demo dataset
    torchrun --nproc-per-node 2 examples/energon_online_isf.py --data /tmp/demo --workers 2 --buffer 32

The demo dataset: image-caption samples (``<key>.jpg``, ``<key>.txt``) in WebDataset tars, prepared with
Energon's preparation API and a ``dataset.yaml`` of Energon's ``CaptioningSample``.  The toy model trains on each
image's mean colour; each rank all-reduces its gradients once per step (a step may hold fewer groups at the end
of the epoch, so no per-group DDP hook).  Per step rank 0 prints the step's DistRatio in predicted ViT and LLM
time across the ranks.  ``--record FILE`` writes every rank's groups (keys and costs) to ``FILE.<rank>.json``;
``--resume-check N`` saves the balancer's state after step N, finishes the epoch, then resumes a fresh loader
from the state and records the steps it serves (``resumed``): they equal the first run's steps after N.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_savable_loader, get_train_dataset  # noqa: E402

from megatron.vlm.data.energon.balancing import OnlineISFLoader  # noqa: E402
from megatron.vlm.data.energon.task_encoder import (OnlineISFTaskEncoderMixin, TimeRates,  # noqa: E402
                                                    image_size)
from omnibal_ext.data.metrics import dist_ratio_one  # noqa: E402
from omnibal_ext.data.online_isf import OnlineISFConfig, SampleCost  # noqa: E402

PATCH_PX, MERGE = 28, 4  # a ViT item per 28 x 28 px, one LLM token per 4 items (a Qwen-like ViT's merge)
RATES = TimeRates(vit_item_s=2e-5, vit_item_sq_s=2e-9, llm_token_s=6e-5, llm_token_sq_s=3e-9)  # stated, seconds


def image_items(width: int, height: int) -> int:
    """ViT items of an image: 28 px patches covering it."""
    return math.ceil(width / PATCH_PX) * math.ceil(height / PATCH_PX)


class CaptionCosts(OnlineISFTaskEncoderMixin, DefaultTaskEncoder):
    """Costs from the image header and the caption's words; decoding after selection."""

    def __init__(self, rates: TimeRates = RATES):
        super().__init__()
        self.rates = rates

    def sample_cost(self, sample) -> SampleCost:
        items = image_items(*image_size(sample.image))
        return self.rates.cost([items], len(sample.caption.split()) + items // MERGE)

    def postencode_sample(self, sample) -> dict:
        from PIL import Image

        with Image.open(io.BytesIO(sample.image)) as im:
            pixels = torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0)
        return {"key": sample.__key__, "pixels": pixels, "words": len(sample.caption.split())}


def make_loader(path: str, rank: int, world: int, workers: int, encoder):
    """Energon's savable loader of this DP rank: one epoch (no repeat), in file order, one sample at a time."""
    config = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    dataset = get_train_dataset(path, worker_config=config, batch_size=None, shuffle_buffer_size=None,
                                max_samples_per_sequence=None, task_encoder=encoder, repeat=False)
    return get_savable_loader(dataset)


def train_step(model, optimizer, groups: list[list[dict]]) -> float:
    """One step of the toy model over this rank's groups; gradients all-reduced once per step on every rank."""
    optimizer.zero_grad()
    loss_sum = torch.zeros(())
    for group in groups:
        colours = torch.stack([s["pixels"].reshape(-1, 3).mean(dim=0) for s in group])
        loss = model(colours).pow(2).mean()
        loss.backward()
        loss_sum += loss.detach()
    if dist.is_initialized():
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
    optimizer.step()
    return float(loss_sum)


def run_epoch(balancer: OnlineISFLoader, model, optimizer, save_at: int | None = None) -> tuple[list, object]:
    """Steps until the epoch is drained; returns (the steps' records, the balancer state saved after step
    ``save_at``, or None)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    records, state = [], None
    for n, step in enumerate(balancer, start=1):
        loss = train_step(model, optimizer, step.groups)
        records.append({"ended": balancer.stream_ended,
                        "groups": [{"keys": keys, "vit_s": [c.vit_s for c in costs],
                                               "llm_s": [c.llm_s for c in costs]}
                                              for keys, costs in zip(step.keys, step.costs)]})
        mine = torch.tensor([sum(c.vit_s for g in step.costs for c in g),
                             sum(c.llm_s for g in step.costs for c in g)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine) if dist.is_initialized() else every.__setitem__(0, mine)
        if rank == 0:
            vit, llm = (dist_ratio_one([float(t[k]) for t in every]) for k in (0, 1))
            print(f"step {n}: {len(step.groups)} groups, loss {loss:.4f}, DistRatio ViT time {vit:.4f}, "
                  f"LLM time {llm:.4f}", flush=True)
        if save_at is not None and n == save_at:
            state = balancer.save_state()
    return records, state


def make_demo_dataset(folder: str, samples: int = 96, shards: int = 4, seed: int = 0, min_px: int = 48,
                      max_px: int = 400) -> None:
    """Image-caption samples in WebDataset tars (JPEGs of ``min_px`` to ``max_px`` a side), prepared with
    Energon's preparation API."""
    import webdataset as wds
    from PIL import Image

    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = "a photo of cat dog street car tree river house red green blue small large left right".split()
    names = []
    for shard, keys in enumerate(np.array_split(np.arange(samples), shards)):
        names.append(f"train-{shard:03d}.tar")
        with wds.TarWriter(str(root / names[-1])) as tar:
            for k in keys:
                w, h = (int(x) for x in rng.integers(min_px, max_px, 2))
                low = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
                image = io.BytesIO()
                Image.fromarray(low).resize((w, h), Image.Resampling.BILINEAR).save(image, format="JPEG", quality=85)
                caption = " ".join(rng.choice(words, int(rng.integers(3, 120))))
                tar.write({"__key__": f"sample{k:05d}", "jpg": image.getvalue(), "txt": caption})
    BaseWebdatasetFactory.prepare_dataset(root, names, split_parts_patterns=[("train", "train-.*")], workers=1)
    (root / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
        "field_map:\n  image: jpg\n  caption: txt\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="an Energon dataset folder of CaptioningSample (image, caption)")
    ap.add_argument("--demo-data", metavar="DIR", help="write a demo dataset to DIR and exit")
    ap.add_argument("--workers", type=int, default=2, help="Energon loader worker processes per rank")
    ap.add_argument("--buffer", type=int, default=32, help="look-ahead samples per rank")
    ap.add_argument("--groups", type=int, default=1, help="groups (micro-batches) per rank per step")
    ap.add_argument("--samples-per-group", type=float, default=4.0)
    ap.add_argument("--decode-threads", type=int, default=2)
    ap.add_argument("--record", metavar="FILE", help="write each rank's steps to FILE.<rank>.json")
    ap.add_argument("--resume-check", type=int, metavar="N", help="save after step N, resume a fresh loader")
    args = ap.parse_args(argv)
    if args.demo_data:
        make_demo_dataset(args.demo_data)
        return 0
    if not args.data:
        ap.error("give --data (or --demo-data DIR to write a demo dataset)")
    torch.manual_seed(0)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    encoder = CaptionCosts()
    config = OnlineISFConfig(ranks=world, buffer_size=args.buffer, groups_per_step=args.groups,
                             samples_per_group=args.samples_per_group)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    balancer = OnlineISFLoader(make_loader(args.data, rank, world, args.workers, encoder), encoder, config,
                               decode_threads=args.decode_threads)
    steps, state = run_epoch(balancer, model, optimizer, save_at=args.resume_check)
    out = {"rank": rank, "world": world, "steps": steps}
    if args.resume_check:
        resumed = OnlineISFLoader(make_loader(args.data, rank, world, args.workers, encoder), encoder, config,
                                  decode_threads=args.decode_threads)
        resumed.restore_state(state)
        out["resume_at"] = args.resume_check
        out["resumed"], _ = run_epoch(resumed, model, optimizer)
    if args.record:
        Path(f"{args.record}.{rank}.json").write_text(json.dumps(out))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
