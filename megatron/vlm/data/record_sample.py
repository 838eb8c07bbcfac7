"""One record -> one sample: what the JSONL reader (``records.py``) and the Energon reader (``energon/``) share.

A record, in either format (``conversations`` or ``messages``, see ``records.py``), gives turns, its images (as
written) and its videos (``record_turns``).  Its media are found through a ``MediaSource``: files under a folder
(``FileMedia``: the JSONL path) or the members of an Energon sample.  Then, for both paths alike:

* ``plan_videos``: each video's header, the family's frames of it (``VideoRule``), its image blocks and text;
* ``layout_record``: with the images' sizes, every entry's ViT items (the family's ``ImageRule``), the rendered
  conversation (``template.plan_conversation``: the chat template) and the truncation (``ReaderConfig``): tokens
  kept, entries kept, real ViT items; a sample over ``max_seq_length`` is refused unless truncation is on;
* ``sample_text``: ``input_ids``, ``labels``, ``image_sizes`` and a video record's fields;
* ``sample_pixels``: the kept images' and videos' pixels by the family's rules, or the rule's dummy items.

So a record means the same whichever path reads it: the same chat template, truncation and refusals.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omnibal_ext.errors import UserError

from .images import ImageRule
from .messages import VIDEO_TAG, parse_messages_record
from .template import (ChatPlan, ConversationError, IMAGE_PLACEHOLDER, Turn, add_missing_placeholder,
                       count_placeholders, parse_conversations, plan_conversation)
from .video import VideoRule, sampled_frames, video_seed
from .video_decode import VideoPath, decode_frames


@dataclass(frozen=True)
class ReaderConfig:
    """How records become samples: the family's image rule and the text settings (lengths in tokens)."""

    images: ImageRule  # the family's image rule (images.py)
    max_seq_length: int | None = None  # None: no limit
    truncate: bool = False
    system: str | None = None  # system prompt for conversations without their own
    add_bos: bool = True
    seed: int = 0  # for fractional repeat_time and the video rules' draws
    skip_bad: bool = False  # a record with a problem is left out (listed in ScanResult.skipped), not an error
    videos: VideoRule | None = None  # the family's video rule (video.py); None: video records are refused


class MediaSource:
    """Where a record's media are: ``image_name(ref)`` names an image in messages, ``open_image(ref)`` opens it (a
    ``PIL`` image, header read; a ``UserError`` naming it when it is missing or unreadable), ``video(ref)`` is what
    ``video_decode`` reads (a path or the file's bytes).  ``ref``: the image or video as the record writes it."""

    def image_name(self, ref: str) -> str:
        raise NotImplementedError

    def open_image(self, ref: str) -> Image.Image:
        raise NotImplementedError

    def video(self, ref: str) -> VideoPath:
        raise NotImplementedError


@dataclass(frozen=True)
class FileMedia(MediaSource):
    """Media files under ``root`` (a record's paths are relative to it unless absolute)."""

    root: str

    def image_name(self, ref: str) -> str:
        return os.path.join(self.root, ref)

    def open_image(self, ref: str) -> Image.Image:
        path = self.image_name(ref)
        if not os.path.isfile(path):
            raise UserError(f"image file not found: {path}")
        return Image.open(path)

    def video(self, ref: str) -> VideoPath:
        return os.path.join(self.root, ref)


def record_images(record: dict) -> list[str]:
    """The record's image paths: ``image`` as a string, a list of strings, or absent/empty (text-only)."""
    image = record.get("image")
    if image is None or image == "" or image == []:
        return []
    if isinstance(image, str):
        return [image]
    if isinstance(image, list) and all(isinstance(p, str) and p for p in image):
        return list(image)
    raise ConversationError("'image' must be a path or a list of paths")


@dataclass(frozen=True)
class RecordVideo:
    """One video of a record: ``path`` as written (a file or a frame folder), ``clip_s`` the ``(start, end)`` s
    it is cut to (None: whole)."""

    path: str
    clip_s: tuple[float, float] | None = None


def record_videos(record: dict) -> list[RecordVideo]:
    """A ``conversations`` record's video: ``video`` as a path (or absent/empty), with an optional ``clip``."""
    video = record.get("video")
    if video is None or video == "":
        if record.get("clip") is not None:
            raise ConversationError("'clip' without a 'video'")
        return []
    if not isinstance(video, str):
        raise ConversationError("'video' must be a path (a file or a frame folder)")
    clip = record.get("clip")
    if clip is not None:
        if not (isinstance(clip, (list, tuple)) and len(clip) == 2 and all(isinstance(t, (int, float))
                                                                            and not isinstance(t, bool) for t in clip)
                and 0 <= clip[0] < clip[1]):
            raise ConversationError(f"'clip' must be [start, end] in seconds with 0 <= start < end, got {clip!r}")
        clip = (float(clip[0]), float(clip[1]))
    return [RecordVideo(video, clip)]


