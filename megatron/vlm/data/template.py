"""The built-in chat template (InternLM2's ChatML layout), rendered to token ids and loss labels.

Layout of one sample (``<s>`` only when the tokenizer has a BOS id, system block only when given)::

    <s><|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n{answer}<|im_end|>\\n   (per turn)

Every ``<image>`` placeholder of a user turn becomes ``<img>`` + ``<IMG_CONTEXT>`` x (tokens_per_tile x
tiles of that image) + ``</img>``, images taken in order.  Labels are already shifted (Megatron style):
``labels[j] = input_ids[j+1]`` when token ``j+1`` belongs to an answer (its text and its closing
``<|im_end|>``), else -100; ``labels[n-1] = -100``.

``plan_conversation`` returns a ``ChatPlan``: the token pieces with image blocks kept as runs, so the
exact length and image positions are known without building the id array (the reader's validation pass
uses it); ``ChatPlan.materialize`` builds the arrays.  Both paths share one plan, so the lengths agree.

A Hugging Face tokenizer with its own Jinja chat template (``tokenizer.chat_template``) is rendered with that
template instead (``plan_with_chat_template``): the text is exactly the template's, with the same ``<image>``
expansion, and the labelled tokens are each assistant answer and what closes it (its end-of-turn token),
found by rendering the conversation prefix by prefix.  The built-in layout above is the fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal_ext.errors import UserError

IGNORE_INDEX = -100
IMAGE_PLACEHOLDER = "<image>"
RESERVED_STRINGS = ("<img>", "</img>", "<IMG_CONTEXT>")  # may not appear literally in data text

USER_ROLES = {"human": "user", "user": "user"}
ASSISTANT_ROLES = {"gpt": "assistant", "assistant": "assistant"}


class ConversationError(UserError):
    """A conversation that does not fit the template (the reader prefixes file:line)."""


@dataclass(frozen=True)
class Turn:
    role: str  # "system", "user" or "assistant"
    text: str


def parse_conversations(conversations) -> list[Turn]:
    """Validate ``conversations`` records and map roles: optional leading system, then (user, assistant)+."""
    if not isinstance(conversations, list) or not conversations:
        raise ConversationError("'conversations' must be a non-empty list")
    turns: list[Turn] = []
    for k, msg in enumerate(conversations):
        if not isinstance(msg, dict) or "from" not in msg or "value" not in msg:
            raise ConversationError(f"conversations[{k}] must be an object with 'from' and 'value'")
        who, text = msg["from"], msg["value"]
        if not isinstance(text, str):
            raise ConversationError(f"conversations[{k}].value must be a string")
        if who == "system":
            if k != 0:
                raise ConversationError(f"conversations[{k}]: a system message may only come first")
            role = "system"
        elif who in USER_ROLES:
            role = "user"
        elif who in ASSISTANT_ROLES:
            role = "assistant"
        else:
            raise ConversationError(f"conversations[{k}].from = {who!r}; expected human/user, gpt/assistant or system")
        for reserved in RESERVED_STRINGS:
            if reserved in text:
                raise ConversationError(f"conversations[{k}] contains the reserved token string {reserved!r}")
        if role == "assistant" and IMAGE_PLACEHOLDER in text:
            raise ConversationError(f"conversations[{k}]: {IMAGE_PLACEHOLDER} placeholder in an answer")
        turns.append(Turn(role, text))
    body = turns[1:] if turns[0].role == "system" else turns
    if not body:
        raise ConversationError("conversation has no user/assistant turns")
    for k, turn in enumerate(body):
        expected = "user" if k % 2 == 0 else "assistant"
        if turn.role != expected:
            raise ConversationError(f"turn {k} is from {turn.role}, expected {expected} (turns must alternate)")
    if body[-1].role != "assistant":
        raise ConversationError("conversation ends with a human turn that has no answer")
    return turns


def count_placeholders(turns: list[Turn]) -> int:
    return sum(t.text.count(IMAGE_PLACEHOLDER) for t in turns if t.role == "user")


def add_missing_placeholder(turns: list[Turn], num_images: int) -> list[Turn]:
    """``conversations``: one image, no ``<image>`` anywhere -> prepend ``"<image>\\n"`` to the first user turn."""
    if num_images != 1 or count_placeholders(turns) != 0:
        return turns
    out = list(turns)
    first_user = next(k for k, t in enumerate(out) if t.role == "user")
    out[first_user] = Turn("user", IMAGE_PLACEHOLDER + "\n" + out[first_user].text)
    return out


@dataclass
class ChatPlan:
    """Token pieces of one rendered sample.

    ``pieces`` holds ``(ids, is_answer)`` for text and ``(tiles, None)`` for an image block; the image
    blocks' token positions are in ``image_spans``.
    """

    pieces: list  # list of (list[int], bool) text pieces or (int tiles, None) image blocks
    length: int  # tokens
    image_spans: list[tuple[int, int]]  # per image: [start, end) of its <img> .. </img> block
    image_tiles: list[int]
    img_start_id: int
    img_end_id: int
    img_context_id: int
    tokens_per_tile: int

    def cut_for(self, max_len: int | None) -> tuple[int, int]:
        """(tokens kept, images kept) when truncating to ``max_len`` tokens.

        Image blocks are never split: the cut moves to the start of the first image block that does not
        fit whole, and that image and all later ones are dropped.
        """
        if max_len is None or self.length <= max_len:
            return self.length, len(self.image_spans)
        cut = max_len
        kept = len(self.image_spans)
        for k, (start, end) in enumerate(self.image_spans):
            if end > cut:
                cut = min(cut, start)
                kept = k
                break
        return cut, kept

    def materialize(self, cut: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` int64 arrays of length ``cut`` (default: the whole sample)."""
        ids_parts, mask_parts = [], []
        for payload, is_answer in self.pieces:
            if is_answer is None:  # image block of `payload` tiles
                run = np.full(payload * self.tokens_per_tile + 2, self.img_context_id, dtype=np.int64)
                run[0], run[-1] = self.img_start_id, self.img_end_id
                ids_parts.append(run)
                mask_parts.append(np.zeros(len(run), dtype=bool))
            else:
                ids_parts.append(np.asarray(payload, dtype=np.int64))
                mask_parts.append(np.full(len(payload), is_answer, dtype=bool))
        ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int64)
        answer = np.concatenate(mask_parts) if mask_parts else np.zeros(0, bool)
        if cut is not None:
            ids, answer = ids[:cut], answer[:cut]
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        if len(ids) > 1:
            labels[:-1] = np.where(answer[1:], ids[1:], IGNORE_INDEX)
        return ids, labels


