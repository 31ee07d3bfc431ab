"""Canonical token text: the bytes each token id stands for in the original text.

Byte-level BPE (GPT-2 / Llama-3 / Qwen) stores tokens in a printable byte alphabet (``Ġ`` = space,
``Ċ`` = newline, ...); SentencePiece-style vocabularies (Gemma, Llama-2 / Mistral) write a space as
``▁`` and fall back to ``<0xNN>`` byte tokens. Both are mapped back to raw bytes here so that token
strings of two different tokenizers can be compared. Special / control tokens (BOS, EOS, pad, unk,
chat markers) have no canonical text (``None``): they belong to no alignment chunk.

Tables are built once per tokenizer object and cached (a 262k vocabulary takes well under a second).
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TokenTable",
    "byte_level_alphabet",
    "is_special_token_id",
    "special_token_ids",
    "token_bytes_table",
    "token_table",
]

SP_SPACE = "\u2581"  # SentencePiece's "▁"
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[str, int]:
    """Map each printable character of the GPT-2 byte-level alphabet back to its byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars: dict[str, int] = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + n)] = b
            n += 1
    return chars


@dataclass(frozen=True)
class TokenTable:
    """Canonical bytes of every token id of one tokenizer, in list and flat (CSR) form.

    ``data[offsets[i]:offsets[i+1]]`` are the bytes of id ``i`` (empty for special ids, which
    ``special`` marks). ``prefix_space`` says the tokenizer puts a space in front of the first
    word that is not in the text (SentencePiece ``add_dummy_prefix`` / Metaspace ``prepend_scheme``,
    byte-level ``add_prefix_space``); ``kind`` is ``"byte_level"``, ``"sentencepiece"`` or ``"raw"``.
    """

    name: str
    kind: str
    prefix_space: bool
    table: list[bytes | None]
    data: np.ndarray  # uint8 [total bytes]
    offsets: np.ndarray  # int64 [V + 1]
    special: np.ndarray  # bool [V]
    unk_id: int  # the model's unknown token (it covers text); -1 if the model has none

    @property
    def vocab_size(self) -> int:
        """Number of ids covered (``len(tokenizer)`` or more if the model vocab is larger)."""
        return len(self.table)

    @property
    def lengths(self) -> np.ndarray:
        """Byte length of every token (0 for special tokens)."""
        return np.diff(self.offsets)

    def strips_prefix(self, text: str) -> bool:
        """Whether the first token of ``text`` carries a space the tokenizer added (not in text)."""
        return self.prefix_space and not text.startswith((" ", SP_SPACE))

    def token_bytes(self, token_id: int) -> bytes | None:
        """Canonical bytes of one id, ``None`` for special ids and ids outside the vocabulary."""
        if 0 <= token_id < len(self.table):
            return self.table[token_id]
        return None


