"""``omnibal serve``'s HTTP side: an OpenAI-compatible server (FastAPI on uvicorn) in front of a ``BatchQueue``.

Endpoints: ``POST /v1/chat/completions`` (``chat_api.py``: whole answers, or server-sent events with
``"stream": true``), ``GET /v1/models`` and ``GET /health`` (the queue's counts).  The HTTP server runs on a
thread of its own; the thread that owns the generator (and, on several ranks, leads the others) runs
``batching.run_batches`` over the same queue.  Every refusal is an OpenAI error body with a 4xx status (a 5xx
only for a bug), and the server goes on serving.

A request's checks run on uvicorn's thread pool before it joins a batch: the body (``chat_api``), its media
(decoded once), and its length (``ServedModel.count_prompt_tokens``; prompt + completion tokens may not exceed
``max_sequence_length``).  Without ``max_tokens`` the answer may run to ``default_max_new_tokens``, or to the end
of the sequence if that comes first.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from megatron.vlm.inference.batching import BatchQueue, GenerateFn, QueueFull, Ticket, run_batches
from megatron.vlm.inference.chat_api import (ApiError, ChatCall, StreamText, chunk_body, completion_body,
                                             context_error, new_id, parse_chat_request, usage_chunk_body)
from megatron.vlm.inference.media import RequestMedia
from megatron.vlm.inference.ranks import BatchChannel, LeaderGenerator, follow
from megatron.vlm.inference.requests import GenerationRequest, GenerationResult, Generator
from omnibal_ext.errors import UserError, one_line


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP side knows of the model: its ``name`` (the request's ``model``), ``max_sequence_length``
    (tokens, prompt and answer together), ``count_prompt_tokens`` (a request's rendered prompt length, media
    tokens included; raises ``UserError`` on what the model's processors refuse) and
    ``default_max_new_tokens`` (the answer's length when the client gives none)."""

    name: str
    max_sequence_length: int
    count_prompt_tokens: Callable[[GenerationRequest], int]
    default_max_new_tokens: int = 256


@dataclass(frozen=True)
class ServerConfig:
    """``host`` and ``port`` to listen on (port 0: any free one); ``max_batch_size`` requests per batch;
    ``max_waiting`` requests waiting beyond it (then 429); ``media_dir``: where data URLs are written (None: the
    system's temporary folder); ``keep_alive_s``: seconds an idle connection stays open. It must outlast the
    clients' own idle expiry (httpx, so ``openai``: 5 s; load balancers: often 60 s) so that the client always
    closes first: a server that closes an idle connection just as the client reuses it drops that request
    ("Server disconnected without sending a response")."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8
    max_waiting: int = 64
    media_dir: str | None = None
    keep_alive_s: int = 75


def checked_request(body, model: ServedModel, media: RequestMedia) -> tuple[ChatCall, GenerationRequest]:
    """The checked call and its generation request (its length resolved); raises ``ApiError``."""
    call = parse_chat_request(body, model.name, media)
    try:
        prompt = model.count_prompt_tokens(call.request(1))
    except ApiError:
        raise
    except UserError as e:
        raise ApiError(str(e), param="messages") from None
    room = model.max_sequence_length - prompt
    if call.max_tokens is not None and call.max_tokens > room:
        raise context_error(prompt, call.max_tokens, model.max_sequence_length)
    if room < 1:
        raise context_error(prompt, 1, model.max_sequence_length)
    return call, call.request(call.max_tokens or min(model.default_max_new_tokens, room))


def build_app(model: ServedModel, batches: BatchQueue, media_dir: str | None = None) -> FastAPI:
    """The FastAPI application serving ``model`` through ``batches``."""
    app = FastAPI(title="omnibal serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def refused(_request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:  # unknown path, wrong method
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(ApiError(message, status=error.status_code).body(), status_code=error.status_code)

    @app.get("/health")
    async def health() -> dict:
        stats = batches.stats()
        return {"status": "ok", "model": model.name, "batches": stats.batches, "requests": stats.requests,
                "largest_batch": stats.largest, "waiting": stats.waiting}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": created,
                                            "owned_by": "omnibal"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not JSON ({e})") from None
        media = RequestMedia(media_dir)
        try:
            call, generation = await run_in_threadpool(checked_request, body, model, media)
        except ApiError:
            media.close()
            raise
        except Exception as e:  # a bug: a 500 for this request, its traceback in the log
            media.close()
            logging.getLogger(__name__).error("checking a request failed", exc_info=e)
            raise ApiError(f"internal error: {type(e).__name__}: {one_line(e)}", status=500,
                           kind="server_error") from None
        except BaseException:  # cancelled (the client left)
            media.close()
            raise
        answer = _Answer(asyncio.get_running_loop(), media, streamed=call.stream)
        try:
            batches.put(Ticket(generation, answer.on_token if call.stream else None, answer.on_done))
        except QueueFull as e:
            media.close()
            raise ApiError(str(e), status=429, code="rate_limit_exceeded", kind="rate_limit_error") from None
        completion_id = new_id()
        if call.stream:
            return StreamingResponse(_events(answer, completion_id, model.name, call), media_type="text/event-stream")
        return completion_body(completion_id, model.name, _result(await answer.done))

    return app


class _Answer:
    """One request's way back from the batch thread to the event loop: its tokens (streamed requests) and its
    result; its media are removed once it is done (the generator has read them)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, media: RequestMedia, streamed: bool):
        self._loop, self._media = loop, media
        self.tokens: asyncio.Queue | None = asyncio.Queue() if streamed else None
        self.done: asyncio.Future = loop.create_future()

    def on_token(self, token_id: int, text: str) -> None:
        self._loop.call_soon_threadsafe(self.tokens.put_nowait, (token_id, text))

    def on_done(self, outcome: GenerationResult | BaseException) -> None:
        self._media.close()
        self._loop.call_soon_threadsafe(self._finish, outcome)

    def _finish(self, outcome: GenerationResult | BaseException) -> None:
        if self.tokens is not None:
            self.tokens.put_nowait(None)
        if not self.done.done():
            self.done.set_result(outcome)


