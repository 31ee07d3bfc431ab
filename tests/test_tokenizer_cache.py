"""Tokenizers are loaded once per process (``align.tokenizer_cache``) and their vocabulary hash
taken once per object; a changed tokenizer directory, or a tokenizer that gains tokens, is
read or hashed afresh."""

from __future__ import annotations

import json
import shutil

from shared_assets import ASSETS, needs_shared_assets

from megatron_xdistill.align import load_tokenizer as align_load
from megatron_xdistill.projection.vocab import _vocab_hash, load_tokenizer, vocab_hash

pytestmark = needs_shared_assets


def test_a_directory_is_loaded_once_until_its_files_change(tmp_path):
    src = tmp_path / "tok"
    shutil.copytree(ASSETS / "tokenizers" / "smollm2", src)
    first = load_tokenizer(src)
    assert load_tokenizer(str(src)) is first  # the projection's loader, by path or str
    assert align_load(src) is align_load(src)  # the aligner's (its own options: local files)
    config = src / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["model_max_length"] = 1234
    config.write_text(json.dumps(data))
    again = load_tokenizer(src)
    assert again is not first and again.model_max_length == 1234
    assert len(again) == len(first)


def test_the_vocab_hash_is_taken_once_and_again_when_tokens_are_added(tmp_path):
    src = tmp_path / "tok"
    shutil.copytree(ASSETS / "tokenizers" / "smollm2", src)
    tok = load_tokenizer(src)
    digest = vocab_hash(tok)
    assert digest == _vocab_hash(tok) and vocab_hash(tok) == digest
    tok.add_tokens(["<a-token-no-vocabulary-has>"])
    assert vocab_hash(tok) == _vocab_hash(tok) != digest