def plan_conversation(turns: list[Turn], tokenizer, image_tiles: list[int], tokens_per_tile: int,
                      system: str | None = None, add_bos: bool = True) -> ChatPlan:
    """Lay out ``turns`` (from ``parse_conversations``) with ``image_tiles[k]`` tiles for image k.

    ``system`` is used when the conversation has no system message of its own.  Raises
    ``ConversationError`` when the placeholder count differs from ``len(image_tiles)``.
    """
    placeholders = count_placeholders(turns)
    if placeholders != len(image_tiles):
        raise ConversationError(f"{placeholders} {IMAGE_PLACEHOLDER} placeholders but {len(image_tiles)} images")
    if getattr(tokenizer, "chat_template", None):
        return plan_with_chat_template(turns, tokenizer, image_tiles, tokens_per_tile, system)
    pieces: list = []
    spans: list[tuple[int, int]] = []
    length = 0

    def text(s: str, is_answer: bool = False) -> None:
        nonlocal length
        if s:
            ids = tokenizer.encode(s)
            pieces.append((ids, is_answer))
            length += len(ids)

    def special(token_id: int, is_answer: bool = False) -> None:
        nonlocal length
        pieces.append(([token_id], is_answer))
        length += 1

    def image(tiles: int) -> None:
        nonlocal length
        n = tiles * tokens_per_tile + 2
        spans.append((length, length + n))
        pieces.append((tiles, None))
        length += n

    if add_bos and tokenizer.bos_id is not None:
        special(tokenizer.bos_id)
    if turns[0].role == "system":
        system, turns = turns[0].text, turns[1:]
    if system is not None:
        special(tokenizer.im_start_id)
        text("system\n" + system)
        special(tokenizer.im_end_id)
        text("\n")
    next_image = 0
    for turn in turns:
        special(tokenizer.im_start_id)
        if turn.role == "user":
            text("user\n")
            chunks = turn.text.split(IMAGE_PLACEHOLDER)
            for k, chunk in enumerate(chunks):
                if k > 0:
                    image(image_tiles[next_image])
                    next_image += 1
                text(chunk)
            special(tokenizer.im_end_id)
            text("\n")
        else:
            text("assistant\n")
            text(turn.text, is_answer=True)
            special(tokenizer.im_end_id, is_answer=True)
            text("\n")
    return ChatPlan(pieces, length, spans, list(image_tiles), tokenizer.img_start_id, tokenizer.img_end_id,
                    tokenizer.img_context_id, tokens_per_tile)


def chat_template_name(tokenizer) -> str:
    """Which template ``plan_conversation`` uses with ``tokenizer`` (for the startup log line)."""
    if getattr(tokenizer, "chat_template", None):
        return f"the tokenizer's own chat template ({getattr(tokenizer, 'path', tokenizer)})"
    return "the built-in InternLM2-style chat template"


