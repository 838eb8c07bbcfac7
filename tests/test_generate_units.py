"""The generation engine's parts against independent computations: the decode cache's attention against causal
softmax attention over each whole sequence (float64), the Gated DeltaNet's convolution and delta rule continued from
their states against the token-by-token recurrence (float64), top-k / top-p against brute force, the text stream's
stops and deltas, prompts cut before their answers, and the refusals of bad requests and flags."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron.vlm.inference.cache import DecodeCache, DecodeStep
from megatron.vlm.inference.requests import SamplingParams
from megatron.vlm.inference.sampling import choose_token, filtered_logits
from megatron.vlm.inference.stopping import TextStream
from omnibal_ext.errors import UserError


def reference_attention(q, k, v, scale):
    """Causal softmax attention of one sequence in float64: q [n, heads, d], k/v [n, groups, d]."""
    q, k, v = (x.double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(n, -1)


class Layer(SimpleNamespace):
    """What the cache reads of a SegmentAttention module (hashable: the cache finds a layer's buffers by it)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def test_cached_attention_equals_whole_sequence_attention():
    """Two sequences (5 and 3 prompt tokens) prefilled packed, then 4 decode steps (their two tokens in one segment,
    then a padding segment, as under sequence parallelism): every output equals causal attention over the sequence so
    far."""
    g = torch.Generator().manual_seed(0)
    heads, groups, d = 4, 2, 8
    layer = Layer(hidden_size_per_partition=heads * d, softmax_scale=d ** -0.5, gqa=True)
    lengths, steps = (5, 3), 4
    seqs = [(torch.randn(n + steps, heads, d, generator=g), torch.randn(n + steps, groups, d, generator=g),
             torch.randn(n + steps, groups, d, generator=g)) for n in lengths]
    cache = DecodeCache(2, 16)
    q, k, v = (torch.cat([s[j][:n] for s, n in zip(seqs, lengths)]) for j in range(3))
    out = DecodeStep(cache, (0, 1), (0, 0), prefill=True).attend(layer, q, k, v, ((0, 5), (5, 8)), True)
    for s, (a, e), n in zip(seqs, ((0, 5), (5, 8)), lengths):
        torch.testing.assert_close(out[a:e].double(), reference_attention(s[0][:n], s[1][:n], s[2][:n], d ** -0.5))
    for step in range(steps):
        rows = [n + step for n in lengths]
        q, k, v = (torch.cat([torch.stack([s[j][r] for s, r in zip(seqs, rows)]), torch.zeros(2, *s[j].shape[1:])])
                   for j in range(3))  # two tokens, then a padding segment of two
        out = DecodeStep(cache, (0, 1), (rows[0], rows[1]), prefill=False).attend(layer, q, k, v, ((0, 2), (2, 4)),
                                                                                 True)
        for i, (s, r) in enumerate(zip(seqs, rows)):
            want = reference_attention(s[0][:r + 1], s[1][:r + 1], s[2][:r + 1], d ** -0.5)[-1]
            torch.testing.assert_close(out[i].double(), want)
        assert out[2:].abs().max() == 0


def recurrent_rule(q, k, v, g, beta):
    """The gated delta rule token by token in float64 (q, k [n, heads, dk] per value head, scale 1/sqrt(dk))."""
    state = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        kt, vt = k[t].double(), v[t].double()
        delta = beta[t].double()[:, None] * (vt - torch.einsum("hk,hkv->hv", kt, state))
        state = state + kt[:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t].double() * q.shape[-1] ** -0.5, state))
    return torch.stack(out)


def conv_reference(x, weight):
    """Causal depthwise convolution of one sequence: out[i] = sum_j weight[:, w-1-j] x[i-j] (float64)."""
    w = weight.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        for j in range(min(w, i + 1)):
            out[i] += weight[:, w - 1 - j].double() * x[i - j].double()
    return out


