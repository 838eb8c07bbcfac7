"""Reader of ``messages`` JSONL records (the LLaMA-Factory "sharegpt/openai" and ms-swift layout).

One record per non-blank line, each message's ``content`` in either form (a record may mix them)::

    {"messages": [{"role": "system", "content": "..."},          # optional, first only
                  {"role": "user", "content": "<image>What is this?"},
                  {"role": "assistant", "content": "A cat."}, ...],
     "images": ["a.jpg", ...],                                    # optional; one string = one image
     "videos": ["v.mp4", "frames/", ...]}                         # optional; a file or a frame folder each

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

* a string: each ``<image>`` in a user message stands for the next entry of ``images``, each ``<video>`` for the
  next entry of ``videos`` (LLaMA-Factory's and ms-swift's layout), in reading order;
* a list of parts (transformers' structured chat form, as its chat templates and processors take it):
  ``{"type": "text", "text": STR}``, ``{"type": "image", "image" | "url" | "path": PATH}`` and
  ``{"type": "video", "video" | "url" | "path": PATH}`` (the keys transformers' ``apply_chat_template`` reads
  them from), each part carrying its own path.

The record's images are its ``<image>`` tags (from ``images``) and its image parts, its videos its ``<video>``
tags (from ``videos``) and its video parts, each in reading order.  The record becomes a ``Conversation``:
turns with a role and a tuple of segments, text strings interleaved with ``ImageRef``s and ``VideoRef``s
(number and path as written; resolving paths is the caller's business).

Refused with ``MessagesRecordError`` (a ``UserError`` whose message starts with ``file:line``): malformed
JSON or a record that is not an object; no ``messages``; a message without a string ``role`` and a string or
list ``content``; a part that is not a text part with a string ``text`` or an image part with one path; an
``<image>``/``<video>`` tag inside a text part (media are parts there); a role other than system/user/assistant; a
system message after the first; turns that do not alternate user, assistant, ... ending with an assistant answer;
an image or video outside a user message; a ``<image>`` count that differs from ``len(images)`` or a ``<video>``
count that differs from ``len(videos)`` (a tag without its entry, or the reverse); any audio (a non-empty
``audios`` key, an ``<audio>`` placeholder or part: not implemented).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from omnibal_ext.errors import UserError

import re

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
UNSUPPORTED_KEYS = {"audios": "audio"}
UNSUPPORTED_TAGS = {"<audio>": "audio"}
ROLES = ("system", "user", "assistant")
IMAGE_PATH_KEYS = ("image", "url", "path")  # where an image part names its file (transformers' keys)
VIDEO_PATH_KEYS = ("video", "url", "path")  # where a video part names its file or frame folder
_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")


class MessagesRecordError(UserError):
    """A ``messages`` record this reader refuses; the message starts with ``file:line``."""


@dataclass(frozen=True)
class ImageRef:
    """The ``index``-th image of the record (0-based), ``path`` as written in its ``images`` list."""

    index: int
    path: str


@dataclass(frozen=True)
class VideoRef:
    """The ``index``-th video of the record (0-based), ``path`` as written (a file or a frame folder)."""

    index: int
    path: str


@dataclass(frozen=True)
class Turn:
    """One message: ``role`` is "system", "user" or "assistant"; ``segments`` its text pieces (non-empty
    strings) and images in reading order."""

    role: str
    segments: tuple[str | ImageRef | VideoRef, ...]

    @property
    def text(self) -> str:
        """The message's text with each image written back as ``<image>``, each video as ``<video>``."""
        return "".join(IMAGE_TAG if isinstance(s, ImageRef) else VIDEO_TAG if isinstance(s, VideoRef) else s
                       for s in self.segments)


@dataclass(frozen=True)
class Conversation:
    """One record: its turns (an optional system turn, then user/assistant pairs), its image paths, ``where``
    (``file:line``) to name it in later errors, and its video paths."""

    turns: tuple[Turn, ...]
    images: tuple[str, ...]
    where: str
    videos: tuple[str, ...] = ()


def _split(text: str) -> list[str | ImageRef | VideoRef]:
    """The segments of a string ``content``: its text and a ref per tag (numbered later, index -1)."""
    out: list[str | ImageRef | VideoRef] = []
    for piece in _TAGS.split(text):
        if piece == IMAGE_TAG:
            out.append(ImageRef(-1, ""))
        elif piece == VIDEO_TAG:
            out.append(VideoRef(-1, ""))
        elif piece:
            out.append(piece)
    return out


