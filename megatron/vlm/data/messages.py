"""Reader of ``messages`` JSONL records (the LLaMA-Factory "sharegpt/openai" and ms-swift layout).

One record per non-blank line::

    {"messages": [{"role": "system", "content": "..."},          # optional, first only
                  {"role": "user", "content": "<image>What is this?"},
                  {"role": "assistant", "content": "A cat."}, ...],
     "images": ["a.jpg", ...]}                                    # optional; one string = one image

Each ``<image>`` in a user message stands for the next entry of ``images``, in reading order.  The record
becomes a ``Conversation``: turns with a role and a tuple of segments, text strings interleaved with
``ImageRef``s (image number and path as written; resolving paths is the caller's business).

Refused with ``MessagesRecordError`` (a ``UserError`` whose message starts with ``file:line``): malformed
JSON or a record that is not an object; no ``messages``; a message without a string ``role`` and ``content``;
a role other than system/user/assistant; a system message after the first; turns that do not alternate
user, assistant, ... ending with an assistant answer; ``<image>`` outside a user message; a ``<image>``
count that differs from ``len(images)``; any video or audio (a non-empty ``videos`` / ``audios`` key or a
``<video>`` / ``<audio>`` placeholder: not implemented).
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


def _split(text: str, first_image: int, images: list[str]) -> tuple[str | ImageRef, ...]:
    pieces = text.split(IMAGE_TAG)
    out: list[str | ImageRef] = []
    for k, piece in enumerate(pieces):
        if k:
            index = first_image + k - 1
            out.append(ImageRef(index, images[index]))
        if piece:
            out.append(piece)
    return tuple(out)


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

    roles, texts = [], []
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            fail(f"messages[{k}] must be an object with string 'role' and 'content'")
        role, text = message["role"], message["content"]
        if role not in ROLES:
            fail(f"messages[{k}].role = {role!r}; expected one of {', '.join(ROLES)}")
        for tag, what in UNSUPPORTED_TAGS.items():
            if tag in text:
                fail(f"messages[{k}] has a {tag} placeholder: {what} input is not implemented (images only)")
        if IMAGE_TAG in text and role != "user":
            fail(f"messages[{k}] ({role}) has an {IMAGE_TAG} placeholder; images go in user messages")
        roles.append(role)
        texts.append(text)

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

    placeholders = sum(text.count(IMAGE_TAG) for text in texts)
    if placeholders != len(images):
        fail(f"{placeholders} {IMAGE_TAG} placeholder(s) in the messages but {len(images)} image(s) in 'images'")

    turns, used = [], 0
    for role, text in zip(roles, texts):
        turns.append(Turn(role, _split(text, used, images)))
        used += text.count(IMAGE_TAG)
    return Conversation(tuple(turns), tuple(images), where)


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
