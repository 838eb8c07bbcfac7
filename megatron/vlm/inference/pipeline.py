"""One generation step through this rank's pipeline stage, and the stages' messages.

A prefill runs the whole unit list: the ViT wherever the layout puts it, the side tensors (DeepStack features)
travelling packed with the hidden states as in training (``megatron.vlm.stage.side``). A decode step runs the LLM's units
only: from the stage holding the text embedding (its input the step's tokens, no image features: every side tensor
is empty) to the last stage; stages of ViT units only sit it out. The last stage returns logits (the head's
``logits``, whatever the stage's output mode: training's stages generate too).

Between stages a step's tensor travels point to point (its shape first, as megatron's variable-shape P2P does), sent
without waiting (``isend``): several groups of sequences are in flight along the pipeline at once, and a stage
sends the next group's activations while a later one still works on the previous group's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from omnibal_ext.model.spec import HEAD, PROJECTOR, TEXT_EMBED, VISION_EMBED, VISION_LAYER
from omnibal_ext.model.units import family_of

from megatron.vlm.stage.micro_batch import MicroBatch
from megatron.vlm.stage.side import StageCache, pack, unpack

VISION_ROLES = (VISION_EMBED, VISION_LAYER, PROJECTOR)  # the units a decode step skips


@dataclass(frozen=True)
class PipelineLink:
    """This rank's place in the layout for generation: its pipeline stage of ``pp``, the first stage of decode steps
    (the one holding the text embedding), its neighbours' global ranks, its TP group, and the model-parallel group
    (TP x PP of its data-parallel replica) with the global rank that broadcasts each step's tokens in it (the last
    stage's TP rank 0)."""

    stage: int
    pp: int
    decode_first: int
    prev: int | None
    next: int | None
    tp: int
    tp_group: object
    mp_group: object
    source: int

    @classmethod
    def of(cls, holds_text_embed: bool) -> "PipelineLink":
        """This rank's link (collective over the model-parallel group); ``holds_text_embed``: this rank's stage holds
        the text embedding."""
        stage, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        mp_group = ps.get_model_parallel_group()
        everyone = [None] * dist.get_world_size(mp_group)
        dist.all_gather_object(everyone, (stage, tp_rank, dist.get_rank(), holds_text_embed), group=mp_group)
        source = next(rank for s, t, rank, _ in everyone if s == pp - 1 and t == 0)
        decode_first = next(s for s, _, _, e in everyone if e)
        return cls(stage, pp, decode_first, ps.get_pipeline_model_parallel_prev_rank() if stage > 0 else None,
                   ps.get_pipeline_model_parallel_next_rank() if stage < pp - 1 else None,
                   ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group(), mp_group, source)

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def runs(self, prefill: bool) -> bool:
        """Whether this rank's stage works at a prefill / a decode step."""
        return prefill or self.stage >= self.decode_first

    def receives(self, prefill: bool) -> bool:
        return self.stage > (0 if prefill else self.decode_first)


class Messages:
    """The stage's point-to-point messages: blocking receives, sends that do not wait (their tensors held until
    ``wait``)."""

    def __init__(self, link: PipelineLink, device):
        self.link, self.device = link, comm_device(device)
        self.pending: list = []

    def receive(self, dtype) -> torch.Tensor:
        shape = torch.empty(3, dtype=torch.int64, device=self.device)
        dist.recv(shape, src=self.link.prev)
        x = torch.empty(tuple(shape.tolist()), dtype=dtype, device=self.device)
        dist.recv(x, src=self.link.prev)
        return x

    def send(self, y: torch.Tensor) -> None:
        shape = torch.tensor(y.shape, dtype=torch.int64, device=self.device)
        y = y.detach().contiguous().to(self.device)
        # the sends finished are let go; none is waited for here: the next stage may be waiting for this one to join
        # a broadcast before it receives them
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending += [(dist.isend(shape, dst=self.link.next), shape), (dist.isend(y, dst=self.link.next), y)]

    def wait(self) -> None:
        """Wait for every send (the end of a generation)."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []


def comm_device(device) -> torch.device:
    """Where messages travel: the model's device under NCCL, the host under gloo."""
    return torch.device(device) if dist.get_backend() == "nccl" else torch.device("cpu")


def run_stage(stage, x: torch.Tensor | None, batch: MicroBatch, prefill: bool) -> torch.Tensor:
    """This rank's stage (a ``VLMStage``) on one step (module docstring): its output to send, or on the last stage this
    TP rank's logits [t, 1, V/tp]."""
    cache = StageCache()
    spec = stage.spec
    if stage.sides_in and x is not None:
        rows = [(stage.side_rows(spec, batch, 1, 0) if prefill else 0, s.width) for s in stage.sides_in]
        x, received = unpack(x, rows)
        for side, tensor in zip(stage.sides_in, received):
            cache.put_side(side.name, tensor)
    dtype = next(stage.parameters()).dtype
    device = next(stage.parameters()).device
    if not prefill:  # no image features: every side tensor empty
        held = cache.held_sides()
        for side in family_of(spec).side_tensors(spec):
            if side.name not in held:
                cache.put_side(side.name, torch.zeros(0, side.width, dtype=dtype, device=device))
    for part in stage.parts:
        role = part.component.code()
        if not prefill and role in VISION_ROLES:
            continue
        module = stage.module_of(part)
        if role == HEAD:
            x = part.component.logits(module, x)
        else:
            if not prefill and role == TEXT_EMBED:
                x = torch.zeros(0, 1, spec.language.hidden_size, dtype=dtype, device=device)
            x = part.component.forward(module, x, batch, cache)
    if stage.post_process:
        return x
    return pack(x, [cache.take_side(s.name) for s in stage.sides_out])


def gather_logits(logits: torch.Tensor, rows: list[int], real_vocab: int, link: PipelineLink) -> torch.Tensor:
    """The rows ``rows`` of this TP rank's logits [t, 1, V/tp] over the whole real vocabulary, fp32 [len(rows), V]."""
    part = logits.squeeze(1).index_select(0, torch.tensor(rows, device=logits.device)).float().contiguous()
    if link.tp > 1:
        parts = [torch.empty_like(part) for _ in range(link.tp)]
        dist.all_gather(parts, part, group=link.tp_group)
        part = torch.cat(parts, dim=-1)
    return part[:, :real_vocab]