def _result(outcome: GenerationResult | BaseException) -> GenerationResult:
    """The result, or the batch's failure as an error (a ``UserError``: 400; anything else: a 500)."""
    if isinstance(outcome, UserError):
        raise ApiError(str(outcome))
    if isinstance(outcome, BaseException):
        raise ApiError(f"generation failed: {type(outcome).__name__}: {one_line(outcome)}", status=500,
                       kind="server_error")
    return outcome


async def _events(answer: _Answer, completion_id: str, model: str, call: ChatCall) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer: a first chunk with the role, one per token (its text
    held back while a stop string could still cut it), the rest of the text with the finish reason, the usage
    (``include_usage``), then ``[DONE]``; an error event if the batch failed."""
    def event(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    yield event(chunk_body(completion_id, model, {"role": "assistant", "content": ""}))
    text = StreamText(call.sampling.stop)
    while (token := await answer.tokens.get()) is not None:
        token_id, piece = token
        yield event(chunk_body(completion_id, model, {"content": text.push(piece)}, token_ids=(token_id,)))
    try:
        result = _result(await answer.done)
    except ApiError as e:
        yield event(e.body())
        return
    yield event(chunk_body(completion_id, model, {"content": text.finish(result.text)}, result.finish_reason))
    if call.include_usage:
        yield event(usage_chunk_body(completion_id, model, result))
    yield "data: [DONE]\n\n"


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: any free port), refused (``UserError``) where it cannot listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except (OSError, OverflowError) as e:
        listener.close()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({getattr(e, 'strerror', None) or e})") \
            from None
    return listener


class HttpThread:
    """uvicorn serving ``app`` on its own thread, on ``listener`` (``bind_listener``)."""

    def __init__(self, app: FastAPI, listener: socket.socket, keep_alive_s: int):
        self._socket = listener
        self.host, self.port = listener.getsockname()[:2]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                     timeout_keep_alive=keep_alive_s))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="omnibal-serve-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


def serve(model: ServedModel, generate: GenerateFn, config: ServerConfig, stop: threading.Event,
          on_listening: Callable[[str], None] = lambda url: None, listener: socket.socket | None = None) -> None:
    """Serve until ``stop`` is set: HTTP on its thread (on ``listener``, else a socket bound to the config's host
    and port), batches generated on this one."""
    batches = BatchQueue(config.max_batch_size, config.max_waiting)
    listener = listener or bind_listener(config.host, config.port)
    http = HttpThread(build_app(model, batches, config.media_dir), listener, config.keep_alive_s)
    http.start()
    try:
        on_listening(http.url)
        run_batches(batches, generate, stop)
    finally:
        http.stop()


@contextlib.contextmanager
def serving_in_background(model: ServedModel, generate: GenerateFn, config: ServerConfig) -> Iterator[str]:
    """``serve`` on a background thread (tests, notebooks); yields the server's URL."""
    stop, listening = threading.Event(), threading.Event()
    urls: list[str] = []

    def on_listening(url: str) -> None:
        urls.append(url)
        listening.set()

    thread = threading.Thread(target=serve, args=(model, generate, config, stop, on_listening),
                              name="omnibal-serve-batches", daemon=True)
    thread.start()
    if not listening.wait(timeout=30):
        stop.set()
        raise RuntimeError("the server did not start")
    try:
        yield urls[0]
    finally:
        stop.set()
        thread.join(timeout=30)


def serve_layout(generator: Generator, model: ServedModel, config: ServerConfig,
                 on_listening: Callable[[str], None] = lambda url: None,
                 listener: socket.socket | None = None) -> None:
    """Collective (every rank of the layout): rank 0 serves (``serve``), sending each batch to the other ranks,
    which follow it (``ranks.follow``); ``listener``: rank 0's socket, bound before the model loaded.  SIGINT or
    SIGTERM ends it after the batch in progress: rank 0 stops serving and releases the others (which ignore those
    signals meanwhile, so none leaves a collective early)."""
    channel = BatchChannel()
    stop = threading.Event()
    handler = (lambda signum, frame: stop.set()) if channel.is_leader else (lambda signum, frame: None)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not channel.is_leader:
            follow(generator, channel)
            return
        leader = LeaderGenerator(generator, channel)
        try:
            serve(model, leader.generate, config, stop, on_listening, listener)
        finally:
            leader.release()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
