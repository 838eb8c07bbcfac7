"""The OpenAI chat-completions protocol: a request body checked and turned into a ``GenerationRequest``, and the
answer's JSON (whole or as stream chunks).  No HTTP here (``server.py`` carries it).

What a request may hold (anything else is refused with a 400 naming it, never ignored):

* ``model`` (the served model's name, else 404), ``messages`` (roles ``system`` (or ``developer``, read as
  system), ``user``, ``assistant``; ``content`` a string or a list of ``text``, ``image_url`` and ``video_url``
  parts, each medium a data URL or a local path: ``media.py``), ending with a user message;
* ``max_completion_tokens`` or ``max_tokens`` (the same number if both), ``temperature`` in [0, 2] (0: greedy),
  ``top_p`` in (0, 1], ``top_k`` >= 0 (0: off), ``seed``, ``stop`` (a string or up to 4), ``stop_token_ids``,
  ``stream`` and ``stream_options.include_usage``;
* parameters this server does not implement, at their neutral value only: ``n`` 1, ``frequency_penalty`` and
  ``presence_penalty`` 0, ``logprobs`` false; any other value is refused.

Errors are ``ApiError``s: an HTTP status and the OpenAI error body ``{"error": {"message", "type", "param",
"code"}}``.  Answers carry one extension beside OpenAI's fields: each choice's ``token_ids`` (the new tokens, as
``omnibal generate`` writes them), and each stream chunk's (the tokens of that chunk).
"""
from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass

from megatron.vlm.data.messages import MessagesRecordError, parse_messages_record
from megatron.vlm.inference.media import IMAGE, VIDEO, MediaError, RequestMedia
from megatron.vlm.inference.requests import GenerationRequest, GenerationResult, SamplingParams
from omnibal_ext.errors import UserError, one_line

MAX_STOP_STRINGS = 4  # OpenAI's limit
NEUTRAL = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False}  # accepted at these only
FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stop_token_ids", "stream", "stream_options", *NEUTRAL}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MEDIA = {kind.part_type: kind for kind in (IMAGE, VIDEO)}


