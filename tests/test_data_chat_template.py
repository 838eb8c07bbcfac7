"""A Hugging Face tokenizer's own chat template renders the conversations; labels stay on the answers."""
import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from megatron.vlm.data import HFTokenizer, render_conversation  # noqa: E402
from megatron.vlm.data.template import chat_template_name  # noqa: E402

SPECIALS = ["<pad>", "<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]
WORDS = ["assistant", "user", "system", "Seven"]  # multi-character tokens, so offsets matter
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
# ChatML with a BOS and a default system message (as InternVL's templates have)
TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n"
            "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONV = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Seven."},
        {"from": "human", "value": "And twice?"}, {"from": "gpt", "value": "14, user"}]


def write_tokenizer(folder, template):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(WORDS) + "|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>",
              "bos_token": "<s>", "eos_token": "<|im_end|>", "extra_special_tokens": {}}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer(str(folder))


def answer_runs(ids, labels):
    """Decoded runs of consecutive labelled target tokens."""
    targets = np.flatnonzero(labels != -100) + 1
    runs = np.split(targets, np.flatnonzero(np.diff(targets) != 1) + 1)
    return [r for r in runs if len(r)]


def expand(text, tiles, tokens_per_tile):
    for t in tiles:
        text = text.replace("<image>", "<img>" + "<IMG_CONTEXT>" * (t * tokens_per_tile) + "</img>", 1)
    return text


@pytest.mark.parametrize("system", [None, "Be brief."])
@pytest.mark.parametrize("offsets", [True, False])
def test_own_template_renders_and_labels_answers(tmp_path, monkeypatch, system, offsets):
    tok = write_tokenizer(tmp_path / "tok", TEMPLATE)
    assert tok.chat_template == TEMPLATE and "own chat template" in chat_template_name(tok)
    if not offsets:  # a tokenizer without offsets: the text is cut at the answer boundaries instead
        monkeypatch.setattr(tok, "encode_with_offsets", lambda text: None)
    ids, labels = render_conversation(CONV, tok, image_tiles=[2], tokens_per_tile=3, system=system)
    messages = [{"role": "user", "content": CONV[0]["value"]}, {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "And twice?"}, {"role": "assistant", "content": "14, user"}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    rendered = tok._tok.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith("<s><|im_start|>system\n" + (system or "Default."))
    expected = expand(rendered, [2], 3)
    assert tok.decode(ids) == expected
    assert ids.tolist() == tok._tok.encode(expected, add_special_tokens=False)
    assert int((ids == tok.img_context_id).sum()) == 6 and tok.encode("Seven") != tok.encode("S")
    where = np.flatnonzero(labels != -100)
    assert labels[-1] == -100 and np.array_equal(labels[where], ids[where + 1])
    runs = answer_runs(ids, labels)
    assert [tok.decode(ids[r]) for r in runs] == ["Seven.<|im_end|>", "14, user<|im_end|>"]


def test_without_template_the_builtin_one_is_used(tmp_path):
    tok = write_tokenizer(tmp_path / "tok", None)
    assert tok.chat_template is None and "built-in" in chat_template_name(tok)
    ids, labels = render_conversation(CONV, tok, image_tiles=[1], tokens_per_tile=2)
    assert tok.decode(ids) == expand("<s><|im_start|>user\n<image>\nWhat is it?<|im_end|>\n"
                                     "<|im_start|>assistant\nSeven.<|im_end|>\n<|im_start|>user\nAnd twice?<|im_end|>\n"
                                     "<|im_start|>assistant\n14, user<|im_end|>\n", [1], 2)
    assert [tok.decode(ids[r]) for r in answer_runs(ids, labels)] == ["Seven.<|im_end|>", "14, user<|im_end|>"]


def test_a_template_that_refuses_a_record_names_it(tmp_path):
    """A conversation the tokenizer's template cannot render turn by turn is a data problem named file:line by the
    scan (not an error that stops one process of a split scan while the others wait)."""
    from PIL import Image

    from megatron.vlm.data import DataValidationError, RecordDataset, TileImages

    # renders the last assistant turn differently from the same turn inside a longer prefix
    odd = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
           "{% if loop.last %}!{% endif %}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = write_tokenizer(tmp_path / "tok", odd)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    ann = tmp_path / "ann.jsonl"
    ann.write_text(json.dumps({"image": "a.png", "conversations": CONV}) + "\n")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"s": {"root": str(tmp_path), "annotation": str(ann)}}))
    with pytest.raises(DataValidationError, match=f"{ann}:1: the tokenizer's chat template does not render"):
        RecordDataset(str(meta), tok, TileImages(8, 4, max_num_tiles=1))
