"""Energon task encoders that cost every sample for the online ISF before any pixel is decoded.

A drop-in for any Megatron codebase that reads Energon datasets: it names no model family of this fork.  Mix
``OnlineISFTaskEncoderMixin`` into a ``TaskEncoder`` (before it in the bases) and give it two methods:

* ``sample_cost(sample) -> SampleCost``: the sample's ViT items, LLM tokens and predicted ViT / LLM seconds from
  cheap metadata (the tokenized text's length, image headers: ``image_size``, video headers: ``video_header``);
  Energon runs it in its loader's worker processes, as ``preencode_sample`` (a ``UserError`` it raises, such as
  an unreadable image, comes out naming the sample's shard and key);
* ``postencode_sample(sample)``: the sample's real encoding (decoding pixels); the balancer
  (``balancing.OnlineISFLoader``) runs it in the main process on the samples it has selected for a step.

Samples reach the balancer as ``CostedSample`` (the loaded sample, media still encoded bytes, and its cost), one
by one: the mix-in keeps Energon from batching, packing or post-encoding in the workers (``build_batch``), so load
the dataset with ``batch_size=None`` and no ``packing_buffer_size``.  Its ``decoder`` is None: Energon hands the
media over as the bytes of their files.

``TimeRates`` turns counts into predicted seconds with a linear model (per ViT item, per squared item of each image
or video segment, per LLM token, per squared sample length): the rates of this fork's cost model
(``omnibal_ext.model.sample_time.time_coefficients``), or measured ones.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Sequence

from megatron.energon import Sample, stateless
from megatron.energon.edataclass import edataclass
from PIL import Image, UnidentifiedImageError

from omnibal_ext.data.online_isf import SampleCost
from omnibal_ext.errors import UserError


@edataclass
class CostedSample(Sample):
    """A loaded sample (``sample``: media not decoded) and its ``cost``; keeps the sample's key, restore key
    (Energon adds its wrappers' parts to it) and sources."""

    sample: Any
    cost: SampleCost


def _meta(sample: Any, name: str):
    return sample.get(name) if isinstance(sample, dict) else getattr(sample, name, None)


def costed(sample: Any, cost: SampleCost) -> CostedSample:
    """``sample`` (an Energon ``Sample`` or a crude dict) with its ``cost``."""
    return CostedSample(__key__=_meta(sample, "__key__"), __restore_key__=_meta(sample, "__restore_key__"),
                        __subflavors__=_meta(sample, "__subflavors__"), __sources__=_meta(sample, "__sources__"),
                        sample=sample, cost=cost)


def sample_where(sample: Any) -> str:
    """``shard:key`` of a loaded or costed sample, for messages (its first source's shard, else its key)."""
    key = _meta(sample, "__key__")
    sources = _meta(sample, "__sources__") or ()
    return f"{sources[0].shard_name}:{key}" if sources else str(key)


@dataclass(frozen=True)
class TimeRates:
    """A linear time model, seconds per unit (forward + backward of one training step).

    vit_item_s: per ViT item (tile or patch); vit_item_sq_s: per squared item count of each attention segment (an
    image, or a video's temporal patch); llm_token_s: per LLM token; llm_token_sq_s: per squared sample length
    (attention within the sample).
    """

    vit_item_s: float
    vit_item_sq_s: float
    llm_token_s: float
    llm_token_sq_s: float

    def cost(self, segments: Sequence[int], tokens: int) -> SampleCost:
        """The cost of a sample whose ViT attends ``segments`` (items per image or per video temporal patch) and
        whose LLM sequence holds ``tokens`` tokens."""
        items = int(sum(segments))
        vit = self.vit_item_s * items + self.vit_item_sq_s * float(sum(int(s) ** 2 for s in segments))
        return SampleCost(items, int(tokens), vit, self.llm_token_s * tokens + self.llm_token_sq_s * float(tokens) ** 2)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) in px of an encoded image, from its header (no pixel is decoded)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return int(im.width), int(im.height)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise UserError(f"not a readable image ({e})") from None


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container says: ``frames`` (counted from the packets when the header lacks it), ``width``,
    ``height`` in px, ``fps``."""

    frames: int
    width: int
    height: int
    fps: float


def video_header(data: bytes) -> VideoHeader:
    """The first video stream's header of an encoded video (PyAV; no frame is decoded).  A header without a frame
    count has its packets counted (demuxing only); a file without a video stream is refused."""
    import av  # PyAV: a slow import, only when a video is read

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise UserError("the video has no video stream")
            stream = container.streams.video[0]
            frames = int(stream.frames or 0)
            if frames <= 0:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            fps = float(stream.average_rate or stream.guessed_rate or 0.0)
            return VideoHeader(frames, int(stream.codec_context.width), int(stream.codec_context.height), fps)
    except av.FFmpegError as e:
        raise UserError(f"not a readable video ({e})") from None


class OnlineISFTaskEncoderMixin:
    """Mix into an Energon ``TaskEncoder`` (first in the bases): ``preencode_sample`` costs each sample in the
    loader's workers (``sample_cost``, to define), nothing is batched or post-encoded there; the balancer
    post-encodes the samples it selects (``postencode_sample``, to define).  See the module docstring."""

    decoder = None  # media reach sample_cost and postencode_sample as the bytes of their files

    def sample_cost(self, sample: Any) -> SampleCost:
        """The cost of a loaded sample, from cheap metadata only."""
        raise NotImplementedError(f"{type(self).__name__} must define sample_cost(sample) -> SampleCost")

    @stateless
    def preencode_sample(self, sample: Any) -> CostedSample:
        try:
            return costed(sample, self.sample_cost(sample))
        except UserError as e:  # name the sample; Energon's error handler decides whether to skip it
            raise UserError(f"{sample_where(sample)}: {e}") from None

    def build_batch(self, dataset, *, batch_size, batch_drop_last=False, packing_buffer_size=None, worker_config):
        """No batching, packing or post-encoding in the workers: the balancer selects, post-encodes and groups."""
        if batch_size is not None or packing_buffer_size is not None:
            raise UserError(f"{type(self).__name__}: the online ISF balancer forms the groups; load the dataset "
                            f"with batch_size=None and no packing_buffer_size (got batch_size={batch_size}, "
                            f"packing_buffer_size={packing_buffer_size})")
        return dataset