_CACHE: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()
_CACHE_BY_ID: dict[int, tuple[Any, TokenTable]] = {}


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind an HF fast tokenizer (or the object itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None and hasattr(tokenizer, "get_added_tokens_decoder"):
        backend = tokenizer
    if backend is None:
        raise TypeError(
            f"expected a Hugging Face fast tokenizer (with .backend_tokenizer), got "
            f"{type(tokenizer).__name__}"
        )
    return backend


def _components(node: Any) -> list[dict]:
    """Flatten a (possibly nested ``Sequence``) normalizer / pre-tokenizer / decoder config."""
    if not node:
        return []
    out = [node]
    for key in ("normalizers", "pretokenizers", "decoders"):
        for child in node.get(key, []) or []:
            out.extend(_components(child))
    return out


def _detect(config: dict) -> tuple[str, bool]:
    """Tokenizer family ("byte_level", "sentencepiece", "raw") and whether it adds a prefix space."""
    norm = _components(config.get("normalizer"))
    pre = _components(config.get("pre_tokenizer"))
    dec = _components(config.get("decoder"))
    types = {c.get("type") for c in norm + pre + dec}
    if "ByteLevel" in types:
        prefix = any(c.get("type") == "ByteLevel" and c.get("add_prefix_space") for c in pre)
        return "byte_level", prefix
    replaces_space = any(
        c.get("type") == "Replace" and c.get("content") in (SP_SPACE, " ") for c in norm + dec
    )
    if "Metaspace" in types or replaces_space or "ByteFallback" in types:
        prefix = False
        for c in pre:
            if c.get("type") == "Metaspace":
                scheme = c.get("prepend_scheme")
                prefix = scheme in ("first", "always") if scheme else bool(c.get("add_prefix_space"))
        for c in norm:
            if c.get("type") == "Prepend" and c.get("prepend") == SP_SPACE:
                prefix = True
        return "sentencepiece", prefix
    return "raw", False


def _model_token_bytes(token: str, kind: str, alphabet: dict[str, int]) -> bytes:
    """Canonical bytes of a vocabulary (model) token string."""
    if kind == "byte_level":
        try:
            return bytes(alphabet[c] for c in token)
        except KeyError:  # not in the byte alphabet: the token is stored as raw text
            return token.encode("utf-8")
    if kind == "sentencepiece":
        m = _BYTE_FALLBACK.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace(SP_SPACE, " ").encode("utf-8")
    return token.encode("utf-8")


def _build(tokenizer: Any) -> TokenTable:
    backend = _backend(tokenizer)
    config = json.loads(backend.to_str())
    kind, prefix_space = _detect(config)
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    size = max(
        [len(tokenizer) if hasattr(tokenizer, "__len__") else 0, backend.get_vocab_size(True)]
        + [i + 1 for i in vocab.values()]
        + [i + 1 for i in added]
    )
    alphabet = byte_level_alphabet()
    table: list[bytes | None] = [None] * size
    for token, idx in vocab.items():
        table[idx] = _model_token_bytes(token, kind, alphabet)
    for idx, tok in added.items():
        # Added tokens are matched on the raw text, so their content is their text; special
        # ones (control tokens) have none.
        table[idx] = None if tok.special else tok.content.encode("utf-8")
    # Only the model's own unknown token can stand for text; an ``unk_token`` that exists just
    # in the HF config (e.g. SmolLM2's <|endoftext|>) is a control token like the others.
    unk_id = -1
    model_unk = config.get("model", {}).get("unk_token")
    if model_unk is not None and backend.token_to_id(model_unk) is not None:
        unk_id = int(backend.token_to_id(model_unk))
        table[unk_id] = None

    lengths = np.fromiter((0 if b is None else len(b) for b in table), np.int64, size)
    offsets = np.zeros(size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = np.frombuffer(b"".join(b for b in table if b is not None), np.uint8).copy()
    special = np.fromiter((b is None for b in table), np.bool_, size)
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    return TokenTable(name, kind, prefix_space, table, data, offsets, special, unk_id)


def token_table(tokenizer: Any) -> TokenTable:
    """Canonical byte table of ``tokenizer`` (built once per tokenizer object, then cached)."""
    try:
        hit = _CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable
        entry = _CACHE_BY_ID.get(id(tokenizer))
        hit = entry[1] if entry is not None and entry[0] is tokenizer else None
    if hit is not None:
        return hit
    table = _build(tokenizer)
    try:
        _CACHE[tokenizer] = table
    except TypeError:
        _CACHE_BY_ID[id(tokenizer)] = (tokenizer, table)
    return table


def token_bytes_table(tokenizer: Any) -> list[bytes | None]:
    """Bytes each token id stands for in text; index = token id, ``None`` for special tokens.

    Covers every id in ``range(len(tokenizer))`` (and the whole model vocabulary if larger).
    Byte-level markers (``Ġ``, ``Ċ``, ...) become their bytes, SentencePiece ``▁`` becomes
    ``b" "`` and ``<0xNN>`` becomes that byte; non-special added tokens give their text. The
    prefix space a SentencePiece tokenizer adds in front of the first word is *not* removed here
    (see ``TokenTable.prefix_space``). Cached per tokenizer.
    """
    return token_table(tokenizer).table


def ids_bytes(tokenizer: Any, ids) -> bytes:
    """The bytes a sequence of ids spells in text (special tokens and ids outside the vocabulary
    spell nothing; a leading SentencePiece space is kept)."""
    table = token_bytes_table(tokenizer)
    return b"".join(table[i] or b"" for i in ids if 0 <= i < len(table))


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids with no canonical text: control tokens (BOS/EOS/pad/...), special added tokens, unk."""
    return frozenset(np.flatnonzero(token_table(tokenizer).special).tolist())


def is_special_token_id(tokenizer: Any, token_id: int) -> bool:
    """True when ``token_id`` has no canonical text (special/control/unknown or out of range)."""
    tab = token_table(tokenizer)
    return not (0 <= token_id < tab.vocab_size) or bool(tab.special[token_id])
