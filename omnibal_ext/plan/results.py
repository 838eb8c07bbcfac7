"""What a plan holds: :class:`SettingPrediction` per setting and the whole :class:`Plan`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..memory.memory_model import GIB
from .trainer_flags import trainer_command


@dataclass(frozen=True)
class SettingPrediction:
    """Prediction of one setting (see the module docstring).

    stage_time_s: per pipeline rank (all its chunks), forward + backward + recompute seconds of the mean
        micro-batch of this setting's batching (no communication).
    stage_peak_bytes: per pipeline rank, peak memory at the memory shape (bytes per GPU).
    stage_units, recompute_flag, layout_flag: per layout stage (``vpp * pp`` of them; interleaved when vpp > 1).
    boundary_side_bytes: per boundary between layout stages, the side tensors' (DeepStack features') bytes sent with
    the hidden states (``omnibal_ext.model.side_bytes``), per micro-batch and TP rank, at the memory shape.
    iteration_s: mean simulated iteration, slowest DP rank + all-reduce, seconds.
    balanced_iteration_s: the same with every micro-batch at the mean shape, seconds.
    bubble_fraction: idle share of the slowest rank's pipeline (mean over sampled iterations).
    samples_per_iteration: mean samples per iteration; tokens_per_s: real LLM tokens per second,
    whole cluster; gpu_days: one epoch of the plan's ``samples``; speedup: baseline gpu_days / gpu_days.
    """

    setting: str
    batching: str  # "random" or "isf"
    how: str  # which candidate layout/recompute won
    layout_flag: str
    stage_units: tuple[int, ...]
    recompute_flag: str
    stage_time_s: tuple[float, ...]
    stage_peak_bytes: tuple[float, ...]
    fits_memory: bool
    iteration_s: float
    balanced_iteration_s: float
    bubble_fraction: float
    allreduce_s: float
    samples_per_iteration: float
    tokens_per_s: float
    gpu_days: float
    speedup: float = 1.0
    vpp: int = 1  # model chunks per pipeline rank (--virtual-pipeline-model-parallel-size)
    # per boundary of the layout (layout stage k -> k + 1, pp * vpp - 1 of them): bytes of the side tensors
    # (DeepStack features) sent with the hidden states, per micro-batch and TP rank, at the memory shape
    boundary_side_bytes: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["boundary_side_bytes"] = list(self.boundary_side_bytes)
        d["stage_units"] = list(self.stage_units)
        d["stage_time_s"] = list(self.stage_time_s)
        d["stage_peak_bytes"] = list(self.stage_peak_bytes)
        d["stage_peak_gib"] = [b / GIB for b in self.stage_peak_bytes]
        d["straggle_factor"] = self.iteration_s / self.balanced_iteration_s if self.balanced_iteration_s else 1.0
        return d


@dataclass(frozen=True)
class Plan:
    """The whole plan; ``to_dict()`` is the JSON ``pretrain_vlm.py --omnibal-plan`` reads.

    Bytes are per GPU; ``budget_bytes = gpu_memory_bytes * (1 - memory_reserve)``.
    ``rows`` holds the four settings in SETTINGS order; the last (+memory) is the plan itself.
    """

    model: str
    device: str
    gpus: int
    tp: int
    pp: int
    dp: int
    gpu_memory_bytes: float
    budget_bytes: float
    samples: int
    samples_per_group: int
    global_batch_size: int
    num_microbatches: int
    attention: str
    isf: dict
    random: dict
    shapes: dict
    rows: tuple[SettingPrediction, ...]
    trainer_flags: dict
    configs_tried: tuple[dict, ...] = ()
    notes: tuple[str, ...] = ()
    timelines: dict = field(default_factory=dict, compare=False, repr=False)  # setting -> SimResult
    stage_time_bars: dict = field(default_factory=dict, compare=False, repr=False)  # setting -> stage times
    cp: int = 1  # context-parallel size: stage times and memory are one CP rank's
    ep: int = 1  # expert-parallel size (MoE models)
    etp: int = 1  # expert tensor-parallel size (MoE models)
    moe: bool = False  # the model has MoE layers (the report and the JSON say EP and ETP)
    # what the baseline's and the plan's layouts serve at (generation's decode, ``omnibal_ext.model.decode_cost``):
    # {"setting", "layout", "batch", "context", "tokens_per_s", "ms_per_token", "ttft_ms", ...} per layout and batch
    serving: tuple[dict, ...] = ()

    def row(self, setting: str) -> SettingPrediction:
        for r in self.rows:
            if r.setting == setting:
                return r
        raise KeyError(setting)

    @property
    def pipeline_layout(self) -> str:
        return self.row("+memory").layout_flag

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank of the plan (the +memory row; > 1: the interleaved pipeline)."""
        return self.row("+memory").vpp

    @property
    def recompute_plan(self) -> str:
        return self.row("+memory").recompute_flag

    @property
    def trainer_args(self) -> str:
        return trainer_command(self.trainer_flags)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "device": self.device, "gpus": self.gpus, "tp": self.tp, "pp": self.pp,
            "dp": self.dp, "cp": self.cp, **({"ep": self.ep, "etp": self.etp} if self.moe else {}),
            "gpu_memory_bytes": self.gpu_memory_bytes, "budget_bytes": self.budget_bytes,
            "samples": self.samples, "samples_per_group": self.samples_per_group,
            "global_batch_size": self.global_batch_size, "num_microbatches": self.num_microbatches,
            "attention": self.attention,
            "vpp": self.vpp, "pipeline_layout": self.pipeline_layout, "recompute_plan": self.recompute_plan,
            "isf": self.isf, "random": self.random, "shapes": self.shapes,
            "rows": [r.to_dict() for r in self.rows],
            "trainer_flags": dict(self.trainer_flags), "trainer_args": self.trainer_args,
            "configs_tried": list(self.configs_tried), "notes": list(self.notes),
            "serving": [dict(r) for r in self.serving],
        }