def answer_spans(messages: list[dict], render) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: ``render(messages)`` and the ``[start, end)`` characters of each assistant answer in it.

    ``render(messages, add_generation_prompt)`` is a chat template.  An answer starts where the prefix before it,
    rendered with the generation prompt, ends (or where its content is found after that, for a template that
    ignores the generation prompt) and ends where the prefix including it ends, less trailing whitespace: its
    content and the template's end-of-turn token, as in the built-in layout.
    """
    text = render(messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:k], True)
        after = render(messages[:k + 1], False)
        if not (after.startswith(before) and text.startswith(after)):
            raise ConversationError("the tokenizer's chat template does not render this conversation turn by turn "
                                    f"(message {k}: a prefix's rendering is not a prefix of the whole); the answer "
                                    "tokens cannot be located")
        start = len(before)
        found = after.find(message["content"], start) if message["content"] else -1
        if found >= 0:
            start = found
        end = len(after.rstrip())
        if found >= 0:
            end = max(end, found + len(message["content"]))
        spans.append((start, max(start, end)))
    return text, spans


def plan_with_chat_template(turns: list[Turn], tokenizer, image_tiles: list[int], tokens_per_tile: int,
                            system: str | None = None) -> ChatPlan:
    """``plan_conversation`` with the tokenizer's own chat template (``tokenizer.render_chat``).

    ``system`` is added as a first system message when the conversation has none.  BOS comes from the template
    (``{{ bos_token }}``) only.  Each ``<image>`` in the rendered text becomes its image block; the text between
    is tokenised whole, and a token is labelled when its characters overlap an answer span (tokenizers without
    offsets: the text is also cut at the span boundaries).
    """
    messages = [{"role": t.role, "content": t.text} for t in turns]
    if messages[0]["role"] != "system" and system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text, spans = answer_spans(messages, lambda m, gen: tokenizer.render_chat(m, add_generation_prompt=gen))
    if text.count(IMAGE_PLACEHOLDER) != len(image_tiles):
        raise ConversationError(f"the chat template rendered {text.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} "
                                f"placeholders for {len(image_tiles)} images")
    for reserved in RESERVED_STRINGS:
        if reserved in text:
            raise ConversationError(f"the chat template rendered the reserved token string {reserved!r}")

    span_start = np.array([s for s, _ in spans], dtype=np.int64)
    span_end = np.array([e for _, e in spans], dtype=np.int64)

    def in_answer(char_spans: np.ndarray) -> np.ndarray:
        """bool [n]: token i (characters [a, b) = char_spans[i]) overlaps an answer (an empty one: lies in it)."""
        a, b = char_spans[:, :1], char_spans[:, 1:]
        overlaps = (a < span_end) & (b > span_start)
        empty_inside = (a == b) & (span_start <= a) & (a < span_end)
        return (overlaps | empty_inside).any(axis=1)

    pieces: list = []
    image_spans: list[tuple[int, int]] = []
    length = 0

    def add(ids: list[int], flags: np.ndarray) -> None:
        """Append ``ids`` as runs of equal answer flag, merging with the last text piece when it has the same flag."""
        nonlocal length
        starts = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist()]
        for lo, hi in zip(starts, starts[1:] + [len(ids)]):
            f = bool(flags[lo])
            if pieces and pieces[-1][1] is f:
                pieces[-1][0].extend(ids[lo:hi])
            else:
                pieces.append((list(ids[lo:hi]), f))
        length += len(ids)

    def chunk(lo: int, hi: int) -> None:
        if lo >= hi:
            return
        enc = tokenizer.encode_with_offsets(text[lo:hi]) if hasattr(tokenizer, "encode_with_offsets") else None
        if enc is not None:
            ids, offsets = enc
            if ids:
                add(ids, in_answer(np.asarray(offsets, dtype=np.int64).reshape(-1, 2) + lo))
            return
        cuts = sorted({lo, hi, *(c for s, e in spans for c in (s, e) if lo < c < hi)})
        for a, b in zip(cuts, cuts[1:]):
            ids = tokenizer.encode(text[a:b])
            if ids:
                add(ids, np.repeat(in_answer(np.array([[a, b]], dtype=np.int64)), len(ids)))

    pos = 0
    for k, tiles in enumerate(image_tiles):
        at = text.index(IMAGE_PLACEHOLDER, pos)
        chunk(pos, at)
        n = tiles * tokens_per_tile + 2
        image_spans.append((length, length + n))
        pieces.append((tiles, None))
        length += n
        pos = at + len(IMAGE_PLACEHOLDER)
    chunk(pos, len(text))
    return ChatPlan(pieces, length, image_spans, list(image_tiles), tokenizer.img_start_id, tokenizer.img_end_id,
                    tokenizer.img_context_id, tokens_per_tile)


def render_conversation(conversations, tokenizer, image_tiles: list[int], tokens_per_tile: int,
                        system: str | None = None, add_bos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Convenience: parse + plan + materialize -> ``(input_ids, labels)`` int64 arrays."""
    turns = add_missing_placeholder(parse_conversations(conversations), len(image_tiles))
    return plan_conversation(turns, tokenizer, image_tiles, tokens_per_tile, system, add_bos).materialize()
