"""`omnibal serve` end to end: a tiny random Qwen2.5-VL served at PP 2 (two ranks, rank 0 serving, rank 1 following),
asked through the `openai` client, against `omnibal generate` (one process) on the same requests: an image chat and
a video chat, whole and streamed, eight concurrent requests, a refused request; then SIGTERM stops both ranks
cleanly.  One launch of each."""
from __future__ import annotations

import base64
import json
import threading
import urllib.request
from pathlib import Path

import openai
import pytest
from PIL import Image

import hf_tiny_qwen
import pool
from launch import benchlib
from megatron.vlm.data.video_synthetic import write_coded_video

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
QUESTIONS = [f"q{k}: what is shown{'?' * k}" for k in range(8)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The model folder, its media, the trainer flags, and `omnibal generate`'s answers to the requests (messages
    records as the server makes them: structured parts, absolute paths)."""
    folder = tmp_path_factory.mktemp("serve_engine")
    hf_tiny_qwen.make_tiny_with_tokenizer(folder / "tiny", seed=0)
    image, video = folder / "photo.png", folder / "clip.mp4"
    Image.new("RGB", (84, 56), (30, 160, 220)).save(image)
    write_coded_video(str(video), 4, 2, 64, 48)
    flags = ["--hf-checkpoint", str(folder / "tiny"), "--seq-length", "2048"]

    def asked(parts: list[dict]) -> dict:
        return {"messages": [{"role": "user", "content": parts}]}

    requests = [asked([{"type": "image", "image": str(image)}, {"type": "text", "text": "Describe it."}]),
                asked([{"type": "video", "video": str(video)}, {"type": "text", "text": "What happens?"}]),
                *[asked(([{"type": "image", "image": str(image)}] if k % 2 else []) +
                        [{"type": "text", "text": q}]) for k, q in enumerate(QUESTIONS)]]
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    done = pool.run_case("omnibal_cli:main", ["generate", "--input", str(folder / "requests.jsonl"), "--output",
                                              str(folder / "answers.jsonl"), "--max-new-tokens", str(MAX_TOKENS),
                                              *flags], 1, folder, timeout=600)  # a world of one, in the pool
    assert done.returncode == 0, done.output[-6000:]
    answers = [json.loads(line) for line in (folder / "answers.jsonl").read_text().splitlines()]
    return {"image": image, "video": video, "flags": flags, "answers": answers}


@pytest.fixture(scope="module")
def server(case, tmp_path_factory):
    """`omnibal serve` at PP 2, its two ranks started as torchrun starts them."""
    with benchlib.serving(["--served-model-name", "tiny", "--max-batch-size", "8", *case["flags"],
                           "--pipeline-model-parallel-size", "2"], tmp_path_factory.mktemp("serve_logs")) as served:
        yield served


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def test_served_answers_equal_omnibal_generate(case, server):
    url = server.url
    assert server.name == "tiny"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    answers = case["answers"]

    def ask(content, stream=False):
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                               max_tokens=MAX_TOKENS, stream=stream)
        if not stream:
            return reply.choices[0].model_extra["token_ids"], reply.choices[0].message.content
        chunks = [c.choices[0] for c in reply if c.choices]
        return [t for c in chunks for t in c.model_extra["token_ids"]], "".join(c.delta.content or "" for c in chunks)

    image = {"type": "image_url", "image_url": {"url": data_url(case["image"], "image/png")}}
    video = {"type": "video_url", "video_url": {"url": str(case["video"])}}
    expected = [(a["token_ids"], a["text"]) for a in answers]
    assert len({tuple(t) for t, _ in expected}) > 3, expected  # the answers differ: a real comparison
    for stream in (False, True):
        assert ask([image, {"type": "text", "text": "Describe it."}], stream) == expected[0]
        assert ask([video, {"type": "text", "text": "What happens?"}], stream) == expected[1]

    got: dict[int, tuple] = {}
    start = threading.Barrier(len(QUESTIONS))

    def one(k: int) -> None:
        start.wait()
        got[k] = ask(([image] if k % 2 else []) + [{"type": "text", "text": QUESTIONS[k]}])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == {k: expected[2 + k] for k in range(len(QUESTIONS))}
    with urllib.request.urlopen(url + "/health", timeout=30) as response:
        assert json.loads(response.read())["largest_batch"] > 1

    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048 tokens"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
    assert ask([image, {"type": "text", "text": "Describe it."}]) == expected[0]

    assert server.stop() == [0, 0], server.output()  # as torchrun forwards a Ctrl-C: both ranks leave cleanly