def count_video_tags(turns: list[Turn]) -> int:
    return sum(t.text.count(VIDEO_TAG) for t in turns if t.role == "user")


def record_turns(record) -> tuple[list[Turn], list[str], list[RecordVideo]]:
    """(turns, image paths as written, videos) of a decoded record of either format; the turns' user text holds
    an ``<image>`` per image and a ``<video>`` per video.  Its problems raise a ``UserError`` (the caller names
    ``file:line``)."""
    if not isinstance(record, dict):
        raise ConversationError("record must be a JSON object")
    if "messages" in record:
        conversation = parse_messages_record(record, "")
        return ([Turn(t.role, t.text) for t in conversation.turns], list(conversation.images),
                [RecordVideo(p) for p in conversation.videos])
    if "conversations" not in record:
        raise ConversationError("missing 'conversations'")
    images = record_images(record)
    videos = record_videos(record)
    turns = add_missing_placeholder(parse_conversations(record["conversations"]), len(images))
    if any(VIDEO_TAG in t.text for t in turns if t.role != "user"):
        raise ConversationError(f"a {VIDEO_TAG} placeholder outside a human turn")
    if len(videos) == 1 and count_video_tags(turns) == 0:  # the format's reference code puts the missing tag first
        first_user = next(k for k, t in enumerate(turns) if t.role == "user")
        turns[first_user] = Turn("user", VIDEO_TAG + "\n" + turns[first_user].text)
    placeholders = count_placeholders(turns)
    if placeholders != len(images):
        raise ConversationError(f"{placeholders} {IMAGE_PLACEHOLDER} placeholders but {len(images)} images")
    if count_video_tags(turns) != len(videos):
        raise ConversationError(f"{count_video_tags(turns)} {VIDEO_TAG} placeholder(s) but {len(videos)} video(s)")
    return turns, images, videos


def media_order(turns: list[Turn]) -> list[str]:
    """``"image"``/``"video"`` for each tag of the user turns, in reading order."""
    pattern = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_TAG)})")
    return ["image" if tag == IMAGE_PLACEHOLDER else "video"
            for t in turns if t.role == "user" for tag in pattern.findall(t.text)]


def expand_videos(turns: list[Turn], texts: list[str]) -> list[Turn]:
    """``turns`` with the k-th ``<video>`` tag of the user turns replaced by ``texts[k]`` (the video rule's text)."""
    out, k = [], 0
    for t in turns:
        if t.role != "user" or VIDEO_TAG not in t.text:
            out.append(t)
            continue
        pieces = t.text.split(VIDEO_TAG)
        text = pieces[0]
        for piece in pieces[1:]:
            text += texts[k] + piece
            k += 1
        out.append(Turn(t.role, text))
    return out


@dataclass(frozen=True)
class VideoPlan:
    """What a record's videos become: per video its probe, frame indices, block items and temporal patches (the
    ViT's attention segments in time, ``VideoRule.temporal_patches``), and the turns with the rule's text in place
    of each ``<video>``."""

    infos: tuple
    indices: tuple[tuple[int, ...], ...]
    blocks: tuple[tuple[int, ...], ...]
    turns: tuple[Turn, ...]
    temporal: tuple[int, ...] = ()


def plan_videos(turns: list[Turn], videos: list[RecordVideo], media: "MediaSource", rule: VideoRule | None,
                seed: int, source: int, line: int) -> VideoPlan:
    """Probe each video (its header; found through ``media``), take the rule's frames and blocks, and expand the
    turns; a ``UserError`` for a video the rule or the decoder refuses, or for any video without a rule.  ``source``
    and ``line`` identify the record for the rule's draws (``video_seed``)."""
    if videos and rule is None:
        raise ConversationError(f"{len(videos)} video(s): the model family does not read videos (it does not "
                                "declare Capabilities.video); leave them out or pass --skip-bad-samples")
    infos, indices, blocks, texts = [], [], [], []
    for k, video in enumerate(videos):
        info, taken = sampled_frames(media.video(video.path), rule, None, video_seed(seed, source, line, k),
                                     video.clip_s)
        infos.append(info)
        indices.append(tuple(taken))
        blocks.append(tuple(rule.blocks(len(taken), info.width, info.height)))
        texts.append(rule.text(taken, info.fps))
    return VideoPlan(tuple(infos), tuple(indices), tuple(blocks), tuple(expand_videos(turns, texts)),
                     tuple(rule.temporal_patches(len(taken)) for taken in indices) if videos else ())


