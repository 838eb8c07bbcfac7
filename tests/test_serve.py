"""`omnibal serve`'s HTTP mechanics, through the real `openai` client, against a server on loopback with a
stand-in generator (tests/standin_generator.py: its answers are computed from the request's text and media files,
so a right answer proves the request reached the generator intact)."""
from __future__ import annotations

import base64
import concurrent.futures
import http.client
import os
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from PIL import Image

import standin_generator as standin
from megatron.vlm.data.video_synthetic import write_coded_video
from megatron.vlm.inference.batching import BatchQueue, QueueFull, Ticket
from megatron.vlm.inference.chat_api import StreamText
from megatron.vlm.inference.server import ServerConfig, serving_in_background

MAX_BATCH = 4
IMAGE_SIZE, IMAGE_RGB = (40, 24), (200, 30, 90)
VIDEO_FRAMES, VIDEO_SIZE = 6, (64, 48)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A flat-colour PNG (its expected description computed here, from the pixels written) and an H.264 clip."""
    folder = tmp_path_factory.mktemp("media")
    image = folder / "flat.png"
    Image.new("RGB", IMAGE_SIZE, IMAGE_RGB).save(image)
    video = folder / "clip.mp4"
    write_coded_video(str(video), VIDEO_FRAMES, 4, *VIDEO_SIZE)
    return {"image": image, "video": video,
            "image_says": "image {}x{} rgb({},{},{})".format(*IMAGE_SIZE, *IMAGE_RGB),
            "video_says": f"video {VIDEO_FRAMES} frames {VIDEO_SIZE[0]}x{VIDEO_SIZE[1]}"}


@pytest.fixture(scope="module")
def generator():
    return standin.StandInGenerator(step_s=0.01)


@pytest.fixture(scope="module")
def server(generator):
    """One server on 127.0.0.1 (any free port) for the module."""
    config = ServerConfig(host="127.0.0.1", port=0, max_batch_size=MAX_BATCH, max_waiting=16)
    with serving_in_background(standin.served(), generator.generate, config) as url:
        yield url


IDLE_S = 5.5  # longer than httpx's (so openai's) idle expiry and uvicorn's default keep-alive, both 5 s


def two_requests_on_one_idle_connection(url: str) -> list[int]:
    """The statuses of GET /health twice on one HTTP/1.1 connection, ``IDLE_S`` idle between them (raises where the
    server closed it meanwhile)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    statuses = []
    try:
        for idle_s in (0.0, IDLE_S):
            time.sleep(idle_s)
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
    finally:
        connection.close()
    return statuses


