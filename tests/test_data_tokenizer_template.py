"""Tokenizer round trip and the chat template's token/label layout."""
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron.vlm.data import (ByteTokenizer, ConversationError, HFTokenizer, SPECIAL_TOKENS, build_tokenizer,
                               padded_vocab_size, parse_conversations, plan_conversation, render_conversation)
from megatron.vlm.data.template import add_missing_placeholder

TOK = ByteTokenizer()


def test_special_ids_follow_the_bytes():
    assert TOK.vocab_size == 256 + len(SPECIAL_TOKENS) == 264
    for k, t in enumerate(SPECIAL_TOKENS):
        assert TOK.encode(t) == [256 + k]
    assert [TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.im_start_id, TOK.im_end_id, TOK.img_start_id,
            TOK.img_end_id, TOK.img_context_id] == list(range(256, 264))
    assert TOK.encode("<image>") == list(b"<image>")  # the placeholder is text, not a token
    assert TOK.encode("héllo") == list("héllo".encode("utf-8"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=20), st.sampled_from(SPECIAL_TOKENS)), max_size=8))
def test_round_trip_with_special_tokens(parts):
    text = "".join(parts)
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert all(0 <= i < TOK.vocab_size for i in ids)
    specials = sum(text.count(t) for t in SPECIAL_TOKENS)  # no special string is a substring of another
    assert sum(i >= 256 for i in ids) == specials


def test_decode_rejects_unknown_ids():
    with pytest.raises(ValueError, match="264"):
        TOK.decode([1, 264])


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("multiple", [1, 64, 128])
def test_padded_vocab_size_is_smallest_multiple(tp, multiple):
    for v in [1, 100, 264, 383, 384, 385, 92544, 64000]:
        brute = next(x for x in range(v, v + multiple * tp + 1) if x % (multiple * tp) == 0)
        assert padded_vocab_size(v, tp, multiple) == brute
    assert padded_vocab_size(264, 1) == 384


def test_hf_tokenizer_needs_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails like an absent package
    with pytest.raises(ImportError, match=r"omnibal-megatron\[hf\]"):
        build_tokenizer(str(tmp_path))
    assert isinstance(build_tokenizer(None), ByteTokenizer)


def test_hf_tokenizer_adds_missing_special_tokens(monkeypatch, tmp_path):
    class FakeHF:  # a vocabulary with <s>, </s> and <|im_start|> only
        def __init__(self):
            self.vocab = {"<s>": 0, "</s>": 1, "<|im_start|>": 2, "a": 3}
            self.pad_token_id, self.bos_token_id, self.eos_token_id = None, 0, 1

        def get_vocab(self):
            return dict(self.vocab)

        def add_tokens(self, tokens, special_tokens=False):
            for t in tokens:
                self.vocab.setdefault(t, len(self.vocab))

        def __len__(self):
            return len(self.vocab)

        def convert_tokens_to_ids(self, t):
            return self.vocab[t]

        def encode(self, text, add_special_tokens=False):
            return [self.vocab[c] for c in text]

    fake = types.SimpleNamespace(AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda *a, **k: FakeHF()))
    monkeypatch.setitem(sys.modules, "transformers", fake)
    tok = HFTokenizer(str(tmp_path))
    assert tok.vocab_size == 4 + 5  # <pad>, <|im_end|>, <img>, </img>, <IMG_CONTEXT> added
    ids = {tok.pad_id, tok.im_end_id, tok.img_start_id, tok.img_end_id, tok.img_context_id}
    assert ids == set(range(4, 9))
    assert (tok.bos_id, tok.eos_id, tok.im_start_id) == (0, 1, 2)


