"""One tokenised side of an alignment, in the flat form the compiled aligners work on.

Control tokens (BOS/EOS/pad... : no canonical text and no text of their own) are dropped first and
belong to no chunk; the aligners run on the remaining tokens and map spans back. Unknown tokens and
special tokens that cover real text stay in as *opaque* tokens: they take part in chunks, but a
chunk holding one is never exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .canonical import TokenTable

__all__ = ["Side", "make_side"]


@dataclass(frozen=True)
class Side:
    """Canonical bytes of a token sequence with control tokens removed.

    ``index[k]`` is the position in the original id list of kept token ``k``; ``starts[k]`` is
    where its bytes begin in ``stream`` (``starts[n]`` = total); ``opaque[k]`` marks a kept token
    whose text is unknown (unk, out-of-range id, special token written in the text).
    """

    n_orig: int
    index: np.ndarray  # int64 [n]
    starts: np.ndarray  # int64 [n + 1]
    stream: np.ndarray  # uint8 [starts[n]]
    opaque: np.ndarray  # bool [n]

    @property
    def n(self) -> int:
        """Number of kept tokens."""
        return int(self.index.shape[0])


@njit(cache=True, nogil=True)
def _gather(ids, keep, tab_data, tab_off, tab_special, strip_first):
    """Concatenate canonical bytes of the kept ids; drop one leading space of the first if asked."""
    vocab = tab_special.shape[0]
    n = 0
    for k in range(ids.shape[0]):
        if keep[k]:
            n += 1
    index = np.empty(n, np.int64)
    starts = np.empty(n + 1, np.int64)
    opaque = np.empty(n, np.bool_)
    skip = np.zeros(n, np.int64)
    pos = 0
    c = 0
    for k in range(ids.shape[0]):
        if not keep[k]:
            continue
        t = ids[k]
        index[c] = k
        starts[c] = pos
        if t < 0 or t >= vocab or tab_special[t]:
            opaque[c] = True
        else:
            opaque[c] = False
            ln = tab_off[t + 1] - tab_off[t]
            if c == 0 and strip_first and ln > 0 and tab_data[tab_off[t]] == 32:
                skip[c] = 1
            pos += ln - skip[c]
        c += 1
    starts[n] = pos
    stream = np.empty(pos, np.uint8)
    for c in range(n):
        if opaque[c]:
            continue
        t = ids[index[c]]
        src = tab_off[t] + skip[c]
        ln = starts[c + 1] - starts[c]
        for b in range(ln):
            stream[starts[c] + b] = tab_data[src + b]
    return index, starts, stream, opaque


def make_side(
    ids: np.ndarray, table: TokenTable, keep: np.ndarray | None = None, strip_prefix: bool = False
) -> Side:
    """Build a :class:`Side` from token ids; ``keep`` (bool per id) says which ids take part.

    With ``keep=None`` every id except control tokens is kept (the rule of the id-only path).
    ``strip_prefix`` removes the space a prefix-space tokenizer put before the first word.
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if keep is None:
        keep = control_mask(ids, table)
        np.logical_not(keep, out=keep)
    index, starts, stream, opaque = _gather(
        ids, np.ascontiguousarray(keep, dtype=np.bool_), table.data, table.offsets,
        table.special, bool(strip_prefix),
    )
    return Side(int(ids.shape[0]), index, starts, stream, opaque)


def control_mask(ids: np.ndarray, table: TokenTable) -> np.ndarray:
    """True for ids that are control tokens: special, not unk, inside the vocabulary."""
    ids = np.asarray(ids, dtype=np.int64)
    inside = (ids >= 0) & (ids < table.vocab_size)
    mask = np.zeros(ids.shape, np.bool_)
    mask[inside] = table.special[ids[inside]]
    if table.unk_id >= 0:
        mask &= ids != table.unk_id
    return mask