class ApiError(UserError):
    """A request refused with HTTP ``status`` (4xx); ``param`` names the offending field, ``code`` OpenAI's
    error code where one fits (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": one_line(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatCall:
    """A checked request: the trainer-form ``messages`` (media as local files), its ``sampling`` (its
    ``max_new_tokens`` is ``max_tokens``, or the server's default when the client gave none), ``max_tokens``
    (None: not given), and how to answer (``stream``, ``include_usage``)."""

    messages: tuple[dict, ...]
    sampling: SamplingParams
    max_tokens: int | None
    stream: bool
    include_usage: bool

    def request(self, max_new_tokens: int) -> GenerationRequest:
        """The generation request with ``max_new_tokens``."""
        return GenerationRequest(self.messages, dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens))


def parse_chat_request(body, model_name: str, media: RequestMedia) -> ChatCall:
    """Check a decoded request body (see the module docstring) and convert it; data URLs are written to
    ``media``'s folder.  Raises ``ApiError``."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(f"unknown or unsupported field(s) {', '.join(map(repr, unknown))}; this server takes "
                       f"{', '.join(sorted(FIELDS))}", param=unknown[0], code="unsupported_parameter")
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise ApiError(f"'{name}' = {body[name]!r} is not supported (only {neutral!r})", param=name,
                           code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError("'model' (a string) is required", param="model")
    if model != model_name:
        raise ApiError(f"the model {model!r} does not exist; this server serves {model_name!r}", status=404,
                       param="model", code="model_not_found")
    stream = _optional(body, "stream", bool, False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError("'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError("'stream_options' takes only {\"include_usage\": bool}", param="stream_options")
        include_usage = _optional(options, "include_usage", bool, False, "stream_options.include_usage")
    max_tokens = _max_tokens(body)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 0.0, lambda t: 0.0 <= t <= 2.0, "in [0, 2]"),
        top_p=_number(body, "top_p", 1.0, lambda p: 0.0 < p <= 1.0, "in (0, 1]"),
        top_k=_integer(body, "top_k", 0, 0),
        seed=_optional(body, "seed", int, None),
        stop=_stop(body.get("stop")),
        stop_token_ids=_token_ids(body.get("stop_token_ids")))
    return ChatCall(_messages(body.get("messages"), media), sampling, max_tokens, stream, include_usage)


def _optional(body: dict, name: str, kind: type, default, param: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(f"'{param or name}' must be a{'n' if kind is int else ''} {kind.__name__}, got {value!r}",
                       param=param or name)
    return value


def _number(body: dict, name: str, default: float, ok, rule: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ApiError(f"'{name}' must be a number {rule}, got {value!r}", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, least: int) -> int | None:
    value = _optional(body, name, int, default)
    if value is not None and value < least:
        raise ApiError(f"'{name}' must be an integer >= {least}, got {value}", param=name)
    return value


def _max_tokens(body: dict) -> int | None:
    given = {name: _integer(body, name, None, 1) for name in ("max_completion_tokens", "max_tokens")}
    values = {v for v in given.values() if v is not None}
    if len(values) > 1:
        raise ApiError(f"'max_completion_tokens' ({given['max_completion_tokens']}) and 'max_tokens' "
                       f"({given['max_tokens']}) differ; give one", param="max_tokens")
    return values.pop() if values else None


def _stop(stop) -> tuple[str, ...]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise ApiError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, "
                       f"got {stop!r}", param="stop")
    return tuple(stops)


def _token_ids(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ApiError(f"'stop_token_ids' must be a list of token ids (integers >= 0), got {ids!r}",
                       param="stop_token_ids")
    return tuple(ids)


def _messages(messages, media: RequestMedia) -> tuple[dict, ...]:
    """The trainer-form messages (structured content, media as local paths), checked by the trainer's own
    ``messages`` reader (a placeholder final answer makes the record complete)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where} must be an object", param=where)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise ApiError(f"{where}: unsupported field(s) {', '.join(map(repr, extra))} (a message takes 'role' "
                           "and 'content')", param=f"{where}.{extra[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role = {role!r}; expected one of {', '.join(ROLES)}", param=f"{where}.role")
        out.append({"role": ROLES[role], "content": _content(message.get("content"), where, media)})
    if out[-1]["role"] != "user":
        raise ApiError(f"the last message must be the user's (the answer is generated), got {out[-1]['role']!r}",
                       param=f"messages[{len(out) - 1}].role")
    try:
        parse_messages_record({"messages": [*out, {"role": "assistant", "content": "-"}]}, "")
    except MessagesRecordError as e:
        raise ApiError(str(e), param="messages") from None
    return tuple(out)


def _content(content, where: str, media: RequestMedia) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise ApiError(f"{where}.content must be a string or a non-empty list of parts", param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ApiError(f"{at}: a text part is {{\"type\": \"text\", \"text\": STRING}}", param=at)
            parts.append({"type": "text", "text": part["text"]})
        elif kind in MEDIA:
            medium = MEDIA[kind]
            spec = part.get(kind)
            if set(part) != {"type", kind} or not isinstance(spec, dict) or "url" not in spec \
                    or set(spec) - {"url", "detail"} or spec.get("detail", "auto") != "auto":
                raise ApiError(f"{at}: a {kind} part is {{\"type\": \"{kind}\", \"{kind}\": {{\"url\": URL}}}} "
                               "('detail' may only be \"auto\")", param=at)
            try:
                path = media.local_path(spec["url"], medium, at)
            except MediaError as e:
                raise ApiError(str(e), param=at, code="invalid_media") from None
            parts.append({"type": medium.trainer_type, medium.trainer_type: path})
        else:
            raise ApiError(f"{at}: unsupported part {kind!r}; this server takes text, image_url and video_url parts",
                           param=at)
    return parts


def context_error(prompt_tokens: int, max_tokens: int, limit: int) -> ApiError:
    """OpenAI's refusal of a request longer than the model's sequence length."""
    return ApiError(f"this model's maximum context length is {limit} tokens; the request holds {prompt_tokens} "
                    f"prompt tokens and asks for {max_tokens} completion tokens ({prompt_tokens + max_tokens} in all)",
                    param="messages", code="context_length_exceeded")


def new_id() -> str:
    """A completion id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids)}


def completion_body(completion_id: str, model: str, result: GenerationResult) -> dict:
    """The whole answer (``chat.completion``)."""
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None, "finish_reason": result.finish_reason,
                         "token_ids": list(result.token_ids)}],
            "usage": usage(result)}


def chunk_body(completion_id: str, model: str, delta: dict, finish_reason: str | None = None,
               token_ids: tuple[int, ...] = ()) -> dict:
    """One stream chunk (``chat.completion.chunk``) of the only choice."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                         "token_ids": list(token_ids)}]}


def usage_chunk_body(completion_id: str, model: str, result: GenerationResult) -> dict:
    """The last stream chunk under ``stream_options.include_usage``: no choices, the usage."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(result)}


class StreamText:
    """The text a stream may send so far: the tokens' pieces joined, less any tail that a stop string could
    still cut off (the generator cuts the text before a stop string; what was sent cannot be taken back)."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._text = ""
        self.sent = 0  # characters sent

    def push(self, piece: str) -> str:
        """Take one token's ``piece``; returns the text that may be sent now."""
        self._text += piece
        safe = len(self._text)
        for stop in self._stops:
            found = self._text.find(stop, self.sent)
            if found >= 0:
                safe = min(safe, found)
            for k in range(min(len(stop) - 1, len(self._text)), 0, -1):  # a tail that begins the stop string
                if self._text.endswith(stop[:k]):
                    safe = min(safe, len(self._text) - k)
                    break
        return self._take(max(safe, self.sent))

    def finish(self, text: str) -> str:
        """The rest of the generator's final ``text`` (what was sent is its prefix)."""
        if not text.startswith(self._text[:self.sent]):
            raise RuntimeError(f"the streamed text {self._text[:self.sent]!r} is not a prefix of the answer "
                               f"{text!r}")
        self._text = text
        return self._take(len(text))

    def _take(self, upto: int) -> str:
        out = self._text[self.sent:upto]
        self.sent = upto
        return out
