"""An Energon chat sample's members -> a record as the JSONL path reads it, and its media (``MemberMedia``).

This trainer's layout holds the record itself (``record.json``; its image and video paths are member names).
Megatron-Bridge's holds a ChatML conversation (``field_map['conversation']``) whose image and video parts carry no
path, the images in ``field_map['imgs']`` (one image member, or a pickled list of image bytes: ``jpgs``) and the
video in ``field_map['videos']`` (one video file member, e.g. ``video.mp4``).  Its conversation is written as the
record the JSONL path would read: a list of ``role``/``content`` messages (a string with ``<image>``/``<video>``
tags, or typed parts: ``{"type": "image"}``, ``{"type": "video"}``, ``{"type": "text", "text": ...}``) becomes a
``messages`` record; ``from``/``value`` turns (or ``{"conversations": [...]}``) a ``conversations`` record.  Its
k-th image placeholder or part takes the k-th image, its video the video; a count that differs from the media is
refused, naming the sample (``TagMismatch``).  The messages are written with typed parts, each image and video
part (a string's tags split into parts) carrying its medium in reading order: the same turns as the string.  Pickled lists of video frames (Bridge's ``mp4s``/``videos``) are not
read (refused by name).

A sample is named ``shard.tar/key`` in every message (``sample_name``).
"""
from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from omnibal_ext.errors import UserError

from ..messages import IMAGE_TAG, VIDEO_TAG
from ..record_sample import MediaSource
from ..video_decode import VideoBytes
from .layout import BRIDGE, RECORD_MEMBER

PICKLED_IMAGE_LISTS = ("jpgs",)  # Bridge's pickled lists of image bytes (member extensions)
PICKLED_FRAME_LISTS = ("mp4s", "videos")  # Bridge's pickled lists of frame lists: not read
_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")


class SampleError(UserError):
    """A sample this trainer cannot read; the message starts with ``shard.tar/key``."""


class TagMismatch(SampleError):
    """A Bridge sample whose image/video placeholders and media members disagree in number."""


def sample_name(sample) -> str:
    """``shard.tar/key`` of an Energon sample (its first source)."""
    sources = getattr(sample, "__sources__", None) or ()
    shard = sources[0].shard_name if sources else "?"
    return f"{shard}/{sample.__key__}"


@dataclass(frozen=True)
class MemberMedia(MediaSource):
    """A sample's media: ``files`` maps each medium as its record names it to the member's bytes (``img0.jpg``;
    Bridge's: ``image.png``, ``jpgs[2]``, ``video.mp4``); ``name``: the sample's ``shard.tar/key``."""

    name: str
    files: dict

    def image_name(self, ref: str) -> str:
        return f"{self.name}.{ref}"

    def _bytes(self, ref: str, what: str) -> bytes:
        data = self.files.get(ref)
        if data is None:
            held = ", ".join(sorted(self.files)) or "none"
            raise SampleError(f"{self.name}: its record names {what} {ref!r} but the sample has no such member "
                              f"(its media members: {held})")
        return data

    def open_image(self, ref: str) -> Image.Image:
        data = self._bytes(ref, "the image")
        try:
            return Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise SampleError(f"{self.name}: cannot decode image member {ref} (not an image PIL identifies)") from None
        except OSError as e:
            raise SampleError(f"{self.name}: cannot decode image member {ref} ({' '.join(str(e).split())})") from None

    def video(self, ref: str) -> VideoBytes:
        return VideoBytes(self.image_name(ref), self._bytes(ref, "the video"))


def _json(data: bytes, name: str):
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SampleError(f"{name}: not valid JSON ({getattr(e, 'msg', e)})") from None


def record_of(sample) -> tuple[dict, MemberMedia]:
    """(record as the JSONL path reads it, its media) of a ``dataset.ChatSample``; a ``SampleError`` naming the
    sample for a member that is missing or unreadable."""
    name = sample_name(sample)
    if sample.kind == BRIDGE:
        return _bridge_record(sample, name)
    members = dict(sample.members)
    data = members.pop(RECORD_MEMBER, None)
    if data is None:
        raise SampleError(f"{name}: no {RECORD_MEMBER} member (members: {', '.join(sorted(members)) or 'none'})")
    record = _json(data, f"{name}.{RECORD_MEMBER}")
    if not isinstance(record, dict):
        raise SampleError(f"{name}.{RECORD_MEMBER}: a record must be a JSON object")
    return record, MemberMedia(name, members)