def test_template_matches_the_written_layout():
    conv = [{"from": "system", "value": "Be brief."},
            {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Seven."},
            {"from": "user", "value": "And <image> here?"}, {"from": "assistant", "value": "3"}]
    ids, labels = render_conversation(conv, TOK, image_tiles=[2, 1], tokens_per_tile=4)
    expected = ("<s><|im_start|>system\nBe brief.<|im_end|>\n"
                "<|im_start|>user\n<img>" + "<IMG_CONTEXT>" * 8 + "</img>\nWhat?<|im_end|>\n"
                "<|im_start|>assistant\nSeven.<|im_end|>\n"
                "<|im_start|>user\nAnd <img>" + "<IMG_CONTEXT>" * 4 + "</img> here?<|im_end|>\n"
                "<|im_start|>assistant\n3<|im_end|>\n")
    assert TOK.decode(ids) == expected
    assert len(ids) == len(labels) == len(TOK.encode(expected))


def _label_runs(ids, labels):
    """Token ids targeted by the labels, grouped into runs of consecutive target positions."""
    targets = np.flatnonzero(labels != -100) + 1
    runs, current = [], []
    for k, pos in enumerate(targets):
        if current and pos != targets[k - 1] + 1:
            runs.append(current)
            current = []
        current.append(pos)
    if current:
        runs.append(current)
    return [ids[np.array(r)] for r in runs]


@pytest.mark.parametrize("system", [None, "You are a helper."])
def test_labels_exactly_on_answers(system):
    answers = ["7", "yes, it is <s> even", "多语言 answer"]
    conv = [{"from": "human", "value": "<image>\n<image>\nSum?"}, {"from": "gpt", "value": answers[0]},
            {"from": "human", "value": "Even?"}, {"from": "gpt", "value": answers[1]},
            {"from": "human", "value": "Again <image>"}, {"from": "gpt", "value": answers[2]}]
    ids, labels = render_conversation(conv, TOK, image_tiles=[1, 5, 3], tokens_per_tile=16, system=system)
    assert labels[-1] == -100
    where = np.flatnonzero(labels != -100)
    assert np.array_equal(labels[where], ids[where + 1])  # shifted targets
    runs = _label_runs(ids, labels)
    assert [TOK.decode(r) for r in runs] == [a + "<|im_end|>" for a in answers]
    # image blocks carry tiles x tokens_per_tile context tokens each, in order
    starts, ends = np.flatnonzero(ids == TOK.img_start_id), np.flatnonzero(ids == TOK.img_end_id)
    assert [int((ids[s:e] == TOK.img_context_id).sum()) for s, e in zip(starts, ends)] == [16, 80, 48]


def test_single_image_without_placeholder_gets_one():
    turns = parse_conversations([{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}])
    fixed = add_missing_placeholder(turns, 1)
    assert fixed[0].text == "<image>\nQ"
    assert add_missing_placeholder(turns, 2) == turns and add_missing_placeholder(turns, 0) == turns


@pytest.mark.parametrize("conv, match", [
    ([{"from": "gpt", "value": "A"}], "expected user"),
    ([{"from": "human", "value": "Q"}], "no answer"),
    ([{"from": "human", "value": "Q"}, {"from": "human", "value": "Q"}], "alternate"),
    ([{"from": "human", "value": "Q <img>"}, {"from": "gpt", "value": "A"}], "reserved"),
    ([{"from": "robot", "value": "Q"}], "robot"),
    ([], "non-empty"),
])
def test_bad_conversations(conv, match):
    with pytest.raises(ConversationError, match=match):
        parse_conversations(conv)


def test_truncation_never_splits_an_image_block():
    conv = [{"from": "human", "value": "<image> a <image> b"}, {"from": "gpt", "value": "answer"},
            {"from": "human", "value": "c <image>"}, {"from": "gpt", "value": "more"}]
    turns = parse_conversations(conv)
    plan = plan_conversation(turns, TOK, [2, 1, 3], tokens_per_tile=4)
    full_ids, _ = plan.materialize()
    blocks = list(zip(np.flatnonzero(full_ids == TOK.img_start_id), np.flatnonzero(full_ids == TOK.img_end_id) + 1))
    assert [tuple(map(int, b)) for b in blocks] == plan.image_spans
    for max_len in range(1, plan.length + 3):
        cut, kept = plan.cut_for(max_len)
        # brute force: the longest prefix <= max_len whose end is not strictly inside a block
        brute = max(c for c in range(0, min(max_len, plan.length) + 1) if not any(s < c < e for s, e in blocks))
        assert cut == brute
        assert kept == sum(e <= cut for s, e in blocks)
        ids, labels = plan.materialize(cut)
        assert len(ids) == cut and labels[-1] == -100 if cut else True
        assert int((ids == TOK.img_context_id).sum()) == 4 * sum([2, 1, 3][:kept])