def test_delta_rule_and_conv_continue_their_states():
    """A prefill of two packed sequences (7 and 2 tokens; chunk 4, so the first spans chunks) then 3 decode steps:
    the rule's outputs equal the recurrence over each whole sequence, the convolution the direct sum; key heads serve
    two value heads each."""
    gen = torch.Generator().manual_seed(1)
    key_heads, heads, dk, dv, channels, width = 1, 2, 4, 3, 5, 4
    lengths, steps = (7, 2), 3
    layer = object()
    cache = DecodeCache(2, 16)

    def draw(n):
        q = torch.nn.functional.normalize(torch.randn(n, key_heads, dk, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(n, key_heads, dk, generator=gen), dim=-1)
        return (q, k, torch.randn(n, heads, dv, generator=gen), -torch.rand(n, heads, generator=gen),
                torch.rand(n, heads, generator=gen), torch.randn(n, channels, generator=gen))

    seqs = [draw(n + steps) for n in lengths]
    weight = torch.randn(channels, width, generator=gen)
    segments = ((0, 7), (7, 9))
    step = DecodeStep(cache, (0, 1), (0, 0), prefill=True)
    cat = [torch.cat([s[j][:n] for s, n in zip(seqs, lengths)]) for j in range(6)]
    o = step.delta_rule(layer, *cat[:5], segments, None, 4, "torch")
    c = step.conv(layer, cat[5], weight, segments)
    for s, (a, e), n in zip(seqs, segments, lengths):
        full = [x.repeat_interleave(heads // key_heads, 1) for x in s[:2]]
        torch.testing.assert_close(o[a:e].double(), recurrent_rule(full[0][:n], full[1][:n], *(x[:n] for x in s[2:5])))
        torch.testing.assert_close(c[a:e].double(), conv_reference(s[5][:n], weight))
    for t in range(steps):
        rows = [n + t for n in lengths]
        one = [torch.stack([s[j][r] for s, r in zip(seqs, rows)]) for j in range(6)]
        step = DecodeStep(cache, (1, 0), (rows[1], rows[0]), prefill=False)  # slots in another order than the cache's
        o = step.delta_rule(layer, *(x.flip(0) for x in one[:5]), ((0, 2),), None, 4, "torch").flip(0)
        c = step.conv(layer, one[5].flip(0), weight, ((0, 2),)).flip(0)
        for i, (s, r) in enumerate(zip(seqs, rows)):
            full = [x.repeat_interleave(heads // key_heads, 1) for x in s[:2]]
            want = recurrent_rule(full[0][:r + 1], full[1][:r + 1], *(x[:r + 1] for x in s[2:5]))[-1]
            torch.testing.assert_close(o[i].double(), want)
            torch.testing.assert_close(c[i].double(), conv_reference(s[5][:r + 1], weight)[-1])


def test_a_step_mixing_prefill_and_decode_is_refused():
    with pytest.raises(ValueError, match="prefill"):
        DecodeStep(DecodeCache(2, 8), (0, 1), (0, 3), prefill=False)
    with pytest.raises(ValueError, match="cache"):
        DecodeStep(DecodeCache(2, 8), (0, 2), (3, 3), prefill=False)


def nucleus_brute_force(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens kept: the top-k, then the fewest most likely whose probability reaches top_p (by enumeration)."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    kept = order[:top_k] if top_k else order
    probs = torch.tensor([float(logits[i]) for i in kept]).softmax(0).tolist()
    out, mass = [], 0.0
    for i, p in zip(kept, probs):
        out.append(i)
        mass += p
        if mass >= top_p:
            break
    return set(out)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (3, 1.0), (5, 0.8), (0, 1.0), (2, 0.01)])
def test_top_k_and_top_p_keep_what_brute_force_keeps(top_k, top_p):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(top_k + int(100 * top_p)))
    kept = filtered_logits(logits, SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p))
    assert set(torch.nonzero(kept > float("-inf")).flatten().tolist()) == nucleus_brute_force(logits / 0.7, top_k,
                                                                                               top_p)


def test_sampling_draws_by_the_probabilities_and_repeats_with_the_seed():
    logits = torch.tensor([0.0, torch.log(torch.tensor(3.0))])
    params = SamplingParams(temperature=1.0, seed=5)
    draws = [choose_token(logits, params, gen) for gen in [torch.Generator().manual_seed(5)] for _ in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.75) < 5 * (0.75 * 0.25 / 4000) ** 0.5
    again = [choose_token(logits, params, torch.Generator().manual_seed(5)) for _ in range(1)]
    assert again[0] == draws[0]
    assert choose_token(logits, SamplingParams(), None) == 1


def char_decode(ids):
    return "".join(chr(i) for i in ids)


def test_stream_stops_at_a_stop_string_and_holds_back_its_prefix():
    s = TextStream(SamplingParams(max_new_tokens=20, stop=("END",)), char_decode, frozenset({0}))
    deltas = [s.add(ord(c)) for c in "abcEN"]
    assert "".join(deltas) == "abc" and not s.finished  # "EN" may start the stop string: held back
    deltas.append(s.add(ord("D")))
    assert s.finished and s.finish_reason == "stop" and s.text == "abc" and "".join(deltas) == "abc"
    assert s.result().token_ids == tuple(ord(c) for c in "abcEND")


def test_stream_stop_tokens_length_and_ignore_eos():
    s = TextStream(SamplingParams(max_new_tokens=5), char_decode, frozenset({0}))
    assert [s.add(t) for t in (104, 105, 0)] == ["h", "i", ""]
    r = s.result()
    assert (r.token_ids, r.text, r.finish_reason) == ((104, 105, 0), "hi", "stop")
    s = TextStream(SamplingParams(max_new_tokens=3, ignore_eos=True, stop_token_ids=(7,)), char_decode,
                   frozenset({0}))
    for t in (104, 0, 105):
        s.add(t)
    assert s.finish_reason == "length" and s.result().token_ids == (104, 0, 105)
    s = TextStream(SamplingParams(max_new_tokens=3, ignore_eos=True, stop_token_ids=(7,)), char_decode,
                   frozenset({0}))
    s.add(7)
    assert s.finish_reason == "stop" and s.text == ""
    with pytest.raises(ValueError):
        s.add(1)


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -2), ("stop", ("",))])
def test_sampling_settings_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).check()


