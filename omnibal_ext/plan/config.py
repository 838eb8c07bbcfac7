"""What a plan is asked for: :class:`PlanConfig`, its checks, and :class:`PlanError`."""
from __future__ import annotations

from dataclasses import dataclass

from ..data.stats import SampleStats
from ..errors import UserError
from ..memory.memory_model import GIB
from ..model.cost_model import DeviceSpec, get_device
from ..model.trainable import Freeze, Trainable
from ..model.units import ModelSpec, build_units, get_preset

SETTINGS = ("baseline", "+data", "+model", "+memory")
DEFAULT_GLOBAL_BATCH = 1024  # samples per iteration (an assumption; see scripts/reproduce_paper.py)


class PlanError(UserError):
    """No configuration fits, or the request cannot be planned (the message says why)."""


def check_moe_request(config: "PlanConfig") -> None:
    """Raise PlanError naming the expert-parallel flag that cannot work with the model."""
    for name, v in (("--ep", config.ep), ("--etp", config.etp)):
        if v is not None and (isinstance(v, bool) or v < 1 or int(v) != v):
            raise PlanError(f"{name} must be a positive integer, got {v}")
    moe = config.spec.language.moe
    if moe is None:
        for name, v in (("--ep", config.ep), ("--etp", config.etp), ("--moe-imbalance", config.moe_imbalance)):
            if v is not None and (name == "--moe-imbalance" or v > 1):
                raise PlanError(f"{name} {v}: model {config.spec.name!r} has no experts (LanguageSpec.moe is None)")
        return
    if config.ep is not None and moe.num_experts % config.ep:
        raise PlanError(f"--ep {config.ep} does not divide the model's {moe.num_experts} experts")
    if config.moe_imbalance is not None and not config.moe_imbalance >= 1:
        raise PlanError(f"--moe-imbalance must be >= 1 (the busiest EP rank's routed tokens over the mean), "
                        f"got {config.moe_imbalance}")


@dataclass(frozen=True)
class PlanConfig:
    """Everything :func:`~omnibal_ext.plan.make_plan` needs besides the per-sample statistics.

    Sizes left at None are chosen by the planner; the CLI flag of each field is ``--field-name``.
    """

    model: ModelSpec | str  # a ModelSpec or a preset name
    gpus: int  # GPUs in all
    gpu_memory_bytes: float  # memory of one GPU, bytes
    tp: int | None = None  # tensor-parallel size (None: chosen)
    pp: int | None = None  # pipeline-parallel size, stages (None: chosen)
    dp: int | None = None  # data-parallel size (None: gpus / (tp * pp * cp))
    cp: int = 1  # context-parallel size (--context-parallel-size; a constraint, not searched)
    device: str | DeviceSpec = "a100-80g"  # cost-model device: a DeviceSpec or a preset name
    samples: int | None = None  # dataset size for GPU-days, samples per epoch (None: the stats' count)
    samples_per_group: int = 4  # K: samples per micro-batch (random batching), target per ISF group
    max_seq_length: int | None = None  # fixed ISF token cap Qt, tokens per group (None: searched from K)
    global_batch_size: int = DEFAULT_GLOBAL_BATCH  # samples per iteration (rounded up to whole micro-batches)
    memory_reserve: float = 0.1  # fraction of GPU memory left out of the budget, in [0, 1)
    attention: str = "unfused"  # attention kernel of the cost model: "unfused" or "flash"
    sim_iterations: int = 8  # iterations simulated per setting
    isf_max_candidates: int = 20  # ISF threshold candidates searched
    isf_search_samples: int = 40_000  # samples the ISF candidates are evaluated on
    require_baseline_fit: bool = False  # only configurations where the Megatron default also fits memory
    # which setting's speed picks the parallel sizes among those where the balanced plan fits: "omnibal"
    # (the fastest plan) or "baseline" (the fastest Megatron default; the ablation then holds it fixed)
    choose_for: str = "omnibal"
    min_pp: int = 1  # consider only pipelines of at least this many stages (an ablation of the model level needs 2)
    seed: int = 0  # seeds random batching, the ISF search and the step order
    # model chunks per pipeline rank (the interleaved pipeline): None: chosen among 1..max_vpp where the
    # micro-batches per pipeline allow it (>= PP and a multiple of PP) and the simulator predicts it faster
    vpp: int | None = None
    max_vpp: int = 2  # largest V tried when vpp is None
    freeze: Freeze = Freeze()  # frozen parts of the model (--freeze-vit, ...): costs and memory follow
    # mixture-of-experts models (LanguageSpec.moe): expert-parallel sizes (None: searched; omnibal_ext.model.moe) and
    # the busiest EP rank's routed tokens over the mean (None: the experts' time at the mean, their memory at the
    # no-drop worst case; omnibal_ext.model.moe_cost)
    ep: int | None = None
    etp: int | None = None
    moe_imbalance: float | None = None
    # (EP, the busiest EP rank's routed tokens over the mean) measured on the training data by ``omnibal profile``
    # (``--moe-profile``: ``omnibal_ext.model.expert_load``), what an unset moe_imbalance takes at each EP tried
    measured_imbalance: tuple[tuple[int, float], ...] = ()
    # serving (``omnibal_ext.model.decode_cost``): the decode batches (sequences in flight) and cached tokens per
    # sequence (None: the data's mean sample tokens) the report's tokens/s are predicted at, per layout
    serve_batches: tuple[int, ...] = (1, 32)
    serve_context: int | None = None

    def imbalance_at(self, ep: int) -> float | None:
        """The expert load the plan prices at EP ``ep``: ``moe_imbalance``, else the measured one there, else None."""
        if self.moe_imbalance is not None:
            return self.moe_imbalance
        return dict(self.measured_imbalance).get(ep)

    @property
    def trainable(self) -> Trainable | None:
        """The units that train under ``freeze`` (None: all of them)."""
        if not self.freeze.any:
            return None
        return self.freeze.trainable(build_units(self.spec), self.spec.language.tie_word_embeddings, self.spec)

    @property
    def spec(self) -> ModelSpec:
        """The model (a preset name resolved)."""
        return get_preset(self.model) if isinstance(self.model, str) else self.model

    @property
    def device_spec(self) -> DeviceSpec:
        """The cost model's device (a preset name resolved)."""
        return get_device(self.device) if isinstance(self.device, str) else self.device

    @property
    def budget_bytes(self) -> float:
        """Memory a stage may use, bytes per GPU: ``gpu_memory_bytes * (1 - memory_reserve)``."""
        return float(self.gpu_memory_bytes) * (1.0 - self.memory_reserve)

    def epoch_samples(self, stats: SampleStats) -> int:
        """Samples of one epoch for GPU-days: ``samples``, else the stats' count."""
        return int(self.samples if self.samples is not None else len(stats))