def _bridge_media(sample, name: str) -> tuple[list[str], list[str], dict]:
    """(image refs, video refs, ref -> bytes) of a Bridge sample, in the order its placeholders take them."""
    fmap, members = sample.field_map, sample.members
    files, images, videos = {}, [], []
    image_member = fmap.get("imgs")
    if image_member is not None and image_member in members:
        data = members[image_member]
        if image_member.rsplit(".", 1)[-1] in PICKLED_IMAGE_LISTS:
            try:
                items = pickle.loads(data)
            except Exception as e:  # noqa: BLE001 - any unpickling failure is this member's problem
                raise SampleError(f"{name}.{image_member}: not a pickled list of image bytes ({e})") from None
            if not isinstance(items, (list, tuple)) or not all(isinstance(b, (bytes, bytearray)) for b in items):
                raise SampleError(f"{name}.{image_member}: not a pickled list of image bytes")
            for k, b in enumerate(items):
                images.append(f"{image_member}[{k}]")
                files[images[-1]] = bytes(b)
        else:
            images.append(image_member)
            files[image_member] = data
    video_member = fmap.get("videos")
    if video_member is not None and video_member in members:
        if video_member.rsplit(".", 1)[-1] in PICKLED_FRAME_LISTS:
            raise SampleError(f"{name}.{video_member}: pickled lists of video frames are not read by this trainer "
                              "(store each video as one file member, e.g. video.mp4)")
        videos.append(video_member)
        files[video_member] = members[video_member]
    return images, videos, files


def _placeholders(content) -> tuple[int, int]:
    """(image, video) placeholders of a ChatML content: tags in a string, typed parts in a list."""
    if isinstance(content, str):
        return content.count(IMAGE_TAG), content.count(VIDEO_TAG)
    if isinstance(content, list):
        kinds = [p.get("type") for p in content if isinstance(p, dict)]
        return kinds.count("image"), kinds.count("video")
    return 0, 0


def _bridge_record(sample, name: str) -> tuple[dict, MemberMedia]:
    member = sample.field_map["conversation"]
    data = sample.members.get(member)
    if data is None:
        raise SampleError(f"{name}: no {member} member (the field_map's conversation)")
    conversation = _json(data, f"{name}.{member}")
    if isinstance(conversation, dict):
        conversation = conversation.get("conversations", conversation.get("messages"))
    if not isinstance(conversation, list) or not conversation or not all(isinstance(t, dict) for t in conversation):
        raise SampleError(f"{name}.{member}: expected a ChatML list of messages")
    images, videos, files = _bridge_media(sample, name)
    gpt_style = "from" in conversation[0]
    content_key = "value" if gpt_style else "content"
    counts = [_placeholders(t.get(content_key)) for t in conversation]
    n_images, n_videos = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if (n_images, n_videos) != (len(images), len(videos)):
        raise TagMismatch(f"{name}: its conversation has {n_images} image and {n_videos} video placeholder(s) but "
                          f"the sample holds {len(images)} image(s) and {len(videos)} video(s) "
                          f"(field_map {json.dumps(sample.field_map)})")
    media = MemberMedia(name, files)
    if gpt_style:
        record = {"conversations": conversation}
        if images:
            record["image"] = images
        if videos:
            record["video"] = videos[0]
        return record, media
    images, videos = list(images), list(videos)
    return {"messages": [_with_paths(t, images, videos) for t in conversation]}, media


def _with_paths(message: dict, images: list[str], videos: list[str]) -> dict:
    """``message`` with its content as typed parts, each image or video part (a string content's ``<image>`` and
    ``<video>`` tags, or a list content's image and video parts) given the next medium of ``images``/``videos``
    (consumed in reading order)."""
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "image"} if piece == IMAGE_TAG else {"type": "video"} if piece == VIDEO_TAG
                   else {"type": "text", "text": piece} for piece in _TAGS.split(content) if piece]
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            part = {"type": "image", "image": images.pop(0)}
        elif kind == "video":
            part = {"type": "video", "video": videos.pop(0)}
        parts.append(part)
    return {**message, "content": parts}