@pytest.fixture(scope="module", autouse=True)
def idle_connection(server):
    """``two_requests_on_one_idle_connection`` in the background while the module's other tests run (a future)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool.submit(two_requests_on_one_idle_connection, server)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def data_url(path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def ask(client, content, **params):
    return client.chat.completions.create(model="stand-in", messages=[{"role": "user", "content": content}],
                                          **params)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def test_models_and_health(server):
    models = get_json(server + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["stand-in"] and models["object"] == "list"
    health = get_json(server + "/health")
    assert health["status"] == "ok" and health["model"] == "stand-in"


def test_image_and_video_chat_whole_and_streamed(client, media):
    """An image (data URL) and a video (local path) with text: the answer names what the generator read from the
    files; the stream's chunks reassemble to the same text and tokens, and end with the usage."""
    content = [{"type": "text", "text": "look"},
               {"type": "image_url", "image_url": {"url": data_url(media["image"], "image/png")}},
               {"type": "video_url", "video_url": {"url": str(media["video"])}}]
    expected = " ".join(["kool", media["image_says"], media["video_says"]])
    whole = ask(client, content, max_tokens=200)
    choice = whole.choices[0]
    assert choice.message.content == expected and choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == [ord(c) for c in expected]
    prompt = len("look") + standin.TOKENS_PER_IMAGE + standin.TOKENS_PER_VIDEO
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt, len(expected))

    chunks = list(ask(client, content, max_tokens=200, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert "".join(d.delta.content or "" for d in deltas) == expected
    assert [t for d in deltas for t in d.model_extra["token_ids"]] == choice.model_extra["token_ids"]
    assert [d.finish_reason for d in deltas].count("stop") == 1 and deltas[-1].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected) and not chunks[-1].choices

    # a frame file given as file:// URL, the video as a data URL: the same descriptions
    by_url = ask(client, [{"type": "image_url", "image_url": {"url": media["image"].as_uri()}},
                          {"type": "video_url", "video_url": {"url": data_url(media["video"], "video/mp4")}}])
    assert by_url.choices[0].message.content == f"{media['image_says']} {media['video_says']}"


def test_stop_strings_and_length(client):
    """A stop string cuts the answer before it (streamed: no character of it ever sent); max_tokens ends it with
    "length"."""
    text = "one two three four"  # answered reversed: "ruof eerht owt eno"
    stopped = ask(client, text, stop=["rht", "zz"])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("ruof ee", "stop")
    streamed = [c.choices[0].delta.content or "" for c in ask(client, text, stop=["rht", "zz"], stream=True)]
    assert "".join(streamed) == "ruof ee"
    short = ask(client, text, max_completion_tokens=5)
    assert (short.choices[0].message.content, short.choices[0].finish_reason) == ("ruof ", "length")


def test_eight_concurrent_requests_batched(client, server, generator):
    """Eight requests at once: each gets its own answer; they ran in batches of at most MAX_BATCH, some of them
    together."""
    before = get_json(server + "/health")
    calls_before = len(generator.batch_sizes)
    texts = [f"request number {k} " + "x" * (3 * k) for k in range(8)]
    answers: dict[int, str] = {}
    start = threading.Barrier(8)

    def one(k: int) -> None:
        start.wait()
        answers[k] = ask(client, texts[k], max_tokens=100).choices[0].message.content

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert answers == {k: texts[k][::-1] for k in range(8)}
    sizes = generator.batch_sizes[calls_before:]
    assert sum(sizes) == 8 and max(sizes) <= MAX_BATCH and len(sizes) < 8, sizes
    after = get_json(server + "/health")
    assert after["requests"] - before["requests"] == 8 and after["batches"] - before["batches"] == len(sizes)


def _garbage(kind: str) -> str:
    return f"data:{kind}/png;base64," + base64.b64encode(b"not a medium at all").decode()


BAD_REQUESTS = {  # name: (create() keyword arguments, HTTP status, a phrase of the message)
    "unknown field": (dict(extra_body={"frobnicate": 1}), 400, "'frobnicate'"),
    "n > 1": (dict(n=2), 400, "'n' = 2 is not supported"),
    "logprobs": (dict(logprobs=True), 400, "'logprobs' = True"),
    "temperature out of range": (dict(temperature=5), 400, "'temperature' must be a number in [0, 2]"),
    "wrong type": (dict(max_tokens="many"), 400, "'max_tokens' must be an int"),
    "both lengths differ": (dict(max_tokens=3, max_completion_tokens=4), 400, "differ"),
    "too long": (dict(max_tokens=10_000), 400, "maximum context length is 512 tokens"),
    "unknown model": (dict(model="gpt-9"), 404, "does not exist"),
    "unreadable image": (dict(content=[{"type": "image_url", "image_url": {"url": _garbage("image")}}]), 400,
                         "image is unreadable"),
    "unreadable video": (dict(content=[{"type": "video_url", "video_url": {"url": _garbage("video").replace(
        "video/png", "video/mp4")}}]), 400, "unreadable"),
    "missing file": (dict(content=[{"type": "image_url", "image_url": {"url": "/nonexistent/a.png"}}]), 400,
                     "no such file"),
    "remote url": (dict(content=[{"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]),
                   400, "not fetched"),
    "relative path": (dict(content=[{"type": "image_url", "image_url": {"url": "a.png"}}]), 400,
                      "neither a data URL nor an absolute path"),
    "detail": (dict(content=[{"type": "image_url", "image_url": {"url": "/x.png", "detail": "high"}}]), 400,
               "'detail' may only be"),
    "audio part": (dict(content=[{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]), 400,
                   "unsupported part 'input_audio'"),
    "last turn not the user's": (dict(messages=[{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "ih"}]), 400,
                                 "the last message must be the user's"),
    "turns out of order": (dict(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
                           400, "alternate"),
    "image tag in text": (dict(content="<image> what?"), 400, "holds <image>"),
    "tool role": (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400, "unsupported field"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_refused_and_server_goes_on(client, case):
    params, status, phrase = BAD_REQUESTS[case]
    params = dict(params)
    messages = params.pop("messages", [{"role": "user", "content": params.pop("content", "hello")}])
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=params.pop("model", "stand-in"), messages=messages, **params)
    error = refused.value
    assert error.status_code == status, error
    assert phrase in error.body["message"] and error.body["type"] == "invalid_request_error", error.body
    assert ask(client, "still here").choices[0].message.content == "ereh llits"


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("GET", "/v1/chat/completions", None, 405),
    ("GET", "/v1/nothing", None, 404),
])
def test_malformed_http_refused(server, client, method, path, body, status):
    request = urllib.request.Request(server + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == status
    assert set(json.loads(refused.value.read())["error"]) == {"message", "type", "param", "code"}
    assert ask(client, "ok").choices[0].message.content == "ko"


def test_queue_bound_and_stream_hold_back():
    """The queue refuses one ticket past its bound; the stream's text is held back while a stop string may
    still begin, and released by the final text."""
    batches = BatchQueue(max_batch_size=2, max_waiting=2)
    ticket = Ticket(None, None, lambda outcome: None)
    batches.put(ticket)
    batches.put(ticket)
    with pytest.raises(QueueFull):
        batches.put(ticket)
    assert [len(batches.take(0.01)), len(batches.take(0.01)), len(batches.take(0.01))] == [2, 0, 0]

    stream = StreamText(("STOP",))
    sent = [stream.push(p) for p in ("ab", "cS", "T", "x", "ST")]
    assert sent == ["ab", "c", "", "STx", ""]  # "ST" is held until "x" shows it is no stop string
    assert stream.finish("abcSTxST") == "ST"
    stream = StreamText(())
    stream.push("abc")
    with pytest.raises(RuntimeError):
        stream.finish("xyz")  # what was sent is not the answer's beginning: a generator's bug, not hidden


def test_serve_command_refusals(capsys):
    """`omnibal serve`'s own flags, a port it cannot take and a model without weights are refused in one line each,
    before any model loads."""
    import socket

    from omnibal_cli import main as omnibal

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        assert omnibal(["serve", "--max-batch-size", "0"]) == 1
        assert omnibal(["serve", "--keep-alive-s", "0"]) == 1
        assert omnibal(["serve", "--port", str(port)]) == 1
        assert omnibal(["serve", "--port", "0"]) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "omnibal serve: error: --max-batch-size must be >= 1, got 0"
    assert err[1] == "omnibal serve: error: --keep-alive-s must be >= 1, got 0"
    assert err[2].startswith(f"omnibal serve: error: --host 127.0.0.1 --port {port}: cannot listen there")
    assert "generation needs weights: give --hf-checkpoint DIR or --load CKPT" in err[3]


def test_batch_parcel_carries_media_across_hosts(tmp_path, media):
    """Across hosts a batch carries its media's bytes (a frame folder's frames too); a follower writes them to its
    own folder and reads the same requests from there."""
    from megatron.vlm.data.video_synthetic import write_coded_folder
    from megatron.vlm.inference.ranks import pack, unpack
    from megatron.vlm.inference.requests import GenerationRequest

    frames = write_coded_folder(str(tmp_path / "frames"), 3, 64, 48)
    asked = [GenerationRequest(({"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                             {"type": "video", "path": frames},
                                                             {"type": "text", "text": "and?"}]},)),
             GenerationRequest(({"role": "user", "content": "<image><video>so?"},), images=(str(media["image"]),),
                               videos=(str(media["video"]),))]
    assert unpack(pack(asked, with_media=False), str(tmp_path / "unused")) == asked  # one host: paths as they are
    parcel = pack(asked, with_media=True)
    assert len(parcel.media) == 3  # the image once, the frame folder, the clip
    here = tmp_path / "follower"
    here.mkdir()
    got = unpack(parcel, str(here))
    first, second = got[0].messages[0]["content"], got[1]
    assert Path(first[0]["image"]).read_bytes() == media["image"].read_bytes()
    assert sorted(p.name for p in Path(first[1]["path"]).iterdir()) == sorted(os.listdir(frames))
    assert second.images == (first[0]["image"],) and Path(second.videos[0]).read_bytes() == media["video"].read_bytes()
    assert all(str(here) in p for p in (first[0]["image"], first[1]["path"], second.videos[0]))
    assert first[2] == asked[0].messages[0]["content"][2] and second.messages == asked[1].messages


def test_failures_are_500_and_the_server_goes_on(client):
    """A bug while counting a prompt, or in the middle of a batch (whole and streamed), is a 500 with OpenAI's error
    body; the next request is answered."""
    for text in (standin.COUNT_FAIL_TEXT, standin.FAIL_TEXT):
        with pytest.raises(openai.InternalServerError) as failed:
            ask(client, text)
        assert failed.value.body["type"] == "server_error" and "a bug" in failed.value.body["message"]
    with pytest.raises(openai.APIError, match="a bug in the middle of a batch"):
        list(ask(client, standin.FAIL_TEXT, stream=True))
    assert ask(client, "fine").choices[0].message.content == "enif"


def test_an_idle_connection_outlives_the_clients_own_expiry(idle_connection):
    """The server keeps an idle connection open longer than clients do (``ServerConfig.keep_alive_s``), so a
    client never reuses one that the server is closing at that moment (that race dropped a request as "Server
    disconnected without sending a response")."""
    assert idle_connection.result(timeout=60) == [200, 200]
