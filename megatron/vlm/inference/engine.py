"""The generation loop on the training layout's stages: prefill, then one decode step per new token, pipelined.

Every rank of a data-parallel replica's model-parallel group (TP x PP) runs the same loop over the same requests:

1. the prompts (``prompts.read_prompts``: the trainer's reader) are split into groups; each group's prompts are
   packed into one micro-batch by the family's batcher, as training packs samples (THD: each prompt a segment);
2. a group's step goes through the pipeline (``pipeline.run_stage``): its prefill through every stage, its decode
   steps through the LLM's stages, one token per live sequence, under sequence parallelism padded to a multiple of
   TP. Each layer reads and extends its caches (``cache.DecodeStep`` in the micro-batch's packing part);
3. the last stage gathers the logits of each sequence's last token over TP (fp32, the real vocabulary), chooses
   the next tokens (``sampling``) and broadcasts them in the model-parallel group; every rank then takes them into
   each request's ``stopping.TextStream`` (stop tokens and strings, max new tokens: decided alike everywhere), and
   the next step of the group is built from them: each sequence's last token at its next position (1-D positions
   continue from the prompt's length; multimodal 3-D RoPE ids from the prompt's largest id + 1, the
   ``mrope_position_ids`` delta transformers' ``get_rope_index`` gives).

Groups take turns: while the last stage works on one group's step, the first works on the next group's, so the
stages of a pipeline work at once (with one group they take turns; the number of groups is the stages a decode step
runs through, at most the requests). The last stage broadcasts a group's tokens as soon as it has them; the others
take that broadcast when they come back to the group, so every rank sees the broadcasts in the same order.

Data-parallel replicas (and so expert-parallel ranks, which span them) all run every request: their expert layers'
exchanges need every rank at every step; the results are the same on all of them.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import TEXT_EMBED

from megatron.vlm.data.template import IGNORE_INDEX
from megatron.vlm.parallel.sequence_parallel import padded_tokens
from megatron.vlm.stage.micro_batch import MicroBatch

from .cache import DecodeCache, DecodeStep
from .pipeline import Messages, PipelineLink, comm_device, gather_logits, run_stage
from .prompts import Prompt, read_prompts
from .requests import GenerationRequest, GenerationResult, SamplingParams, TokenCallback
from .sampling import choose_token, request_generator
from .stopping import TextStream


@dataclasses.dataclass
class SequenceState:
    """One request in a generation: its prompt and stream, where its next token goes, and (last stage, when asked)
    each step's argmax, top-1/top-2 gap and logits."""

    index: int
    prompt: Prompt
    params: SamplingParams
    stream: TextStream
    generator: torch.Generator | None
    forced: tuple[int, ...] | None = None
    past: int = 0  # tokens in its caches
    delta: int = 0  # 3-D RoPE: the id of the token at ``past`` is ``past + delta``
    argmax: list[int] = dataclasses.field(default_factory=list)
    gaps: list[float] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.stream.finished


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: ``pad_to_multiple`` the tokens of every step (TP under sequence parallelism: MoE layers at
    TP > 1), the tokenizer's ``pad_id``, the real vocabulary, the end tokens (``stopping.default_stop_ids``), the
    groups of sequences in flight (None: the stages a decode step runs through) and the most sequences a group
    holds (``max_batch``: more requests make more groups)."""

    pad_to_multiple: int
    pad_id: int
    real_vocab: int
    end_ids: frozenset[int]
    groups: int | None = None
    max_batch: int = 64


class GenerationEngine:
    """The ``Generator`` of this rank's stage (a ``VLMStage`` in eval mode, weights loaded): ``generate`` reads the
    requests with the trainer's reader (``reader``: tokenizer, ``ReaderConfig``) and runs the loop (module
    docstring); ``run`` takes prompts (tests, ``--eval-generate``)."""

    def __init__(self, stage, tokenizer, reader_config, batcher, config: EngineConfig):
        self.stage, self.tokenizer, self.reader_config, self.batcher, self.config = (stage, tokenizer, reader_config,
                                                                                  batcher, config)
        self.device = next(stage.parameters()).device
        self.link = PipelineLink.of(any(u.code == TEXT_EMBED for u in stage.units))
        self.mrope = any(f.name == "mrope_position_ids" for f in dataclasses.fields(batcher.vision_part))

    # the Generator protocol -------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[GenerationResult]:
        for k, r in enumerate(requests):
            try:
                r.sampling.check()
            except ValueError as e:
                raise UserError(f"request {k}: {e}") from None
        prompts = self.read_requests(requests)
        states = self.run(prompts, [r.sampling for r in requests], on_token=on_token)
        return [s.stream.result() for s in states]

    def read_requests(self, requests: Sequence[GenerationRequest], root: str = "/") -> list[Prompt]:
        """The prompts of ``requests`` (``prompts.read_prompts``; problems named ``request k``)."""
        import json

        lines = [json.dumps(r.record()) for r in requests]
        return read_prompts(lines, root, self.tokenizer, self.reader_config, [f"request {k}" for k in range(len(lines))])

    # the loop -----------------------------------------------------------------------------------------------------
    def run(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams], on_token: TokenCallback | None = None,
            forced: Sequence[Sequence[int]] | None = None, diagnostics: bool = False) -> list[SequenceState]:
        """Generate for ``prompts`` with ``params`` (module docstring). ``forced``: per prompt the tokens to feed back
        instead of the chosen ones (teacher forcing; the argmax is still recorded); ``diagnostics``: the last stage
        keeps each step's logits too. Returns every sequence's state (the same tokens on every rank)."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError(f"run: {len(prompts)} prompts, {len(params)} sampling settings")
        states = []
        for k, (prompt, p) in enumerate(zip(prompts, params)):
            force = None if forced is None else tuple(int(t) for t in forced[k])
            if force is not None:
                p = dataclasses.replace(p, max_new_tokens=len(force), ignore_eos=True, stop=(), stop_token_ids=())
            stream = TextStream(p, self.tokenizer.decode, self.config.end_ids, prompt.length)
            states.append(SequenceState(k, prompt, p, stream, request_generator(p, k), force))
        was_training = self.stage.training
        self.stage.eval()
        try:
            return self._loop(states, on_token, diagnostics)
        finally:
            self.stage.train(was_training)

    def _loop(self, states: list[SequenceState], on_token, diagnostics: bool) -> list[SequenceState]:
        cache = DecodeCache(len(states), max(s.prompt.length + s.params.max_new_tokens for s in states))
        groups = self._groups(len(states))
        messages = Messages(self.link, self.device)
        rank0 = dist.get_rank() == 0
        in_step: dict[int, list[int]] = {}
        queue = collections.deque((g, 0) for g in range(len(groups)))
        with torch.no_grad():
            while queue:
                g, step = queue.popleft()
                if step == 0:
                    live = list(groups[g])
                else:
                    if not self.link.is_last:  # the tokens of the group's previous step (broadcast then)
                        self._take(states, in_step[g], self._broadcast(None, len(in_step[g])), on_token, rank0)
                    live = [i for i in in_step[g] if not states[i].finished]
                    if not live:
                        continue
                in_step[g] = live
                batch, rows = (self._prefill_batch(states, live, cache) if step == 0 else
                               self._decode_batch(states, live, cache))
                logits = self._forward(batch, step == 0, rows, messages)
                if self.link.is_last:
                    tokens = self._choose(states, live, logits, diagnostics)
                    self._take(states, live, self._broadcast(tokens, len(live)), on_token, rank0)
                    if all(states[i].finished for i in live):
                        continue
                queue.append((g, step + 1))
        messages.wait()
        return states

    def teacher_forced(self, prompts: Sequence[Prompt]) -> list[tuple[list[int], list[float]]] | None:
        """Each prompt followed by its ``answer`` in one packed forward without caches (as training computes it): on
        the last stage, per prompt the argmax and the top-1/top-2 gap at each answer token's position (the logits
        that predict it); None on the other ranks."""
        was_training = self.stage.training
        self.stage.eval()
        messages = Messages(self.link, self.device)
        out: list = []
        try:
            with torch.no_grad():
                for group in self._groups(len(prompts)):
                    samples, rows, at = [], [], 0
                    for i in group:
                        p = prompts[i]
                        n = p.length + len(p.answer)
                        sample = dict(p.sample)
                        sample["input_ids"] = torch.cat([torch.as_tensor(p.sample["input_ids"]),
                                                         torch.tensor(p.answer, dtype=torch.int64)])
                        sample["labels"] = torch.full((n,), IGNORE_INDEX, dtype=torch.int64)
                        if sample.get("mm_token_type_ids") is not None:
                            sample["mm_token_type_ids"] = torch.cat([torch.as_tensor(sample["mm_token_type_ids"]),
                                                                     torch.zeros(len(p.answer), dtype=torch.int64)])
                        samples.append(sample)
                        rows.append(list(range(at + p.length - 1, at + n - 1)))
                        at += n
                    fields = self.batcher.make(samples, self.config.pad_id, packed=True,
                                               pad_to_multiple=self.config.pad_to_multiple)
                    batch = self.batcher.micro_batch(fields).to(self.device)
                    logits = self._forward(batch, True, [r for rs in rows for r in rs], messages)
                    if logits is None:
                        continue
                    at = 0
                    for rs in rows:
                        part = logits[at:at + len(rs)]
                        at += len(rs)
                        top = torch.topk(part, 2, dim=-1).values
                        out.append((part.argmax(-1).tolist(), (top[:, 0] - top[:, 1]).tolist()))
        finally:
            messages.wait()
            self.stage.train(was_training)
        return out if self.link.is_last else None

    def _groups(self, n: int) -> list[list[int]]:
        """The requests split into groups: as many as the stages a decode step runs through (or ``groups``), more
        when a group would hold over ``max_batch`` sequences."""
        stages = self.link.pp - self.link.decode_first
        count = max(1, min(n, self.config.groups or stages), -(-n // self.config.max_batch))
        return [list(part) for part in np.array_split(np.arange(n), count) if len(part)]

    def _forward(self, batch: MicroBatch, prefill: bool, rows: list[int], messages: Messages):
        """The step through this rank's stage; on the last stage the gathered logits of ``rows`` [len(rows), V]."""
        if not self.link.runs(prefill):
            return None
        x = messages.receive(next(self.stage.parameters()).dtype) if self.link.receives(prefill) else None
        self.stage.set_input_tensor(x)
        y = run_stage(self.stage, x, batch, prefill)
        if not self.link.is_last:
            messages.send(y)
            return None
        return gather_logits(y, rows, self.config.real_vocab, self.link)

    def _choose(self, states, live: list[int], logits: torch.Tensor, diagnostics: bool) -> torch.Tensor:
        tokens = []
        top = torch.topk(logits, 2, dim=-1).values
        argmaxes, gaps = logits.argmax(-1).tolist(), (top[:, 0] - top[:, 1]).tolist()
        for row, i in enumerate(live):
            s = states[i]
            argmax = argmaxes[row]
            s.argmax.append(argmax)
            s.gaps.append(gaps[row])
            if diagnostics:
                s.logits.append(logits[row].cpu())
            if s.forced is not None:
                tokens.append(s.forced[len(s.stream.tokens)])
            else:
                tokens.append(argmax if s.params.greedy else choose_token(logits[row], s.params, s.generator))
        return torch.tensor(tokens, dtype=torch.int64)

    def _broadcast(self, tokens: torch.Tensor | None, n: int) -> list[int]:
        """A step's tokens from the last stage to every rank of the model-parallel group."""
        device = comm_device(self.device)
        buffer = tokens.to(device) if tokens is not None else torch.empty(n, dtype=torch.int64, device=device)
        if dist.get_world_size(self.link.mp_group) > 1:
            dist.broadcast(buffer, src=self.link.source, group=self.link.mp_group)
        return buffer.tolist()

    @staticmethod
    def _take(states, live: list[int], tokens: list[int], on_token, rank0: bool) -> None:
        for i, token in zip(live, tokens):
            delta = states[i].stream.add(token)
            if on_token is not None and rank0:
                on_token(i, token, delta)

    # micro-batches --------------------------------------------------------------------------------------------------
    def _prefill_batch(self, states, live: list[int], cache: DecodeCache) -> tuple[MicroBatch, list[int]]:
        """The group's prompts packed in one micro-batch (the family's batcher), and the rows of their last tokens."""
        samples = [states[i].prompt.sample for i in live]
        fields = self.batcher.make(samples, self.config.pad_id, packed=True,
                                   pad_to_multiple=self.config.pad_to_multiple)
        batch = self.batcher.micro_batch(fields)
        bounds = batch.packing.cu_seqlens.tolist()
        ends = [bounds[k + 1] - 1 for k in range(len(live))]
        if self.mrope:
            ids = batch.vision.mrope_position_ids.reshape(3, -1)
            for k, i in enumerate(live):
                lo, hi = bounds[k], bounds[k + 1]
                states[i].delta = int(ids[:, lo:hi].max()) + 1 - (hi - lo)
        for i in live:
            states[i].past = states[i].prompt.length
        step = DecodeStep(cache, tuple(live), (0,) * len(live), prefill=True)
        batch = dataclasses.replace(batch, packing=dataclasses.replace(batch.packing, decode=step))
        return batch.to(self.device), ends

    def _decode_batch(self, states, live: list[int], cache: DecodeCache) -> tuple[MicroBatch, list[int]]:
        """One token per live sequence (its last) at its next position, all in one segment (``DecodeStep``); under
        sequence parallelism a padding segment up to a multiple of TP."""
        n = len(live)
        t = padded_tokens(n, self.config.pad_to_multiple)
        tokens = torch.full((1, t), self.config.pad_id, dtype=torch.int64)
        positions = torch.zeros(1, t, dtype=torch.int64)
        segment_ids = torch.full((1, t), -1, dtype=torch.int64)
        past = []
        for k, i in enumerate(live):
            s = states[i]
            tokens[0, k] = s.stream.tokens[-1]
            positions[0, k] = s.past + s.delta
            segment_ids[0, k] = k
            past.append(s.past)
            s.past += 1
        bounds = [0, n] + ([t] if t > n else [])
        fields = {"tokens": tokens, "labels": torch.full((1, t), IGNORE_INDEX, dtype=torch.int64),
                  "position_ids": positions, "segment_ids": segment_ids,
                  "cu_seqlens": torch.tensor(bounds, dtype=torch.int32), "max_seqlen": max(n, t - n),
                  "sample_tokens": torch.ones(n, dtype=torch.int64), "sample_tiles": torch.zeros(n, dtype=torch.int64),
                  "sample_answers": [0] * n, "sample_ids": torch.full((n,), -1, dtype=torch.int64),
                  # a text-only step's vision fields, by the names the families' vision parts give them
                  "image_tile_index": torch.zeros(0, dtype=torch.int64),
                  "mm_token_type_ids": torch.zeros(1, t, dtype=torch.int64),
                  "mrope_position_ids": positions.reshape(1, 1, t).expand(3, 1, t).contiguous()}
        batch = MicroBatch.of(fields, self.batcher.vision_part)
        step = DecodeStep(cache, tuple(live), tuple(past), prefill=False)
        batch = dataclasses.replace(batch, packing=dataclasses.replace(batch.packing, decode=step))
        return batch.to(self.device), list(range(n))
