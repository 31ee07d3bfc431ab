"""Text documents from JSONL, Parquet, Arrow and plain-text files, blended by weight.

``--data-path`` follows Megatron-LM: either paths (``a.jsonl b.parquet``: all documents of all
files) or weight/path pairs (``0.7 a.jsonl 0.3 b.parquet``: documents drawn in that proportion).
Without weights a path may also be a glob (``shards/*.parquet``) or a Hugging Face ``datasets``
folder written by ``save_to_disk`` (its Arrow files; a DatasetDict folder names its splits). A
path may also be the prefix of a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``),
decoded back to text with the tokenizer that made it (:mod:`.indexed`).
Every reader names the file, the record and the field when the input is not what it should be.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_xdistill.data.indexed import indexed_files, is_indexed_prefix, read_indexed_documents

SUFFIXES = {
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
    ".txt": "text", ".md": "text", ".py": "text",
}


#: characters that make a --data-path item a glob (when no file has that name)
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class DataSource:
    """One input file and its blending weight (None: weight by document count)."""

    path: str
    weight: float | None = None


def parse_data_path(items: Sequence[str], flag: str = "--data-path") -> list[DataSource]:
    """Parse Megatron-style ``[w1] p1 [w2] p2 ...`` into sources; weights are all or none."""
    items = list(items)
    if not items:
        raise ValueError(f"{flag}: no files given")

    def _is_number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return not os.path.exists(text)

    if _is_number(items[0]):
        if len(items) % 2:
            raise ValueError(f"{flag}: expected weight/path pairs, got an odd count: {items}")
        sources = []
        for weight, path in zip(items[0::2], items[1::2]):
            if not _is_number(weight):
                raise ValueError(f"{flag}: expected a weight before {path!r}, got {weight!r}")
            if float(weight) <= 0:
                raise ValueError(f"{flag}: weight of {path!r} must be > 0, got {weight}")
            if _GLOB_CHARS.intersection(path) and not Path(path).exists() or Path(path).is_dir():
                raise ValueError(f"{flag}: {path} is a glob or a folder; those are read "
                                 f"without weights only (give one file per weight)")
            sources.append(DataSource(path, float(weight)))
    else:
        for item in items:
            if _is_number(item):
                raise ValueError(f"{flag}: give weights for every file or for none ({items})")
        sources = [DataSource(path) for item in items for path in expand_path(item, flag)]
    for source in sources:
        if is_indexed_prefix(source.path):
            continue
        if not Path(source.path).is_file():
            raise FileNotFoundError(f"{flag}: no such file: {source.path}")
        if Path(source.path).suffix.lower() not in SUFFIXES:
            raise ValueError(
                f"{flag}: cannot tell the format of {source.path}; expected one of "
                f"{sorted(SUFFIXES)}"
            )
    return sources


def _check_text(value: object, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _jsonl_documents(path: str):
    """(line number, line) of each document of a JSON Lines file, in order: its non-blank
    lines (the one rule that numbers documents, for whole and partial reads alike)."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 ({exc.reason} at byte {exc.start} of the "
                    f"line, {raw[max(exc.start - 8, 0): exc.start + 8]!r}); JSON Lines files "
                    f"must be UTF-8: re-encode the file") from None
            if line.strip():
                yield lineno, line


def _jsonl_text(line: str, where: str, field: str) -> str:
    """The text of one JSON Lines record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or field not in record:
        raise ValueError(
            f"{where}: no field {field!r} (use --text-field to name the field that holds the "
            f"text)"
        )
    return _check_text(record[field], where, field)


def _read_jsonl(path: str, field: str) -> list[str]:
    return [_jsonl_text(line, f"{path}:{lineno}", field)
            for lineno, line in _jsonl_documents(path)]


def _check_column(path: str, field: str, names: Sequence[str]) -> None:
    if field not in names:
        raise ValueError(f"{path}: no column {field!r} (columns: {list(names)}); use --text-field")


def _texts(path: str, field: str, column) -> list[str]:
    """The strings of an Arrow text column (a null is an empty document)."""
    _check_string_type(path, field, column.type)
    return [value if value is not None else "" for value in column.to_pylist()]


def _read_table(path: str, field: str, kind: str) -> list[str]:
    import pyarrow as pa

    if kind == "parquet":
        import pyarrow.parquet as pq

        _check_column(path, field, pq.read_schema(path).names)
        table = pq.read_table(path, columns=[field])  # the text only: no other column is read
    else:
        import pyarrow.ipc as ipc

        with pa.memory_map(path) as source:
            try:
                table = ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = ipc.open_stream(source).read_all()  # Hugging Face datasets' .arrow
    _check_column(path, field, table.column_names)
    return _texts(path, field, table.column(field))


def expand_path(item: str, flag: str = "--data-path") -> list[str]:
    """The files one unweighted ``--data-path`` item stands for: itself, the sorted matches of a
    glob, or the Arrow files of a Hugging Face ``datasets`` folder (``save_to_disk``)."""
    path = Path(item)
    if path.is_dir():
        state = path / "state.json"
        if state.is_file():
            files = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
            if not files:
                raise ValueError(f"{flag}: {state} lists no data files")
            return [str(path / name) for name in files]
        splits = path / "dataset_dict.json"
        if splits.is_file():
            names = json.loads(splits.read_text()).get("splits", [])
            raise ValueError(f"{flag}: {item} is a DatasetDict with splits {names}; pass one "
                             f"split's folder, e.g. {path / (names[0] if names else 'train')}")
        raise ValueError(f"{flag}: {item} is a folder but not a Hugging Face datasets folder "
                         f"(no state.json); pass its files or a glob such as {path / '*.jsonl'}")
    if _GLOB_CHARS.intersection(item) and not path.exists():
        matches = sorted(p for p in glob.glob(item) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"{flag}: no file matches {item}")
        return matches
    return [item]


def read_documents(path: str, text_field: str = "text",
                   data_tokenizer: str | None = None) -> list[str]:
    """All documents of one file. Plain-text files are one document each; a Megatron indexed
    dataset's prefix is decoded with ``data_tokenizer`` (the tokenizer that made it)."""
    if is_indexed_prefix(path):
        return read_indexed_documents(path, data_tokenizer)
    kind = SUFFIXES.get(Path(path).suffix.lower())
    if kind == "jsonl":
        return _read_jsonl(path, text_field)
    if kind in ("parquet", "arrow"):
        return _read_table(path, text_field, kind)
    if kind == "text":
        try:
            return [Path(path).read_text(encoding="utf-8")]
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    raise ValueError(f"{path}: unsupported file type; expected one of {sorted(SUFFIXES)}")


