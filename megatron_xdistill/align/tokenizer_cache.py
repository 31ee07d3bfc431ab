"""Tokenizers loaded once per process.

A run reads its student's and teachers' tokenizers in several places (the data pipeline, the
projection's vocabulary check, the first-token heads); ``AutoTokenizer.from_pretrained`` of a
150k-token ``tokenizer.json`` spends ~0.7 s parsing JSON, and what is built on a tokenizer
object (its canonical byte table, its vocabulary hash) is kept on that object. A single-rank
run of the end-to-end tests' tiny models spent 3.3 of its 7.4 s loading the same two
tokenizers four times. Keyed by the directory, its files' sizes and modification times and the
loading options: a changed file loads afresh.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

#: tokenizers kept (the least recently used beyond this are dropped)
KEEP = 8

_LOADED: OrderedDict[tuple, Any] = OrderedDict()


def _state(path: Path) -> tuple:
    """(name, size, mtime) of each file of the directory: what a reload would read."""
    return tuple(sorted((f.name, st.st_size, st.st_mtime_ns)
                        for f in path.iterdir() if f.is_file() for st in (f.stat(),)))


def auto_tokenizer(path: str | Path, **options: Any) -> Any:
    """``AutoTokenizer.from_pretrained(path, **options)``, loaded once per process for the same
    directory contents and options (the same object is returned: callers do not change it)."""
    path = Path(path)
    key = (str(path.resolve()), _state(path), tuple(sorted(options.items())))
    tokenizer = _LOADED.get(key)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), **options)
        _LOADED[key] = tokenizer
        while len(_LOADED) > KEEP:
            _LOADED.popitem(last=False)
    else:
        _LOADED.move_to_end(key)
    return tokenizer


__all__ = ["auto_tokenizer"]
