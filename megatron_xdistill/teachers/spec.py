"""Which teachers a run distils from: one from the ``--teacher-*`` flags, or several from a YAML
file (``--teachers-config teachers.yaml``).

Each teacher is a full teacher side: its checkpoint, tokenizer, layout (TP/CP/PP), projection,
loss mode, payload form, temperature and weight. A key a teacher's entry leaves out takes the
run's flag of the same concept, so settings shared by all teachers are written once::

    teachers:
      - name: qwen
        load: /ckpt/qwen2.5-coder-0.5b
        tokenizer_model: /tok/qwen2.5
        tensor_model_parallel_size: 2
        weight: 0.7
      - name: llama3b               # shares the student's tokenizer: token-level KL, no projection
        load: /ckpt/llama-3.2-3b
        tokenizer_model: /tok/llama-3.2
        kd_loss: pkl
        kd_topk: 128
        weight: 0.3
    combination: sum                # or select (one teacher per sample: the lowest CE on its text)

With ``--teacher-placement disaggregated`` each teacher also takes ``ranks`` (default
``--teacher-ranks``): its own ranks, after the student's, in the order listed.

Downstream code sees each teacher as an ``argparse.Namespace`` in the single-teacher flag names
(:meth:`TeacherSpec.view`), so the teacher side and the loss glue serve one or many alike.
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass, replace

COMBINATIONS = ("sum", "select")

# Payload sizes, each of one loss family; unset (None) until a teacher's loss is known, so a size
# given for another loss is an error rather than ignored (see :func:`with_payload_defaults`).
PKL_PAYLOAD_DEFAULTS = {"kd_topk": 64, "kd_topk_mode": "chunk"}
GOLD_PAYLOAD_DEFAULTS = {"kd_gold_topk": 64, "kd_gold_uncommon_topk": 256}
_PAYLOAD_FLAG = {"kd_topk": "--kd-topk", "kd_topk_mode": "--kd-topk-mode",
                 "kd_gold_topk": "--kd-gold-topk",
                 "kd_gold_uncommon_topk": "--kd-gold-uncommon-topk"}

# YAML key -> the run's flag (its argparse dest) it defaults to and stands for in a teacher's view.
_FLAG_OF = {
    "load": "teacher_load",
    "tokenizer_model": "teacher_tokenizer_model",
    "projection_path": "projection_path",
    "tensor_model_parallel_size": "teacher_tensor_model_parallel_size",
    "pipeline_model_parallel_size": "teacher_pipeline_model_parallel_size",
    "context_parallel_size": "teacher_context_parallel_size",
    "expert_model_parallel_size": "teacher_expert_model_parallel_size",
    "sequence_parallel": "teacher_sequence_parallel",
    "seq_length": "teacher_seq_length",
    "kd_loss": "kd_loss",
    "kd_topk": "kd_topk",
    "kd_topk_mode": "kd_topk_mode",
    "kd_gold_topk": "kd_gold_topk",
    "kd_gold_uncommon_topk": "kd_gold_uncommon_topk",
    "kd_temperature": "kd_temperature",
    "kd_reverse": "kd_reverse",
    "gkd_beta": "gkd_beta",
    "kd_skip_student_split_chunks": "kd_skip_student_split_chunks",
    "kd_first_token": "kd_first_token",
    "weight": "kd_weight",
    "ranks": "teacher_ranks",
    "cache": "teacher_cache",
}
_TYPES = {"load": str, "tokenizer_model": str, "projection_path": str,
          "tensor_model_parallel_size": int, "pipeline_model_parallel_size": int,
          "context_parallel_size": int, "expert_model_parallel_size": int,
          "sequence_parallel": bool, "seq_length": int,
          "kd_loss": str, "kd_topk": int, "kd_topk_mode": str, "kd_gold_topk": int,
          "kd_gold_uncommon_topk": int, "kd_temperature": float,
          "kd_reverse": bool, "gkd_beta": float, "kd_skip_student_split_chunks": bool,
          "kd_first_token": bool, "weight": float, "ranks": int, "cache": str}


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher of the run, in the run's flag vocabulary (see ``_FLAG_OF``)."""

    name: str
    load: str | None
    tokenizer_model: str
    projection_path: str | None
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool
    seq_length: int | None  # None: derived from the data
    kd_loss: str
    kd_topk: int
    kd_topk_mode: str
    kd_gold_topk: int  # compact gold / H-KL: common pairs shipped (0: all)
    kd_gold_uncommon_topk: int  # and sorted uncommon probabilities (0: all)
    kd_temperature: float
    kd_reverse: bool
    gkd_beta: float | None  # GKD's generalized JSD (None: forward or, with kd_reverse, reverse KL)
    kd_skip_student_split_chunks: bool  # count no chunk the student spells in more tokens
    kd_first_token: bool  # next-token KL at chunk starts, teacher mass moved to first pieces
    weight: float
    ranks: int | None = None  # disaggregated: how many ranks serve this teacher
    cache: str | None = None  # its teacher payload cache directory
    expert_model_parallel_size: int = 1  # EP of a mixture-of-experts teacher

    def view(self, args: argparse.Namespace) -> argparse.Namespace:
        """The run's arguments as this teacher sees them: a copy with this teacher's values in
        the single-teacher flags (``teacher_load``, ``kd_topk``, ``kd_weight`` ...)."""
        out = copy.copy(args)
        for key, dest in _FLAG_OF.items():
            setattr(out, dest, getattr(self, key))
        out.teacher_name = self.name
        return out

    def with_seq_length(self, seq_length: int) -> TeacherSpec:
        return replace(self, seq_length=seq_length)