def check_request(config: PlanConfig, stats: SampleStats) -> None:
    """Raise PlanError naming the first flag that cannot work with these stats."""
    gpus, tp, pp, dp = config.gpus, config.tp, config.pp, config.dp
    if gpus < 1 or int(gpus) != gpus:
        raise PlanError(f"--gpus must be a positive integer, got {gpus}")
    if not config.gpu_memory_bytes > 0:
        raise PlanError(f"--gpu-memory must be > 0, got {config.gpu_memory_bytes / GIB:g} GiB")
    if not 0 <= config.memory_reserve < 1:
        raise PlanError(f"memory_reserve must be in [0, 1), got {config.memory_reserve}")
    if not config.serve_batches or any(b < 1 for b in config.serve_batches):
        raise PlanError(f"--serve-batch must be batches >= 1, got {list(config.serve_batches)}")
    if config.serve_context is not None and config.serve_context < 0:
        raise PlanError(f"--serve-context must be >= 0 tokens, got {config.serve_context}")
    k = config.samples_per_group
    if k < 1 or int(k) != k:
        raise PlanError(f"--samples-per-group must be a positive integer (the trainer's --micro-batch-size), "
                        f"got {k}")
    if config.global_batch_size < 1 or config.sim_iterations < 1:
        raise PlanError("global_batch_size and sim_iterations must be >= 1")
    cp = config.cp
    for name, v in (("--tp", tp), ("--pp", pp), ("--dp", dp), ("--cp", cp)):
        if v is not None and (v < 1 or int(v) != v):
            raise PlanError(f"{name} must be a positive integer, got {v}")
    if gpus % cp:
        raise PlanError(f"--cp {cp} does not divide --gpus {gpus}")
    if tp is not None and pp is not None and dp is not None and tp * pp * dp * cp != gpus:
        raise PlanError(f"--tp {tp} x --pp {pp} x --dp {dp} x --cp {cp} = {tp * pp * dp * cp} but --gpus is {gpus}")
    if config.vpp is not None and config.vpp < 1:
        raise PlanError(f"--vpp must be >= 1, got {config.vpp}")
    check_moe_request(config)
    if config.max_vpp < 1:
        raise PlanError(f"--max-vpp must be >= 1, got {config.max_vpp}")
    if len(stats) == 0:
        raise PlanError("the stats hold no samples")
    if config.choose_for not in ("omnibal", "baseline"):
        raise PlanError(f"choose_for must be 'omnibal' or 'baseline', got {config.choose_for!r}")
    if config.attention not in ("unfused", "flash"):
        raise PlanError(f"--attention must be 'unfused' or 'flash', got {config.attention!r}")
    if config.epoch_samples(stats) < 1:
        raise PlanError(f"--samples must be >= 1, got {config.epoch_samples(stats)}")