def media_entries(turns: list[Turn], image_items: list[int], image_sizes: list[tuple[int, int]],
                  videos: VideoPlan) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]], list[tuple]]:
    """(items, (width, height) px, video entry ranges, video fields): one entry per image and per video block in
    reading order (a block has its video's frame size), each video's ``[first, end)`` entries, and per entry
    ``(video, frames, temporal)``: 0, 0, 0 for an image; for a video's block the video's 1-based ordinal in the
    record, its sampled frames and its temporal patches."""
    items, sizes, ranges, fields = [], [], [], []
    next_image = next_video = 0
    for kind in media_order(turns):
        if kind == "image":
            items.append(image_items[next_image])
            sizes.append(image_sizes[next_image])
            fields.append((0, 0, 0))
            next_image += 1
        else:
            info, blocks = videos.infos[next_video], videos.blocks[next_video]
            ranges.append((len(items), len(items) + len(blocks)))
            items += blocks
            sizes += [(info.width, info.height)] * len(blocks)
            fields += [(next_video + 1, len(videos.indices[next_video]), videos.temporal[next_video])] * len(blocks)
            next_video += 1
    return items, sizes, ranges, fields


def video_fields(input_ids: np.ndarray, spans: list[tuple[int, int]], turns: list[Turn], videos: list[RecordVideo],
                 plan: VideoPlan, rule: VideoRule, tokenizer) -> dict:
    """A sample's video fields (``input_ids`` is changed in place): ``video_blocks`` (per kept entry, reading order:
    None for an image, the rule's ``VideoRule.block`` for a video's block) and ``mm_token_type_ids`` int64 [n] (1 on
    an image's context tokens, 2 on a video's, 0 elsewhere); the context tokens of a video's blocks become the rule's
    ``context_token`` where the tokenizer has it as one token (Qwen: ``<|video_pad|>``)."""
    video_id = None
    if rule.context_token is not None:
        ids = tokenizer.encode(rule.context_token)
        video_id = ids[0] if len(ids) == 1 else None
    types = np.zeros(len(input_ids), dtype=np.int64)
    blocks: list = []
    next_video = 0
    for kind in media_order(turns):
        if kind == "image":
            blocks.append(None)
        else:
            k = next_video
            next_video += 1
            blocks += rule.block_info(plan.indices[k], plan.infos[k], videos[k].clip_s)
    blocks = blocks[:len(spans)]
    for (start, end), block in zip(spans, blocks):
        types[start + 1:end - 1] = 1 if block is None else 2
        if block is not None and video_id is not None:
            input_ids[start + 1:end - 1] = video_id
    return {"video_blocks": blocks, "mm_token_type_ids": torch.from_numpy(types)}


