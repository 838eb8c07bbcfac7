"""``--eval-generate``: accuracy by generation on the validation set, beside the teacher-forced loss.

At every evaluation (``--eval-interval``) the trainer's teacher-forced pass (``training.evaluate``: the loss and the
answer accuracy, an answer correct when every one of its tokens is the argmax) records which validation samples it
read; then every answer of those samples is generated greedily on the training layout's stages
(``megatron.vlm.inference``), its prompt the sample's tokens before the answer as the trainer rendered them (the
history of a multi-turn sample included), for at most its length + 1 tokens. A sample is correct by generation when
every answer comes back token for token, the end-of-turn token included and nothing after it.

The two accuracies agree by construction wherever the logits agree: greedy decoding reproduces an answer exactly when
each of its tokens is the argmax given the ones before. Each sample where they differ is counted with its cause,
from the same samples teacher-forced in one packed forward as training computes it (``GenerationEngine.
teacher_forced``): ``near-tie`` (at the first token where they part, the top-1 / top-2 gap is below ``TAU``, so the
last digits of two computations of the same logits decide it), ``stop token`` (the answer came back but generation
did not stop after it, or stopped inside it: its end token is not one generation stops at), ``other`` (neither:
a bug). Logged: ``generation acc``, ``generation answers`` (samples), ``generation tf acc`` (the teacher-forced
accuracy of the same samples, the trainer's ``answer acc`` when evaluation reads every validation sample once) and
the counts ``generation differs near-tie`` / ``stop token`` / ``other``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from megatron.core.utils import unwrap_model

from megatron.vlm.inference.build import engine_for_stage
from megatron.vlm.inference.prompts import Prompt, answer_prompts
from megatron.vlm.inference.requests import SamplingParams

from .run_plan import RunPlan

TAU = 1e-4  # a top-1 / top-2 gap below this is a near-tie


def difference_cause(answer: Sequence[int], generated: Sequence[int], tf_argmax: Sequence[int],
                     tf_gaps: Sequence[float], tau: float = TAU) -> str | None:
    """Why generation and teacher forcing disagree on one answer (module docstring), or None when they agree."""
    answer, generated = list(answer), list(generated)
    gen_ok, tf_ok = generated == answer, list(tf_argmax) == answer
    if gen_ok == tf_ok:
        return None
    if tf_ok and (generated[:len(answer)] == answer or answer[:len(generated)] == generated):
        return "stop token"  # every token the argmax, yet generation went on after the answer or stopped inside it
    part = next(j for j in range(len(answer)) if j >= len(generated) or generated[j] != answer[j]
                or tf_argmax[j] != answer[j])
    return "near-tie" if tf_gaps[part] < tau else "other"


class GenerationEval:
    """The generation side of the trainer's evaluation (module docstring), on this rank's stage of the training
    model; ``dp_group``: the data-parallel (gloo) group over which the evaluated samples are gathered."""

    def __init__(self, engine, dataset, dp_group, limit: int | None = None):
        self.engine, self.dataset, self.dp_group, self.limit = engine, dataset, dp_group, limit

    @classmethod
    def build(cls, plan: RunPlan, model, valid_data, dp_group) -> "GenerationEval":
        """On the training ``model`` of the run ``plan``, generating the samples of ``valid_data``."""
        if len(model) > 1:
            raise ValueError("--eval-generate: one stage per pipeline rank (checked with the flags)")
        config = plan.config
        stage = unwrap_model(model[0])
        dataset = valid_data.dataset
        pad = config.parallel.tensor_model_parallel_size if stage.stage_build.sequence_parallel else 1
        engine = engine_for_stage(stage, dataset.tokenizer, dataset.config, pad,
                                  config.model.hf_checkpoint or plan.tokenizer_model)
        return cls(engine, dataset, dp_group, config.log.eval_generate_samples)

    def evaluate(self, records: list[dict]) -> dict:
        """Generate the answers of the samples of ``records`` (``MicroBatches``' records of the evaluation just run,
        every data-parallel rank's gathered); the metrics on the last stage, {} elsewhere."""
        mine = sorted({i for r in records for i in r["ids"] if i >= 0})
        everyone = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(everyone, mine, group=self.dp_group)
        ids = sorted({i for part in everyone for i in part})
        if self.limit is not None:
            ids = ids[:self.limit]
        prompts: list[Prompt] = []
        owner: list[int] = []
        for i in ids:
            for p in answer_prompts(self.dataset.sample(i)):
                prompts.append(p)
                owner.append(i)
        if not prompts:
            return {}
        states = self.engine.run(prompts, [SamplingParams(max_new_tokens=len(p.answer) + 1) for p in prompts])
        forced = self.engine.teacher_forced(prompts)
        if forced is None:
            return {}
        gen_ok = {i: True for i in ids}
        tf_ok = dict(gen_ok)
        causes = {"near-tie": 0, "stop token": 0, "other": 0}
        differing: dict[int, str] = {}
        for p, i, state, (argmax, gaps) in zip(prompts, owner, states, forced):
            gen_ok[i] &= list(state.stream.tokens) == list(p.answer)
            tf_ok[i] &= list(argmax) == list(p.answer)
            cause = difference_cause(p.answer, state.stream.tokens, argmax, gaps)
            if cause is not None and i not in differing:
                differing[i] = cause
        for i, cause in differing.items():
            if gen_ok[i] != tf_ok[i]:
                causes[cause] += 1
        n = len(ids)
        return {"generation acc": sum(gen_ok.values()) / n, "generation tf acc": sum(tf_ok.values()) / n,
                "generation answers": n, **{f"generation differs {k}": v for k, v in causes.items()}}
