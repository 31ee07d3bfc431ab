"""Special-token builder: BOS/EOS/pad/unk and chat markers matched by role and name.

Special tokens have no canonical text, so the text builders leave their rows empty. This builder
maps a student special token to one teacher special token, trying in order:

1. a teacher special token with the identical string (``<|endoftext|>`` in both);
2. the same *class*: a name table groups known spellings (``<|im_end|>``, ``<end_of_turn>``,
   ``<|eot_id|>`` are all "turn_end"; ``</s>``, ``<eos>``, ``<|end_of_text|>`` are "eos"), and a
   token also belongs to the classes of the roles its tokenizer declares for it (``eos_token`` ->
   "eos", ...); among teacher tokens sharing a class, one whose name class equals the student
   token's name class wins, then one sharing any class by name, then by role, then the most
   similar name (``difflib`` ratio), then the lowest id;
3. otherwise the most similar teacher special name, if its ratio is >= ``min_similarity``.

Reserved/unused placeholder tokens (``<|reserved_special_token_3|>``, ``<unused7>``) are skipped.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

_CLASSES: dict[str, tuple[str, ...]] = {
    "bos": ("bos", "s", "begin_of_text", "startoftext", "start_of_text", "begin_of_sentence"),
    "eos": ("eos", "/s", "end_of_text", "endoftext", "end_of_sentence"),
    "pad": ("pad", "padding", "finetune_right_pad_id", "pad_token"),
    "unk": ("unk", "unknown"),
    "mask": ("mask",),
    "turn_start": ("im_start", "start_of_turn", "start_header_id", "begin_of_turn"),
    "turn_end": ("im_end", "end_of_turn", "eot_id", "eot", "end_of_message"),
    "header_end": ("end_header_id",),
    "fim_prefix": ("fim_prefix",),
    "fim_middle": ("fim_middle",),
    "fim_suffix": ("fim_suffix",),
    "fim_pad": ("fim_pad",),
    "tool_call": ("tool_call",),
    "tool_call_end": ("/tool_call",),
}
_NAME_CLASS = {name: cls for cls, names in _CLASSES.items() for name in names}
_ROLES = ("bos", "eos", "pad", "unk", "mask")
_PLACEHOLDER = re.compile(r"reserved|unused", re.IGNORECASE)


def normalize_name(token: str) -> str:
    """``<|im_start|>`` -> ``im_start``; ``</s>`` -> ``/s``; lower case, '-' as '_'."""
    name = token.strip().lower().replace("-", "_")
    name = re.sub(r"^[<\[]+\|?", "", name)
    name = re.sub(r"\|?[>\]]+$", "", name)
    return name.strip("|").strip("\u2581 ")


def _roles(tokenizer: Any) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for role in _ROLES:
        tid = getattr(tokenizer, f"{role}_token_id", None)
        if isinstance(tid, int):
            out.setdefault(tid, set()).add(role)
    return out


class _Side:
    """Special tokens of one tokenizer: id -> string, normalised name, class."""

    def __init__(self, tokenizer: Any, table: Sequence[bytes | None]) -> None:
        ids = [i for i, b in enumerate(table) if b is None]
        strings = tokenizer.convert_ids_to_tokens(ids)
        roles = _roles(tokenizer)
        self.tokens: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.name_classes: dict[int, set[str]] = {}
        self.role_classes: dict[int, set[str]] = {}
        for i, s in zip(ids, strings):
            if s is None or _PLACEHOLDER.search(s):
                continue
            name = normalize_name(s)
            self.tokens[i], self.names[i] = s, name
            self.name_classes[i] = {_NAME_CLASS[name]} if name in _NAME_CLASS else set()
            self.role_classes[i] = roles.get(i, set())
        self.by_string: dict[str, int] = {}
        for i, s in self.tokens.items():
            self.by_string.setdefault(s, i)

    def classes(self, i: int) -> set[str]:
        """Classes of token i by name and by the tokenizer's declared roles."""
        return self.name_classes[i] | self.role_classes[i]


def special_token_map(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    student_table: Sequence[bytes | None],
    teacher_table: Sequence[bytes | None],
    min_similarity: float = 0.85,
) -> dict[int, int]:
    """Map student special ids to teacher special ids (unmatched ones are left out)."""
    student = _Side(student_tokenizer, student_table)
    teacher = _Side(teacher_tokenizer, teacher_table)
    out: dict[int, int] = {}
    for s, string in student.tokens.items():
        if string in teacher.by_string:
            out[s] = teacher.by_string[string]
            continue
        name, wanted = student.names[s], student.classes(s)
        candidates = [t for t in teacher.tokens if teacher.classes(t) & wanted]
        if candidates:
            # A class shared by name beats one shared only through a declared role.
            out[s] = max(
                candidates,
                key=lambda t: (
                    bool(teacher.name_classes[t] & student.name_classes[s]),
                    bool(teacher.name_classes[t] & wanted),
                    bool(teacher.role_classes[t] & wanted),
                    _similarity(name, teacher.names[t]),
                    -t,
                ),
            )
            continue
        if teacher.names:
            t, ratio = _most_similar(name, list(teacher.names), teacher.names)
            if ratio >= min_similarity:
                out[s] = t
    return out


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _most_similar(name: str, candidates: list[int], names: dict[int, str]) -> tuple[int, float]:
    best = max(candidates, key=lambda t: (_similarity(name, names[t]), -t))
    return best, _similarity(name, names[best])
