"""Prompts for on-policy distillation: records from JSON Lines or Parquet, and each tokenizer's
ids of a prompt (its own chat template when it has one).

A record holds ``prompt`` (text) or ``messages`` (a chat: ``[{"role", "content"}, ...]``), and
optionally ``answer`` (a reference response: off-policy batches train on it, rewards compare with
it) and ``tests`` (Python code that checks a response, for code rewards). The field names are
configurable. Errors name the file, the record and the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: ``text`` or ``messages``, and the optional reference ``answer`` / ``tests``."""

    index: int
    where: str  # file:line (JSON Lines) or file#row (Parquet), for messages
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    answer: str | None = None
    tests: str | None = None

    def conversation(self) -> list[dict]:
        """The prompt as a chat (a plain prompt is one user turn)."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.text}]


@dataclass(frozen=True)
class PromptFields:
    """Which fields of a record hold what."""

    prompt: str = "prompt"
    messages: str = "messages"
    answer: str = "answer"
    tests: str = "tests"


def _record(value: dict, index: int, where: str, fields: PromptFields) -> PromptRecord:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a prompt record must be an object, got {type(value).__name__}")
    text, messages = value.get(fields.prompt), value.get(fields.messages)
    if (text is None) == (messages is None):
        raise ValueError(f"{where}: a prompt record needs exactly one of the fields "
                         f"{fields.prompt!r} (text) and {fields.messages!r} (a chat)")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: field {fields.prompt!r} must be a string")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"{where}: field {fields.messages!r} must be a non-empty list of "
                             f"{{'role': str, 'content': str}} turns")
        messages = tuple(dict(m) for m in messages)
    out = {}
    for key, name in (("answer", fields.answer), ("tests", fields.tests)):
        item = value.get(name)
        if item is not None and not isinstance(item, str):
            raise ValueError(f"{where}: field {name!r} must be a string")
        out[key] = item
    return PromptRecord(index, where, text, messages, **out)


def read_prompts(path: str, fields: PromptFields = PromptFields()) -> list[PromptRecord]:
    """Every prompt record of a ``.jsonl`` / ``.json`` / ``.parquet`` file, in order."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        wanted = [f for f in (fields.prompt, fields.messages, fields.answer, fields.tests)
                  if f in names]
        if fields.prompt not in names and fields.messages not in names:
            raise ValueError(f"{path}: no column {fields.prompt!r} or {fields.messages!r} "
                             f"(columns: {names})")
        rows = pq.read_table(path, columns=wanted).to_pylist()
        records = [_record({k: v for k, v in row.items() if v is not None}, i, f"{path}#{i}",
                           fields) for i, row in enumerate(rows)]
    elif path.endswith((".jsonl", ".json", ".ndjson")):
        records = []
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
                records.append(_record(value, len(records), where, fields))
    else:
        raise ValueError(f"{path}: prompts are read from .jsonl or .parquet files")
    if not records:
        raise ValueError(f"{path}: no prompt records")
    return records


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer: Any, record: PromptRecord, chat_template: bool = True) -> list[int]:
    """``tokenizer``'s ids of the prompt, ready for the response to follow: its own chat template
    with the generation prompt when it has one (and ``chat_template``), else the prompt text
    (a chat's turns joined by blank lines) with the tokenizer's own special tokens (BOS)."""
    if chat_template and has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template(record.conversation(), add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = record.text if record.messages is None else "\n\n".join(
        m["content"] for m in record.messages)
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


def response_ids(tokenizer: Any, text: str, eos: int | None) -> list[int]:
    """``tokenizer``'s ids of a response text (no BOS), ended by ``eos`` when given."""
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return ids + ([eos] if eos is not None else [])


def check_answers(records: Sequence[PromptRecord], what: str) -> None:
    """Every record has a reference answer (``what`` says what needs them)."""
    missing = [r.where for r in records if r.answer is None]
    if missing:
        raise ValueError(f"{what} needs a reference answer in every prompt record; "
                         f"{len(missing)} have none, first {missing[0]}")
