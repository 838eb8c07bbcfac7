"""Tokenizers of the VLM data pipeline: a built-in byte-level one and a wrapper of a local Hugging Face one.

Both expose the same interface::

    encode(text) -> list[int]      special-token strings in ``text`` become their ids
    decode(ids) -> str
    vocab_size                      unpadded number of ids
    pad_id, bos_id, eos_id, im_start_id, im_end_id, img_start_id, img_end_id, img_context_id

Byte tokenizer ids: 0..255 are the UTF-8 bytes, then the special tokens in ``SPECIAL_TOKENS`` order
(``<pad>``=256, ``<s>``=257, ``</s>``=258, ``<|im_start|>``=259, ``<|im_end|>``=260, ``<img>``=261,
``</img>``=262, ``<IMG_CONTEXT>``=263), so ``vocab_size`` is 264.
"""
from __future__ import annotations

import os
import re

from omnibal_ext.errors import UserError

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT)

_NUM_BYTES = 256


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Rows of the embedding / output layer: ``vocab_size`` rounded up to a multiple of ``multiple * tp``.

    This is Megatron's rule (``--make-vocab-size-divisible-by`` times the tensor-parallel size): each
    tensor-parallel rank then holds ``padded / tp`` rows, itself a multiple of ``multiple``.
    Example: the byte tokenizer's 264 ids give 384 at tp=1 and 512 at tp=2.
    """
    if vocab_size < 1 or tp < 1 or multiple < 1:
        raise ValueError(f"padded_vocab_size: need vocab_size, tp, multiple >= 1, got {vocab_size}, {tp}, {multiple}")
    step = multiple * tp
    return -(-vocab_size // step) * step


class ByteTokenizer:
    """UTF-8 byte-level tokenizer with the chat and image special tokens appended after the 256 bytes."""

    def __init__(self) -> None:
        self._special_ids = {tok: _NUM_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._special_strs = {i: tok for tok, i in self._special_ids.items()}
        # Longest first so that no special token is matched by a prefix of another.
        alternatives = sorted(SPECIAL_TOKENS, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")
        self.vocab_size = _NUM_BYTES + len(SPECIAL_TOKENS)
        self.pad_id = self._special_ids[PAD]
        self.bos_id = self._special_ids[BOS]
        self.eos_id = self._special_ids[EOS]
        self.im_start_id = self._special_ids[IM_START]
        self.im_end_id = self._special_ids[IM_END]
        self.img_start_id = self._special_ids[IMG_START]
        self.img_end_id = self._special_ids[IMG_END]
        self.img_context_id = self._special_ids[IMG_CONTEXT]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if not part:
                continue
            special = self._special_ids.get(part)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < _NUM_BYTES:
                pending.append(i)
                continue
            special = self._special_strs.get(i)
            if special is None:
                raise ValueError(f"ByteTokenizer.decode: id {i} outside the vocabulary [0, {self.vocab_size})")
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            out.append(special)
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A local Hugging Face tokenizer directory behind the ByteTokenizer interface.

    Special tokens of ``SPECIAL_TOKENS`` (with the family's ``image_tokens`` for the image start, end and
    context ones) missing from its vocabulary are added (so ``vocab_size`` can grow;
    the model's padded vocabulary must be computed from this object's ``vocab_size``).  ``pad_id`` falls
    back to ``<pad>``, ``eos_id`` to ``<|im_end|>`` and ``bos_id`` may be ``None`` (no BOS is then
    prepended by the chat template).  Requires the ``hf`` extra (``pip install 'omnibal-megatron[hf]'``).
    """

    def __init__(self, path: str, trust_remote_code: bool = False,
                 image_tokens: tuple[str, str, str] = (IMG_START, IMG_END, IMG_CONTEXT)) -> None:
        try:
            from transformers import AutoTokenizer  # optional: the hf extra
        except ImportError as e:
            raise ImportError(
                f"--tokenizer {path!r} needs the Hugging Face `transformers` package, which is not installed; "
                "install the extra with: pip install 'omnibal-megatron[hf]' (or pip install -e '.[hf]' "
                "from the repository), or drop the flag to use the built-in byte tokenizer"
            ) from e
        if not os.path.isdir(path):
            raise UserError(f"--tokenizer-model {path!r}: not a local tokenizer directory")
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        vocab = tok.get_vocab()
        specials = (PAD, BOS, EOS, IM_START, IM_END, *image_tokens)
        missing = [t for t in specials if t not in vocab and t not in (PAD, BOS, EOS)]
        if tok.pad_token_id is None and PAD not in vocab:
            missing.insert(0, PAD)
        if missing:
            tok.add_tokens(missing, special_tokens=True)
        self._tok = tok
        self.path = path
        self.vocab_size = len(tok)
        ids = {t: tok.convert_tokens_to_ids(t) for t in specials if t in tok.get_vocab()}
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else ids[PAD]
        self.bos_id = tok.bos_token_id
        self.im_start_id = ids[IM_START]
        self.im_end_id = ids[IM_END]
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else self.im_end_id
        self.img_start_id, self.img_end_id, self.img_context_id = (ids[t] for t in image_tokens)
        # the tokenizer's own Jinja chat template (tokenizer_config.json / chat_template.jinja), if any:
        # plan_conversation then renders conversations with it instead of the built-in template
        self.chat_template = getattr(tok, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """``messages`` (``role``/``content`` dicts) rendered as text by the tokenizer's own chat template."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_with_offsets(self, text: str):
        """``(ids, [(start, end) character span per id])``, or ``None`` for a tokenizer without offsets."""
        if not getattr(self._tok, "is_fast", False):
            return None
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def build_tokenizer(path: str | None = None, trust_remote_code: bool = False,
                    image_tokens: tuple[str, str, str] = (IMG_START, IMG_END, IMG_CONTEXT)):
    """The byte tokenizer when ``path`` is None or empty, else ``HFTokenizer(path)``.  image_tokens: the model
    family's image start, end and context token strings (``FamilyRuntime.data``; the byte tokenizer has
    the defaults', which serve any family trained from scratch)."""
    if not path:
        return ByteTokenizer()
    return HFTokenizer(path, trust_remote_code=trust_remote_code, image_tokens=image_tokens)
