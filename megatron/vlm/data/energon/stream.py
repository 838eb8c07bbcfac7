"""One data-parallel rank's Energon samples in the training process: the savable loader, epoch after epoch, and
the samples pulled from it but not served yet, with an exact position to save and restore.

The loader is Energon's ``SavableDataLoader``, one per data-parallel rank (``WorkerConfig(rank=dp_rank,
world_size=dp, num_workers=...)``): every pipeline stage (and context-parallel rank) of a data-parallel rank builds
its own with the same rank, so they read the same stream; its workers run ``encoder.ChatTaskEncoder``.  A single
dataset or an epochized blend is read epoch by epoch (Energon's ``repeat=False``: each sample once per epoch, the end
of an epoch seen); a weighted blend is one endless stream that samples by weight, as Energon defines it.

``SampleStream`` keeps a look-ahead ``buffer`` of samples pulled from the loader (``look_ahead.LookAhead``: oldest
first, with their costs' table) for the grouping to choose from.  Its state (``state_dict``) is the loader's
(``save_state_rank``: the position after the last sample pulled) plus the restore keys of the buffered samples, which
``load_state_dict`` fetches again (``SavableDataLoader.restore_sample``): a resume serves the same samples in the
same order.  Energon restores a loader only with the same data-parallel size and worker count; the state records both
and a change is refused by name.

A sample that cannot be read (``EncodedChat.problem``, or an error Energon meets reading its shard) stops the run
with one line naming it, or, with ``skip_bad``, is left out, printed and appended to the skipped-samples file.
"""
from __future__ import annotations

import os
import pickle
import tarfile
import threading
import time
from dataclasses import dataclass

from megatron.energon import WorkerConfig, get_savable_loader
from megatron.energon.metadataset.loader_interface import DatasetBlendMode

from omnibal_ext.errors import UserError

from megatron.vlm.data.loader_workers import stop_workers

from .dataset import load_datasets
from .encoder import ChatTaskEncoder, EncodedChat
from .layout import EnergonDataError
from .look_ahead import LookAhead


_LISTED: set[str] = set()  # the left-out samples this process has listed
DATA_ERRORS = (UserError, OSError, EOFError, tarfile.TarError, UnicodeDecodeError)  # a sample's data, not a bug


class EnergonSampleError(UserError):
    """A sample Energon could not load (its shard, key and reason)."""


@dataclass(frozen=True)
class LoaderSettings:
    """One rank's loader: ``path`` (a dataset folder or metadataset YAML), ``split``, ``training`` (shuffled; the
    train split), ``dp_rank``/``dp_size`` (Energon's rank and world size), ``num_workers``, ``seed`` (Energon's
    seed offset: its shuffles), ``prefetch_factor``."""

    path: str
    split: str
    training: bool
    dp_rank: int
    dp_size: int
    num_workers: int
    seed: int = 0
    prefetch_factor: int = 2


@dataclass(frozen=True)
class SkipPolicy:
    """What a bad sample does: stops the run (``skip`` False) or is left out, printed (``announce``) and listed in
    ``report`` (a file, or None)."""

    skip: bool = False
    report: str | None = None
    announce: bool = True

    def __call__(self, exc: Exception, sample, sources=None) -> None:
        """Energon's error handler (in its workers): a failure reading a sample's data names its shard and key; any
        other exception is a bug and keeps its traceback."""
        if not isinstance(exc, DATA_ERRORS):
            raise exc
        where = _sources_name(sources) or getattr(sample, "__key__", "?")
        reason = " ".join(str(exc).split()) or type(exc).__name__
        message = f"{where}: {reason}"
        if not self.skip:
            raise EnergonSampleError(message)
        self.skipped(message)

    def skipped(self, message: str) -> None:
        """Print and list a left-out sample (once per process: a later epoch meets it again)."""
        if message in _LISTED:
            return
        _LISTED.add(message)
        if self.announce:
            print(f"> data: skipped {message}", flush=True)
        if self.report:
            os.makedirs(os.path.dirname(os.path.abspath(self.report)), exist_ok=True)
            with open(self.report, "a") as f:
                f.write(message + "\n")