#: Records (JSON Lines) or bytes (plain text) a first read of each file checks.
FIRST_RECORDS = 16
FIRST_BYTES = 1 << 16


def check_first_records(path: str, text_field: str = "text") -> None:
    """The first records of one file as its full read would see them, so that a wrong
    ``--text-field``, a file that is no JSON Lines or not UTF-8 at its start is refused in a
    moment before a run reads its corpus (a fault further in is found by that read, named the
    same way). Columns of Parquet / Arrow files are read from their schema only; Megatron
    indexed datasets are checked when decoded."""
    if is_indexed_prefix(path):
        return
    kind = SUFFIXES.get(Path(path).suffix.lower())
    if kind == "jsonl":
        for count, (lineno, line) in enumerate(_jsonl_documents(path)):
            _jsonl_text(line, f"{path}:{lineno}", text_field)
            if count + 1 >= FIRST_RECORDS:
                break
    elif kind == "parquet":
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        _check_column(path, text_field, schema.names)
        _check_string_type(path, text_field, schema.field(text_field).type)
    elif kind == "text":
        import codecs

        with open(path, "rb") as fh:
            head = fh.read(FIRST_BYTES)
        try:  # a character cut at the end of the piece is not an error
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") \
                from None


def _check_string_type(path: str, field: str, kind) -> None:
    import pyarrow as pa

    if not pa.types.is_string(kind) and not pa.types.is_large_string(kind):
        raise ValueError(f"{path}: column {field!r} must hold strings, got {kind}")


def read_documents_at(path: str, indices: Sequence[int], text_field: str = "text",
                      data_tokenizer: str | None = None) -> list[str]:
    """Documents ``indices`` (ascending, numbered as :func:`read_documents` numbers them) of one
    file, reading no more than that needs: a JSON Lines file is scanned but only those records
    are parsed; Parquet reads the text column of the row groups that hold them; Arrow is
    memory-mapped; an indexed dataset decodes only them."""
    want = [int(i) for i in indices]
    if not want:
        return []
    if any(b <= a for a, b in zip(want, want[1:])):
        raise ValueError(f"{path}: document indices must ascend without repeats")
    if is_indexed_prefix(path):
        return read_indexed_documents(path, data_tokenizer, only=want)
    kind = SUFFIXES.get(Path(path).suffix.lower())
    if kind == "jsonl":
        return _read_jsonl_at(path, text_field, want)
    if kind == "parquet":
        return _read_parquet_at(path, text_field, want)
    docs = read_documents(path, text_field, data_tokenizer)  # Arrow (memory-mapped) and text
    if want[-1] >= len(docs):
        raise IndexError(f"{path} holds {len(docs)} documents, not {want[-1] + 1}")
    return [docs[i] for i in want]


def _read_jsonl_at(path: str, field: str, want: list[int]) -> list[str]:
    out, count = [], 0
    for count, (lineno, line) in enumerate(_jsonl_documents(path), 1):
        if count - 1 == want[len(out)]:
            out.append(_jsonl_text(line, f"{path}:{lineno}", field))
            if len(out) == len(want):
                return out
    raise IndexError(f"{path} holds {count} documents, not {want[-1] + 1}")


def _read_parquet_at(path: str, field: str, want: list[int]) -> list[str]:
    import numpy as np
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    _check_column(path, field, pf.schema_arrow.names)
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    if want[-1] >= starts[-1]:
        raise IndexError(f"{path} holds {int(starts[-1])} documents, not {want[-1] + 1}")
    idx = np.asarray(want)
    groups = np.searchsorted(starts, idx, side="right") - 1
    out: list[str] = []
    for g in np.unique(groups):
        rows = idx[groups == g] - starts[g]
        out.extend(_texts(path, field,
                          pf.read_row_group(int(g), columns=[field]).column(field).take(rows)))
    return out


def source_size(path: str) -> int:
    """Bytes of a source: its file, or both files of a Megatron indexed dataset's prefix."""
    files = indexed_files(path) if is_indexed_prefix(path) else [path]
    return sum(os.path.getsize(f) for f in files)


def source_fingerprint(sources: Sequence[DataSource]) -> list[list]:
    """What identifies the inputs for caching: path, size, mtime and weight of each file."""
    out = []
    for source in sources:
        files = indexed_files(source.path) if is_indexed_prefix(source.path) else [source.path]
        for path in files:
            stat = os.stat(path)
            out.append([os.path.abspath(path), stat.st_size, int(stat.st_mtime), source.weight])
    return out