class RecordProblems(UserError):
    """What is wrong with one record (``problems``: one message each), raised by ``layout_record``."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class RecordLayout:
    """What a record becomes before any pixel is read.

    Entries (an image, or a video's image block, in reading order): ``items`` (ViT items each), ``sizes`` ((width,
    height) px each), ``fields`` (``media_entries``'s (video, frames, temporal) each).  ``plan``: the rendered
    conversation; ``tokens``: tokens kept (after truncation), ``kept``: entries kept, ``real``: their ViT items;
    ``truncated`` / ``without_loss``: cut to ``max_seq_length``, and left with no answer token."""

    items: tuple[int, ...]
    sizes: tuple[tuple[int, int], ...]
    fields: tuple[tuple[int, int, int], ...]
    plan: ChatPlan
    tokens: int
    kept: int
    real: int
    truncated: bool = False
    without_loss: bool = False

    def items_fed(self, rule: ImageRule) -> int:
        """ViT items the sample feeds the ViT: its real items, or the rule's dummy items without any."""
        return self.real if self.real > 0 else rule.dummy_items


def too_long_message(plan: ChatPlan, items: list[int], rule: ImageRule, max_seq_length: int | None) -> str:
    return (f"sample is {plan.length} tokens ({sum(items)} {rule.unit}) > max_seq_length {max_seq_length}; raise "
            "--seq-length, give images fewer ViT items (--max-num-tiles, --max-pixels, --video-max-frames), pass "
            "--truncate-long-samples (cut it at --seq-length) or --skip-bad-samples (leave it out)")


def layout_record(turns: list[Turn], image_names: list[str], image_sizes: list[tuple[int, int]],
                  video_plan: VideoPlan, tokenizer, config: ReaderConfig) -> RecordLayout:
    """The record's ``RecordLayout`` from its turns, its images (names for messages, sizes in px) and its videos'
    plan; raises ``RecordProblems`` for an image size the family's rule refuses, a conversation the chat template
    refuses, or a sample over ``config.max_seq_length`` without truncation."""
    rule = config.images
    items, problems = [], []
    for name, (w, h) in zip(image_names, image_sizes):
        try:
            items.append(rule.items(w, h, len(image_names)))
        except UserError as e:
            problems.append(f"image {name}: {e}")
    if problems:
        raise RecordProblems(problems)
    items, sizes, video_ranges, fields = media_entries(turns, items, image_sizes, video_plan)
    try:  # a chat template can refuse a conversation: a problem of this record, named like the others
        plan = plan_conversation(list(video_plan.turns), tokenizer, [rule.image_tokens(n) for n in items], 1,
                                 config.system, config.add_bos)
    except ConversationError as e:
        raise RecordProblems([str(e)]) from None
    cut, kept = plan.cut_for(config.max_seq_length)
    for first, end in video_ranges:  # a video is kept or dropped whole
        if first < kept < end:
            cut, kept = plan.image_spans[first][0], first
    truncated = without_loss = False
    if cut < plan.length:
        if not config.truncate:
            raise RecordProblems([too_long_message(plan, items, rule, config.max_seq_length)])
        truncated = True
        _, labels = plan.materialize(cut)
        without_loss = not (labels != -100).any()
    return RecordLayout(tuple(items), tuple(sizes), tuple(fields), plan, cut, kept, sum(items[:kept]), truncated,
                        without_loss)


def sample_text(layout: RecordLayout, turns: list[Turn], videos: list[RecordVideo], video_plan: VideoPlan,
                config: ReaderConfig, tokenizer) -> dict:
    """A sample's text fields: ``input_ids`` and ``labels`` int64 [tokens], ``image_sizes`` int64 [kept images and
    video blocks, 2] ((width, height) px) and, for a record with videos, ``video_fields``'."""
    input_ids, labels = layout.plan.materialize(layout.tokens)
    sizes = torch.tensor(layout.sizes[:layout.kept], dtype=torch.int64).reshape(-1, 2)
    text = {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels), "image_sizes": sizes}
    if videos:
        text.update(video_fields(input_ids, layout.plan.image_spans[:layout.kept], turns, videos, video_plan,
                                 config.videos, tokenizer))
    return text


def image_flags(layout: RecordLayout, rule: ImageRule) -> torch.Tensor:
    """int64 [items fed]: 1 per real ViT item, or 0 per dummy item of a sample without any."""
    if layout.real:
        return torch.ones(layout.real, dtype=torch.int64)
    return torch.zeros(rule.dummy_items, dtype=torch.int64)


def sample_pixels(layout: RecordLayout, turns: list[Turn], images: list[str], videos: list[RecordVideo],
                  video_plan: VideoPlan, media: MediaSource, config: ReaderConfig, where: str) -> dict:
    """``pixel_values`` (float32, one row per ViT item) and ``image_flags`` of the kept entries, decoded in reading
    order by the family's rules (a sample without any: the rule's dummy pixels, flags 0).  An image whose decoded
    size differs from ``layout``'s, or a video that breaks, raises a ``UserError`` naming it after ``where``."""
    rule = config.images
    pixels = []
    entry = next_image = next_video = 0
    for kind in media_order(turns):
        if kind == "image":
            k = next_image
            next_image += 1
            entry += 1
            if entry > layout.kept:
                break
            with media.open_image(images[k]) as im:
                if im.size != layout.sizes[entry - 1]:
                    raise UserError(f"{where}: image {media.image_name(images[k])} changed size since validation")
                try:
                    pixels.append(rule.pixels(im, len(images)))
                except (OSError, SyntaxError) as e:  # PIL's errors for truncated or corrupt data behind a header
                    raise UserError(f"{where}: cannot decode image {media.image_name(images[k])} "
                                    f"({' '.join(str(e).split())}): it read well before training, so it changed "
                                    "since (a scan kept in --data-cache-dir/scans is not redone: delete it)") from None
        else:
            k = next_video
            next_video += 1
            entry += len(video_plan.blocks[k])
            if entry > layout.kept:
                break
            frames = decode_frames(media.video(videos[k].path), video_plan.infos[k], video_plan.indices[k],
                                   where).frames
            pixels.append(config.videos.pixels(frames))
    made = sum(len(p) for p in pixels)
    if made != layout.real:  # cannot happen unless the rule's pixels and its counts disagree
        raise RuntimeError(f"{where}: made {made} ViT items, the layout counted {layout.real}")
    if pixels:
        pixel_values = torch.cat(pixels)
        return {"pixel_values": pixel_values, "image_flags": torch.ones(len(pixel_values), dtype=torch.int64)}
    pixel_values = rule.dummy_pixels()
    return {"pixel_values": pixel_values, "image_flags": torch.zeros(len(pixel_values), dtype=torch.int64)}