def _sources_name(sources) -> str | None:
    if not sources:
        return None
    src = sources[0]
    names = getattr(src, "file_names", ()) or ()
    key = names[0].split(".", 1)[0] if names else "?"
    return f"{src.shard_name}/{key}"


def worker_error_line(exc: BaseException) -> str:
    """The one-line message of a ``UserError`` raised in a loader worker (torch re-raises it with the worker's
    traceback in its text; its last line is the message)."""
    text = str(exc).rstrip()
    name = type(exc).__name__
    last = text.splitlines()[-1] if text else ""
    return last[len(name) + 2:] if last.startswith(name + ": ") else " ".join(text.split())


def _exit_with_parent() -> None:
    """In a forked loader worker: exit as soon as the training process is gone.  torch's worker notices a dead parent
    only between samples, and a worker whose result pipe is full (prefetched samples nobody reads after a SIGKILL)
    never gets there: it would live on, holding the launcher's output pipes open."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_WATCHING: list[bool] = []  # whether this process's forks run ``_exit_with_parent``


def build_loader(settings: LoaderSettings, encoder: ChatTaskEncoder, policy: SkipPolicy):
    """(Energon's ``SavableDataLoader`` of ``settings``, whether it reads epoch by epoch, samples per epoch of this
    rank's share or None for a weighted blend)."""
    if not _WATCHING:
        os.register_at_fork(after_in_child=_exit_with_parent)
        _WATCHING.append(True)
    worker_config = WorkerConfig(rank=settings.dp_rank, world_size=settings.dp_size,
                                 num_workers=settings.num_workers, seed_offset=settings.seed,
                                 global_error_handler=policy)
    loaded = load_datasets(settings.path, settings.split, worker_config, settings.training)
    epochs = not settings.training or loaded.blend_mode != DatasetBlendMode.DATASET_WEIGHT  # validation: passes
    if settings.training:
        dataset = encoder.build_train_datasets(datasets=loaded.datasets, worker_config=worker_config,
                                               batch_size=None, shuffle_buffer_size=None,
                                               blend_mode=loaded.blend_mode, repeat=not epochs)
    else:
        dataset = encoder.build_val_datasets(datasets=loaded.datasets, worker_config=worker_config, batch_size=None)
    loader = get_savable_loader(dataset, prefetch_factor=settings.prefetch_factor, watchdog_timeout_seconds=None)
    return loader, epochs


class SampleStream:
    """This rank's samples in order (see the module docstring); ``buffer``: pulled, not yet served."""

    def __init__(self, settings: LoaderSettings, encoder: ChatTaskEncoder, policy: SkipPolicy):
        self.settings, self.policy, self._encoder = settings, policy, encoder
        self.loader, self.epochs = build_loader(settings, encoder, policy)
        self.buffer = LookAhead()
        self.exhausted = False  # the loader's current epoch has ended (epoch by epoch only)
        self.epoch = 0
        self.skipped = 0
        self.closed = False  # ``close``: its loader's workers are stopped
        self._it = None

    # ------------------------------------------------------------------ reading
    def _pull(self) -> EncodedChat | None:
        """The next readable sample of the loader's current epoch, or None at its end."""
        while True:
            if self._it is None:
                self._it = iter(self._open_loader())
            try:
                sample = next(self._it)
            except StopIteration:
                self._it = None
                if not self.epochs:
                    raise EnergonDataError(f"{self.settings.path}: the weighted blend's stream ended") from None
                self._renew_loader()
                return None
            except UserError as e:  # raised in a worker: torch puts the worker's traceback in its text
                raise EnergonSampleError(worker_error_line(e)) from None
            except (tarfile.TarError, EOFError) as e:  # a shard broken where its index did not see it
                raise EnergonSampleError(f"{self.settings.path}: a shard of split {self.settings.split!r} is "
                                         f"unreadable ({type(e).__name__}: {worker_error_line(e)}); re-index it "
                                         "with `energon prepare`") from None
            if sample.problem is None:
                return sample
            if not self.policy.skip:
                raise EnergonSampleError(sample.problem)
            self.skipped += 1
            self.policy.skipped(sample.problem)

    def _renew_loader(self) -> None:
        """A fresh loader at the end of an epoch, restored from the old one's state: the next epoch's workers start
        as a resumed run's do (Energon keeps a restored loader's worker rotation into its later epochs, so a run and
        its resumed copy would otherwise interleave the workers of the next epoch differently)."""
        state = self._open_loader().save_state_rank()
        stop_workers(self.loader)
        self.loader = build_loader(self.settings, self._encoder, self.policy)[0]
        self.loader.restore_state_rank(state)

    def close(self) -> None:
        """Stop the loader's worker processes now (``loader_workers``): the stream is done with (its workers would
        not answer a later state request: using it again is an error)."""
        self._it = None
        stop_workers(self.loader)
        self.closed = True

    def _open_loader(self):
        """The loader, refused after ``close`` (its stopped workers would leave a state request waiting forever)."""
        if self.closed:
            raise RuntimeError("SampleStream: used after close()")
        return self.loader

    def fill(self, size: int) -> None:
        """Pull until ``size`` samples are buffered or the current epoch ends (``exhausted``)."""
        new: list[EncodedChat] = []
        while len(self.buffer) + len(new) < size and not self.exhausted:
            sample = self._pull()
            if sample is None:
                self.exhausted = True
            else:
                new.append(sample)
        self.buffer.append(new)

    def next_sample(self) -> EncodedChat:
        """The oldest unserved sample, starting the next epoch when this one is over."""
        self.fill(1)
        if not self.buffer:
            self.next_epoch()
            self.fill(1)
            if not self.buffer:
                raise EnergonDataError(f"{self.settings.path}: split {self.settings.split!r} gives data-parallel "
                                       f"rank {self.settings.dp_rank} no sample")
        return self.buffer.take([0])[0]

    def next_epoch(self) -> None:
        """Start the loader's next epoch (the buffer must be served first)."""
        if self.buffer:
            raise RuntimeError(f"SampleStream.next_epoch: {len(self.buffer)} sample(s) of epoch {self.epoch} unserved")
        self.exhausted = False
        self.epoch += 1

    def restart(self) -> None:
        """Back to the start of a fresh pass (evaluation: the same samples each time)."""
        self._it = None
        self.buffer, self.exhausted = LookAhead(), False

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict:
        """The position (see the module docstring); picklable."""
        return {"dp_size": self.settings.dp_size, "num_workers": self.settings.num_workers,
                "loader": self._open_loader().save_state_rank(), "buffer": self.buffer.restore_keys(),
                "exhausted": self.exhausted, "epoch": self.epoch, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s position; refuses another data-parallel size or worker count by name."""
        s = self.settings
        for flag, saved, now in (("the data-parallel size", state["dp_size"], s.dp_size),
                                 ("--num-workers", state["num_workers"], s.num_workers)):
            if saved != now:
                raise UserError(f"the checkpoint's Energon loader state was saved with {flag} {saved}, this run has "
                                f"{now}: Energon restores a loader only with the same data-parallel size and worker "
                                f"count; resume with {flag} {saved}")
        self._open_loader().restore_state_rank(state["loader"])
        self._it = None
        self.buffer = LookAhead.restored(self.loader, state["buffer"])
        self.exhausted, self.epoch, self.skipped = bool(state["exhausted"]), int(state["epoch"]), int(state["skipped"])


def pack_state(state: dict) -> bytes:
    """A stream's state as bytes (Energon's state objects pickled: a checkpoint holds it as a uint8 tensor)."""
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_state(data: bytes) -> dict:
    return pickle.loads(data)
