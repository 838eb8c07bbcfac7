"""The trainer's Energon ``TaskEncoder``: a chat sample -> its tokens and its cost, in the loader's worker processes.

``encode_sample`` runs in Energon's workers on every sample of the stream (every pipeline stage of a data-parallel
rank runs the same, so the stages see the same samples and the same verdicts).  It reads the record
(``samples.record_of``), the images' headers (``PIL``: no pixel decoded) and the videos' headers (PyAV), lays the
record out as the JSONL path does (``record_sample.layout_record``: the family's rules, the chat template, the
truncation) and makes the sample's text fields and its cost (``costs.CostModel``).  Pixels are decoded later, in the
main process, for the samples chosen (``EncodedChat.pixels``), and only by a stage that reads them.

A sample this trainer cannot read (a missing or unreadable member, a record whose tags and media disagree, an image
or video its family refuses, a sample over ``--seq-length``) comes out as an ``EncodedChat`` with ``problem`` set to
one line naming it (``shard.tar/key: reason``): the main process stops the run with it, or, under
``--skip-bad-samples``, leaves it out and logs it.  With ``verify`` (what ``--skip-bad-samples`` asks), every image
and every sampled video frame is decoded here once, as the JSONL path's scan does, so that a sample whose pixels
are broken behind a readable header is left out on every stage alike; without it, such a sample stops the run
where its pixels are decoded, named.

Each sample's seed of the video rules' draws is its record's (``video_seed``): from ``omnibal_origin``
(``[source, line]`` of the JSONL record it was converted from: the same draws as the JSONL path), else from its key.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

from megatron.energon import Sample, TaskEncoder, edataclass
from megatron.energon.task_encoder.base import stateless

from omnibal_ext.data.online_isf import SampleCost
from omnibal_ext.errors import UserError

from ..record_sample import (ReaderConfig, RecordLayout, VideoPlan, image_flags, layout_record, plan_videos,
                             record_turns, sample_pixels, sample_text)
from ..video_decode import decode_frames
from .costs import CostModel
from .samples import MemberMedia, record_of, sample_name

ORIGIN_KEY = "omnibal_origin"  # [source, line] of the JSONL record a converted sample comes from


def sample_id_of(name: str) -> int:
    """A sample's 62-bit id (the drop path's key, the logged sample ids) from its ``shard.tar/key`` name."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 2


def origin_of(record: dict, name: str) -> tuple[int, int]:
    """(source, line) that seeds the record's video draws: its ``omnibal_origin`` or a hash of its name."""
    origin = record.get(ORIGIN_KEY)
    if isinstance(origin, list) and len(origin) == 2 and all(isinstance(v, int) for v in origin):
        return int(origin[0]), int(origin[1])
    h = sample_id_of(name)
    return h >> 31, h & 0x7FFFFFFF


@edataclass
class EncodedChat(Sample):
    """A sample after ``encode_sample``: ``name`` (``shard.tar/key``), ``sample_id``; ``problem`` (one line naming
    it) for a sample that cannot be read, else its text fields (``record_sample.sample_text``), cost, layout and
    what its pixels are made from (``media`` None on a stage that reads no pixels)."""

    name: str
    sample_id: int
    problem: Optional[str] = None
    text: Optional[dict] = None
    cost: Optional[SampleCost] = None
    layout: Optional[RecordLayout] = None
    turns: Optional[list] = None
    images: Optional[list] = None
    videos: Optional[list] = None
    video_plan: Optional[VideoPlan] = None
    media: Optional[Any] = None

    def sample(self, config: ReaderConfig, pixels: bool) -> dict:
        """The sample as ``RecordDataset.sample`` gives it (``pixels``: with ``pixel_values``, decoded now, else
        ``image_flags`` only), with its ``sample_id``; a ``UserError`` naming it when its pixels are broken."""
        if not pixels:
            extra = {"image_flags": image_flags(self.layout, config.images)}
        else:
            extra = sample_pixels(self.layout, self.turns, self.images, self.videos, self.video_plan, self.media,
                                  config, self.name)
        return {**self.text, **extra, "sample_id": self.sample_id}


@dataclass(frozen=True)
class EncoderSettings:
    """What the workers need: the reader's ``config`` (family rules, lengths), the ``tokenizer``, the ``cost`` model,
    ``keep_media`` (this stage decodes pixels later) and ``verify`` (decode every image and frame now)."""

    config: ReaderConfig
    tokenizer: Any
    cost: CostModel
    keep_media: bool = True
    verify: bool = False


class ChatTaskEncoder(TaskEncoder):
    """Energon ``TaskEncoder`` of chat samples (see the module docstring); no batching in Energon (the main process
    groups the samples)."""

    __default_failure_tolerance__ = 0  # a failure here is a bug (bad data comes out as ``problem``)

    def __init__(self, settings: EncoderSettings):
        self.settings = settings

    @stateless
    def encode_sample(self, sample) -> EncodedChat:
        name = sample_name(sample)
        try:
            return self._encode(sample, name)
        except UserError as e:
            message = str(e)
            return EncodedChat.derive_from(sample, name=name, sample_id=sample_id_of(name),
                                           problem=message if message.startswith(name) else f"{name}: {message}")

    def _encode(self, sample, name: str) -> EncodedChat:
        s = self.settings
        cfg = s.config
        record, media = record_of(sample)
        turns, images, videos = record_turns(record)
        source, line = origin_of(record, name)
        sizes = [_image_size(media, ref, s.verify) for ref in images]
        video_plan = plan_videos(turns, videos, media, cfg.videos, cfg.seed, source, line)
        if s.verify:
            for video, info, taken in zip(videos, video_plan.infos, video_plan.indices):
                decode_frames(media.video(video.path), info, taken, name)
        layout = layout_record(turns, [media.image_name(r) for r in images], sizes, video_plan, s.tokenizer, cfg)
        text = sample_text(layout, turns, videos, video_plan, cfg, s.tokenizer)
        return EncodedChat.derive_from(
            sample, name=name, sample_id=sample_id_of(name), text=text, cost=s.cost(layout, cfg.images),
            layout=layout, turns=list(turns), images=list(images), videos=list(videos), video_plan=video_plan,
            media=media if s.keep_media else None)

    def batch(self, samples):
        return samples


def _image_size(media: MemberMedia, ref: str, verify: bool) -> tuple[int, int]:
    """(width, height) px of an image member: its header, or (``verify``) after decoding every pixel."""
    with media.open_image(ref) as im:
        if verify:
            try:
                im.load()
            except OSError as e:
                raise UserError(f"{media.image_name(ref)}: cannot decode image ({' '.join(str(e).split())})") \
                    from None
        return im.size


__all__ = ["ChatTaskEncoder", "EncodedChat", "EncoderSettings", "ORIGIN_KEY", "origin_of", "sample_id_of"]
