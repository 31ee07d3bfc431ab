"""Building W for a (student, teacher) tokenizer pair: the builders composed, then the top-k cut.

Order and precedence per student row s:
  1. exact (one-hot on the teacher token with the same canonical text; wins the row outright);
  2. special-token mapping for special/control rows (``special_tokens=True``), one-hot;
  3. otherwise multi-token (teacher spelling of s's text, ``multitoken``), plus reverse-pass
     entries (``reverse_pass=True``).
Entries are merged (duplicates summed), cut to the ``top_k`` largest (ties: forward entries before
reverse ones, then lower teacher id) and each row renormalised to sum to 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .. import __version__
from .exact import alias_mask, canonical_ids, exact_matches
from .fileio import RowKind
from .multitoken import multi_token_entries, reverse_entries
from .reencode import Reencoder
from .runtime import ProjectionMatrix, tokenizer_metadata
from .sparse_rows import pack_rows
from .special import special_token_map
from .spelling import VIA_BYTES, VIA_TEXT, BytesCover
from .vocab import load_tokenizer

_FORWARD, _REVERSE = 0, 1  # tie-break priority in the top-k cut


@dataclass(frozen=True)
class BuildOptions:
    """Which builders run and their parameters (recorded in the file's metadata)."""

    top_k: int = 4
    multi_token: bool = True
    max_pieces: int = 4
    decay: float = 0.1
    reverse_pass: bool = False
    reverse_weight: float = 0.05
    special_tokens: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.max_pieces < 1:
            raise ValueError(f"max_pieces must be >= 1, got {self.max_pieces}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.reverse_weight <= 0:
            raise ValueError(f"reverse_weight must be > 0, got {self.reverse_weight}")

    def to_json(self) -> str:
        """The options as a JSON object string."""
        return json.dumps(asdict(self), sort_keys=True)


class _Progress:
    """tqdm bars per stage when ``enabled``; no-ops otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    @contextmanager
    def stage(self, desc: str, total: int | None = None) -> Iterator[Any]:
        if not self.enabled:
            yield lambda n=1: None
            return
        from tqdm.auto import tqdm

        with tqdm(total=total, desc=desc, unit="tok", leave=True, dynamic_ncols=True) as bar:
            yield bar.update


def _tables(tokenizer: Any) -> list[bytes | None]:
    from ..align.canonical import token_bytes_table

    return list(token_bytes_table(tokenizer))


def build_projection(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    options: BuildOptions | None = None,
    progress: bool = False,
) -> ProjectionMatrix:
    """Build W [V_s, V_t] for two tokenizers (objects or paths); see the module docstring."""
    opts = options or BuildOptions()
    student = load_tokenizer(student_tokenizer)
    teacher = load_tokenizer(teacher_tokenizer)
    bars = _Progress(progress)

    with bars.stage("canonical token bytes", total=2) as tick:
        s_table = _tables(student)
        tick()
        t_table = _tables(teacher)
        tick()
    vs, vt = len(s_table), len(t_table)
    s_enc, t_enc = Reencoder(student), Reencoder(teacher)

    with bars.stage("exact matches", total=vs) as tick:
        t_canon = canonical_ids(t_table, t_enc)
        s_canon = canonical_ids(s_table, s_enc)
        exact = exact_matches(s_table, t_canon)
        alias = alias_mask(s_table, s_canon)
        tick(vs)
    kind = np.full(vs, int(RowKind.EMPTY), dtype=np.uint8)
    has_exact = exact >= 0
    kind[has_exact] = int(RowKind.EXACT)
    kind[has_exact & alias] = int(RowKind.EXACT_ALIAS)
    ex_rows = np.flatnonzero(has_exact)
    parts = [(ex_rows, exact[ex_rows], np.ones(ex_rows.size), _FORWARD)]

    special_rows = np.asarray([s for s, b in enumerate(s_table) if b is None], dtype=np.int64)
    if opts.special_tokens:
        with bars.stage("special tokens", total=len(special_rows)) as tick:
            mapping = special_token_map(student, teacher, s_table, t_table)
            tick(len(special_rows))
        sp_rows = np.asarray(sorted(mapping), dtype=np.int64)
        sp_cols = np.asarray([mapping[s] for s in sp_rows], dtype=np.int64)
        kind[sp_rows] = int(RowKind.SPECIAL)
        parts.append((sp_rows, sp_cols, np.ones(sp_rows.size), _FORWARD))

    t_cover = BytesCover(t_canon)
    todo = np.asarray([s for s, b in enumerate(s_table) if b and not has_exact[s]], dtype=np.int64)
    if opts.multi_token and todo.size:
        with bars.stage("multi-token (re-encode with teacher)", total=todo.size) as tick:
            r, c, v, spellings = multi_token_entries(
                s_table, todo, t_table, t_enc, t_cover, opts.max_pieces, opts.decay, tick
            )
        via = np.asarray([sp.via for sp in spellings], dtype=np.int64)
        kind[todo[via == VIA_TEXT]] = int(RowKind.MULTI_TOKEN)
        kind[todo[via == VIA_BYTES]] = int(RowKind.BYTES)
        parts.append((r, c, v, _FORWARD))

    if opts.reverse_pass:
        blocked = has_exact.copy()  # exact rows stay one-hot; special rows spell no text
        blocked[special_rows] = True
        n_teacher = sum(1 for b in t_table if b)
        with bars.stage("reverse pass (re-encode with student)", total=n_teacher) as tick:
            r, c, v = reverse_entries(
                t_table,
                s_table,
                s_enc,
                BytesCover(s_canon),
                blocked,
                opts.reverse_weight,
                opts.max_pieces,
                tick,
            )
        parts.append((r, c, v, _REVERSE))
        newly = np.unique(r)
        kind[newly[kind[newly] == int(RowKind.EMPTY)]] = int(RowKind.REVERSE)

    with bars.stage("top-k cut", total=vs) as tick:
        rows = np.concatenate([p[0] for p in parts])
        cols = np.concatenate([p[1] for p in parts])
        vals = np.concatenate([p[2] for p in parts])
        prio = np.concatenate([np.full(p[0].size, p[3], dtype=np.int64) for p in parts])
        indices, weights = pack_rows(
            rows, cols, vals, vs, k=opts.top_k, priority=prio, renormalize=True
        )
        tick(vs)
    kind[(indices < 0).all(axis=1)] = int(RowKind.EMPTY)

    metadata = tokenizer_metadata(student, teacher)
    metadata.update(
        source="build",
        builder_options=opts.to_json(),
        created_by=f"megatron_xdistill {__version__}",
    )
    return ProjectionMatrix(
        torch.from_numpy(indices),
        torch.from_numpy(weights),
        vs,
        vt,
        metadata,
        torch.from_numpy(kind),
    )