def _parts(content: list, k: int, fail) -> list[str | ImageRef]:
    """The segments of a structured ``content`` (image parts as ``ImageRef``s numbered later, index -1)."""
    out: list[str | ImageRef] = []
    for j, part in enumerate(content):
        where = f"messages[{k}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                fail(f"{where}: a text part needs a string 'text'")
            for tag in (IMAGE_TAG, VIDEO_TAG, *UNSUPPORTED_TAGS):
                if tag in text:
                    fail(f"{where}: a text part holds {tag}; in a list content each image is an "
                         "{\"type\": \"image\", \"image\": PATH} part, each video a "
                         "{\"type\": \"video\", \"video\": PATH} part")
            if text:
                out.append(text)
        elif kind == "image":
            paths = [part[key] for key in IMAGE_PATH_KEYS if key in part]
            if len(paths) != 1 or not isinstance(paths[0], str) or not paths[0]:
                fail(f"{where}: an image part needs one path in {' | '.join(map(repr, IMAGE_PATH_KEYS))} (a "
                     f"non-empty string), got {part!r}")
            out.append(ImageRef(-1, paths[0]))
        elif kind == "video":
            paths = [part[key] for key in VIDEO_PATH_KEYS if key in part]
            if len(paths) != 1 or not isinstance(paths[0], str) or not paths[0]:
                fail(f"{where}: a video part needs one path in {' | '.join(map(repr, VIDEO_PATH_KEYS))} (a "
                     f"non-empty string: a file or a frame folder), got {part!r}")
            out.append(VideoRef(-1, paths[0]))
        elif kind == "audio":
            fail(f"{where}: audio input is not implemented")
        else:
            fail(f"{where}: expected a {{\"type\": \"text\"}}, {{\"type\": \"image\"}} or "
                 f"{{\"type\": \"video\"}} part, got {part!r}")
    return out


def parse_messages_record(record, where: str) -> Conversation:
    """Check one decoded record and convert it (see the module docstring); ``where`` is ``file:line`` (empty:
    the caller names the record)."""
    def fail(message: str):
        raise MessagesRecordError(f"{where}: {message}" if where else message)

    if not isinstance(record, dict):
        fail(f"a record must be a JSON object, got {type(record).__name__}")
    for key, what in UNSUPPORTED_KEYS.items():
        if record.get(key):
            fail(f"'{key}': {what} input is not implemented")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        fail("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    listed = {}
    for key, what in (("images", "image paths"), ("videos", "video paths (files or frame folders)")):
        paths = record.get(key)
        paths = [] if paths is None else [paths] if isinstance(paths, str) else paths
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            fail(f"'{key}' must be a list of {what} (non-empty strings)")
        listed[key] = paths

    roles, contents = [], []
    tags = {ImageRef: 0, VideoRef: 0}
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), (str, list)):
            fail(f"messages[{k}] must be an object with a string 'role' and a string or list 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            fail(f"messages[{k}].role = {role!r}; expected one of {', '.join(ROLES)}")
        if isinstance(content, str):
            for tag, what in UNSUPPORTED_TAGS.items():
                if tag in content:
                    fail(f"messages[{k}] has a {tag} placeholder: {what} input is not implemented")
            segments = []
            for x in _split(content):  # a tag takes the next entry of its list
                if isinstance(x, (ImageRef, VideoRef)):
                    entries = listed["images" if isinstance(x, ImageRef) else "videos"]
                    n = tags[type(x)]
                    x = type(x)(-1, entries[n] if n < len(entries) else "")
                    tags[type(x)] += 1
                segments.append(x)
        else:
            segments = _parts(content, k, fail)
        if role != "user" and any(isinstance(x, (ImageRef, VideoRef)) for x in segments):
            fail(f"messages[{k}] ({role}) has an image or video ({IMAGE_TAG}/{VIDEO_TAG} placeholder or part); "
                 "they go in user messages")
        roles.append(role)
        contents.append(segments)

    if "system" in roles[1:]:
        fail(f"messages[{roles.index('system', 1)}]: a system message may only come first")
    body = roles[1:] if roles[0] == "system" else roles
    if not body:
        fail("no user/assistant messages")
    for k, role in enumerate(body):
        expected = "user" if k % 2 == 0 else "assistant"
        if role != expected:
            fail(f"messages[{k + len(roles) - len(body)}] is from {role}, expected {expected} "
                 "(user and assistant must alternate, starting with user)")
    if body[-1] != "assistant":
        fail("the last user message has no assistant answer")

    for ref, tag, key, what in ((ImageRef, IMAGE_TAG, "images", "image"), (VideoRef, VIDEO_TAG, "videos", "video")):
        if tags[ref] != len(listed[key]):
            fail(f"{tags[ref]} {tag} placeholder(s) in the messages but {len(listed[key])} {what}(s) in '{key}'")

    turns, paths, videos = [], [], []
    for role, segments in zip(roles, contents):  # number the images and the videos in reading order
        numbered = []
        for x in segments:
            if isinstance(x, ImageRef):
                x = ImageRef(len(paths), x.path)
                paths.append(x.path)
            elif isinstance(x, VideoRef):
                x = VideoRef(len(videos), x.path)
                videos.append(x.path)
            numbered.append(x)
        turns.append(Turn(role, tuple(numbered)))
    return Conversation(tuple(turns), tuple(paths), where, tuple(videos))


def parse_messages_line(line: str | bytes, where: str) -> Conversation:
    """Decode one JSONL line and convert it; malformed JSON is a ``MessagesRecordError`` naming ``where``."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MessagesRecordError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    return parse_messages_record(record, where)


def read_messages_jsonl(path: str) -> Iterator[Conversation]:
    """The records of a JSONL file in order (blank lines skipped), each named ``path:line`` (1-based);
    stops at the first refused record."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield parse_messages_line(line, f"{path}:{number}")