def test_answer_prompts_cut_each_answer_with_its_history():
    from megatron.vlm.inference.prompts import answer_prompts

    ids = torch.arange(10, 22)
    labels = torch.full((12,), -100)
    labels[3:5] = ids[4:6]  # answer one: tokens 4, 5
    labels[8:10] = ids[9:11]  # answer two: tokens 9, 10
    prompts = answer_prompts({"input_ids": ids, "labels": labels, "mm_token_type_ids": torch.zeros(12)})
    assert [p.sample["input_ids"].tolist() for p in prompts] == [list(range(10, 14)), list(range(10, 19))]
    assert [p.answer for p in prompts] == [(14, 15), (19, 20)]
    assert all(len(p.sample["mm_token_type_ids"]) == p.length and (p.sample["labels"] == -100).all() for p in prompts)


def reader():
    from megatron.vlm.data.images import TileImages
    from megatron.vlm.data.records import ReaderConfig
    from megatron.vlm.data.tokenizer import ByteTokenizer

    return ByteTokenizer(), ReaderConfig(images=TileImages(32, 4, 2))


def test_a_request_prompt_ends_with_the_generation_prompt(tmp_path):
    from megatron.vlm.inference.prompts import read_prompts

    tok, config = reader()
    line = json.dumps({"messages": [{"role": "user", "content": "Hi?"}]})
    (prompt,) = read_prompts([line], str(tmp_path), tok, config, ["r"])
    want = [tok.bos_id, tok.im_start_id] + tok.encode("user\nHi?") + [tok.im_end_id] + tok.encode("\n") + \
        [tok.im_start_id] + tok.encode("assistant\n")
    assert prompt.sample["input_ids"].tolist() == want