def _from_flags(args: argparse.Namespace, name: str, entry: dict,
                where: str | None = None) -> TeacherSpec:
    values = {key: entry.get(key, getattr(args, dest)) for key, dest in _FLAG_OF.items()}
    return with_payload_defaults(TeacherSpec(name=name, **values), where)


def with_payload_defaults(spec: TeacherSpec, where: str | None = None) -> TeacherSpec:
    """``spec`` with the payload sizes filled in from their defaults. A size of the other
    loss family (``--kd-topk`` / ``--kd-topk-mode`` are P-KL's, ``--kd-gold-topk`` /
    ``--kd-gold-uncommon-topk`` gold's and H-KL's) is an error naming it: with gold as the
    default loss, ``--kd-topk 128`` alone would otherwise be dropped without a word."""
    pkl = spec.kd_loss == "pkl"
    own, other = ((PKL_PAYLOAD_DEFAULTS, GOLD_PAYLOAD_DEFAULTS) if pkl
                  else (GOLD_PAYLOAD_DEFAULTS, PKL_PAYLOAD_DEFAULTS))
    stray = [key for key in other if getattr(spec, key) is not None]
    if stray:
        names = ", ".join(key if where else _PAYLOAD_FLAG[key] for key in stray)
        family, fix = (("gold / H-KL", "--kd-loss gold (or hkl)") if pkl
                       else ("P-KL", "--kd-loss pkl"))
        raise ValueError(f"{where + ': ' if where else ''}{names} "
                         f"{'is' if len(stray) == 1 else 'are'} for the {family} payload, but "
                         f"this teacher's loss is {spec.kd_loss} (default: gold): add {fix}, or "
                         f"drop {names}")
    unset = {key: value for key, value in (own | other).items() if getattr(spec, key) is None}
    return replace(spec, **unset)


def single_teacher(args: argparse.Namespace) -> TeacherSpec:
    """The one teacher of the ``--teacher-*`` flags. Under ``--kd-dynamic-scaling`` the KD term
    is rescaled to CE's magnitude and ``--kd-weight`` does not apply (weight 1), as always."""
    spec = _from_flags(args, "teacher", {})
    return replace(spec, weight=1.0) if args.kd_dynamic_scaling else spec


def _typed(value, key: str, where: str):
    kind = _TYPES[key]
    if value is None:
        return None
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} is true or false, got {value!r}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a path or name (text), got {value!r}")
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, kind)):
        raise ValueError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {value!r}")
    return value


def read_teachers_config(path: str) -> tuple[list[dict], str | None]:
    """The entries of a teachers YAML file (OmegaConf, interpolations resolved) and its
    ``combination`` (None when the file does not set it)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        raise ValueError(f"--teachers-config {path}: no such file")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ValueError(f"--teachers-config {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("teachers"), list):
        raise ValueError(f"--teachers-config {path}: expected a mapping with a 'teachers' list "
                         f"(one entry per teacher: load, tokenizer_model, ...)")
    unknown = set(data) - {"teachers", "combination"}
    if unknown:
        raise ValueError(f"--teachers-config {path}: unknown top-level key(s) {sorted(unknown)} "
                         f"(expected 'teachers' and optionally 'combination')")
    if not data["teachers"]:
        raise ValueError(f"--teachers-config {path}: 'teachers' is empty")
    return data["teachers"], data.get("combination")


def teachers_from_args(args: argparse.Namespace) -> tuple[list[TeacherSpec], str]:
    """``(teachers, combination)`` of a run: the ``--teacher-*`` flags' one teacher, or the
    entries of ``--teachers-config`` (unset keys from the flags). Errors name the file, the
    entry and the key."""
    path = getattr(args, "teachers_config", None)
    combination = getattr(args, "teacher_combination", None)
    if path is None:
        return [single_teacher(args)], combination or "sum"
    entries, file_combination = read_teachers_config(path)
    allowed = {"name", *_FLAG_OF}
    specs, names = [], set()
    for k, entry in enumerate(entries):
        where = f"--teachers-config {path}: teachers[{k}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping (load: ..., tokenizer_model: ...), "
                             f"got {entry!r}")
        extra = set(entry) - allowed
        if extra:
            raise ValueError(f"{where}: unknown key(s) {sorted(extra)}; a teacher takes "
                             f"{sorted(allowed)}")
        typed = {key: _typed(v, key, where) for key, v in entry.items() if key != "name"}
        name = str(entry.get("name", f"teacher{k}"))
        if name in names:
            raise ValueError(f"{where}: name {name!r} is used twice; give each teacher its own")
        names.add(name)
        spec = _from_flags(args, name, typed, where)
        if spec.tokenizer_model is None:
            raise ValueError(f"{where}: no tokenizer_model (and no --teacher-tokenizer-model "
                             f"to default to)")
        specs.append(spec)
    chosen = combination or file_combination or "sum"
    if chosen not in COMBINATIONS:
        raise ValueError(f"--teachers-config {path}: combination must be one of "
                         f"{list(COMBINATIONS)}, got {chosen!r}")
    return specs, chosen

