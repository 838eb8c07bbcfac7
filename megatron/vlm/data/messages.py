"""Reader of ``messages`` JSONL records (the LLaMA-Factory "sharegpt/openai" and ms-swift layout).

One record per non-blank line, each message's ``content`` in either form (a record may mix them)::

    {"messages": [{"role": "system", "content": "..."},          # optional, first only
                  {"role": "user", "content": "<image>What is this?"},
                  {"role": "assistant", "content": "A cat."}, ...],
     "images": ["a.jpg", ...]}                                    # optional; one string = one image

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

* a string: each ``<image>`` in a user message stands for the next entry of ``images``, in reading order;
* a list of parts (transformers' structured chat form, as its chat templates and processors take it):
  ``{"type": "text", "text": STR}`` and ``{"type": "image", "image" | "url" | "path": PATH}`` (the keys
  transformers' ``apply_chat_template`` reads an image from), each image part carrying its own path.

The record's images are its ``<image>`` tags (from ``images``) and its image parts, in reading order.  The record
becomes a ``Conversation``: turns with a role and a tuple of segments, text strings interleaved with
``ImageRef``s (image number and path as written; resolving paths is the caller's business).

Refused with ``MessagesRecordError`` (a ``UserError`` whose message starts with ``file:line``): malformed
JSON or a record that is not an object; no ``messages``; a message without a string ``role`` and a string or
list ``content``; a part that is not a text part with a string ``text`` or an image part with one path; an
``<image>`` tag inside a text part (images are parts there); a role other than system/user/assistant; a system
message after the first; turns that do not alternate user, assistant, ... ending with an assistant answer; an
image outside a user message; a ``<image>`` count that differs from ``len(images)``; any video or audio (a
non-empty ``videos`` / ``audios`` key, a ``<video>`` / ``<audio>`` placeholder or part: not implemented).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from omnibal_ext.errors import UserError

IMAGE_TAG = "<image>"
UNSUPPORTED_KEYS = {"videos": "video", "audios": "audio"}
UNSUPPORTED_TAGS = {"<video>": "video", "<audio>": "audio"}
ROLES = ("system", "user", "assistant")
IMAGE_PATH_KEYS = ("image", "url", "path")  # where an image part names its file (transformers' keys)


class MessagesRecordError(UserError):
    """A ``messages`` record this reader refuses; the message starts with ``file:line``."""


@dataclass(frozen=True)
class ImageRef:
    """The ``index``-th image of the record (0-based), ``path`` as written in its ``images`` list."""

    index: int
    path: str


@dataclass(frozen=True)
class Turn:
    """One message: ``role`` is "system", "user" or "assistant"; ``segments`` its text pieces (non-empty
    strings) and images in reading order."""

    role: str
    segments: tuple[str | ImageRef, ...]

    @property
    def text(self) -> str:
        """The message's text with each image written back as ``<image>``."""
        return "".join(IMAGE_TAG if isinstance(s, ImageRef) else s for s in self.segments)


@dataclass(frozen=True)
class Conversation:
    """One record: its turns (an optional system turn, then user/assistant pairs), its image paths, and
    ``where`` (``file:line``) to name it in later errors."""

    turns: tuple[Turn, ...]
    images: tuple[str, ...]
    where: str


def _split(text: str, first_image: int, images: list[str]) -> list[str | ImageRef]:
    pieces = text.split(IMAGE_TAG)
    out: list[str | ImageRef] = []
    for k, piece in enumerate(pieces):
        if k:
            index = first_image + k - 1
            out.append(ImageRef(index, images[index]) if index < len(images) else ImageRef(index, ""))
        if piece:
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
            for tag in (IMAGE_TAG, *UNSUPPORTED_TAGS):
                if tag in text:
                    fail(f"{where}: a text part holds {tag}; in a list content each image is an "
                         "{\"type\": \"image\", \"image\": PATH} part")
            if text:
                out.append(text)
        elif kind == "image":
            paths = [part[key] for key in IMAGE_PATH_KEYS if key in part]
            if len(paths) != 1 or not isinstance(paths[0], str) or not paths[0]:
                fail(f"{where}: an image part needs one path in {' | '.join(map(repr, IMAGE_PATH_KEYS))} (a "
                     f"non-empty string), got {part!r}")
            out.append(ImageRef(-1, paths[0]))
        elif kind in ("video", "audio"):
            fail(f"{where}: {kind} input is not implemented (images only)")
        else:
            fail(f"{where}: expected a {{\"type\": \"text\"}} or {{\"type\": \"image\"}} part, got {part!r}")
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
            fail(f"'{key}': {what} input is not implemented (images only)")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        fail("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    images = record.get("images")
    images = [] if images is None else [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        fail("'images' must be a list of image paths (non-empty strings)")

    roles, contents, tags = [], [], 0
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
                    fail(f"messages[{k}] has a {tag} placeholder: {what} input is not implemented (images only)")
            segments = _split(content, tags, images)
            tags += content.count(IMAGE_TAG)
        else:
            segments = _parts(content, k, fail)
        if role != "user" and any(isinstance(x, ImageRef) for x in segments):
            fail(f"messages[{k}] ({role}) has an image ({IMAGE_TAG} placeholder or image part); images go in user "
                 "messages")
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

    if tags != len(images):
        fail(f"{tags} {IMAGE_TAG} placeholder(s) in the messages but {len(images)} image(s) in 'images'")

    turns, paths = [], []
    for role, segments in zip(roles, contents):  # number the images in reading order
        numbered = []
        for x in segments:
            if isinstance(x, ImageRef):
                x = ImageRef(len(paths), x.path)
                paths.append(x.path)
            numbered.append(x)
        turns.append(Turn(role, tuple(numbered)))
    return Conversation(tuple(turns), tuple(paths), where)


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