def test_bad_requests_are_named_before_any_work(tmp_path):
    from megatron.vlm.inference.prompts import PromptError, read_prompts

    tok, config = reader()
    lines = ['{"messages": [{"role": "user", "content": "ok"}]}', "{not json",
             '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
             '{"messages": [{"role": "user", "content": "<image>x"}], "images": ["missing.png"]}', "",
             '{"conversations": [{"from": "human", "value": "q"}]}']
    names = [f"in.jsonl:{i + 1}" for i in range(len(lines))]
    with pytest.raises(PromptError) as e:
        read_prompts(lines, str(tmp_path), tok, config, names)
    assert "in.jsonl:2: not valid JSON" in str(e.value) and "in.jsonl:3: the conversation ends with an assistant" \
        in str(e.value) and "in.jsonl:6: a 'conversations' record" in str(e.value)
    with pytest.raises(PromptError, match=r"in.jsonl:4: image file not found"):
        read_prompts(lines[:1] + lines[3:4], str(tmp_path), tok, config, [names[0], names[3]])


def test_generate_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    """``omnibal generate``: a bad sampling flag, a missing input, and a bad line (named file:line, before the model
    is built) exit 1 with one line."""
    import omnibal_cli

    bad = tmp_path / "in.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    assert omnibal_cli.main(["generate", "--input", str(bad), "--top-p", "2"]) == 1
    assert "--top-p: must be in (0, 1]" in capsys.readouterr().err
    assert omnibal_cli.main(["generate", "--input", str(tmp_path / "none.jsonl")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert omnibal_cli.main(["generate", "--input", str(bad), "--model", "tiny", "--load", str(tmp_path / "c")]) == 1
    assert "--load" in capsys.readouterr().err
    err_line = None
    assert omnibal_cli.main(["generate", "--input", str(bad), "--model", "tiny", "--hf-checkpoint",
                             str(tmp_path / "nohf")]) == 1
    err_line = capsys.readouterr().err.strip().splitlines()
    assert len(err_line) == 1 and err_line[0].startswith("omnibal generate: error:")


def test_generate_command_names_a_bad_line_before_building_the_model(tmp_path, capsys):
    """A tiny InternVL folder, an input whose second line is not JSON and third misses its image: one line naming
    both ``file:line``, exit 1 (the world of one the command started torn down)."""
    import hf_tiny
    import omnibal_cli

    hf_tiny.make_tiny_with_tokenizer(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bars
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n'
                   '{"messages": [{"role": "user", "content": "<image>x"}], "images": ["gone.png"]}\n')
    assert omnibal_cli.main(["generate", "--hf-checkpoint", str(tmp_path / "hf"), "--input", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}:2: not valid JSON" in err[0]
    bad.write_text('{"messages": [{"role": "user", "content": "<image>x"}], "images": ["gone.png"]}\n')
    assert omnibal_cli.main(["generate", "--hf-checkpoint", str(tmp_path / "hf"), "--input", str(bad)]) == 1
    assert f"{bad}:1: image file not found" in capsys.readouterr().err


def test_difference_causes():
    from megatron.training.eval_generate import difference_cause

    answer = (5, 6, 2)
    assert difference_cause(answer, [5, 6, 2], [5, 6, 2], [1.0] * 3) is None
    assert difference_cause(answer, [5, 6, 2, 9], [5, 6, 2], [1.0] * 3) == "stop token"
    assert difference_cause(answer, [5, 7], [5, 6, 2], [1.0, 5e-5, 1.0]) == "near-tie"
    assert difference_cause(answer, [5, 7], [5, 6, 2], [1.0, 0.5, 1.0]) == "other"
    assert difference_cause(answer, [5, 6, 2], [5, 7, 2], [1.0, 1e-6, 1.0]) == "near-tie"
