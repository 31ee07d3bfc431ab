"""Both aligners' chunks on synthetic token splits, against the finest partition worked out here.

Two tokenisations of the same bytes (cut at random byte positions, so tokens can split a UTF-8
character as byte-level BPE does, with control tokens dropped) have one finest partition: a chunk
ends at every byte position where both sides start a token and a character starts. The DP path
(from bytes) and the offset path (from character offsets) must both give exactly it, every chunk
exact. Hand-made cases cover what random splits do not: text one side skips, streams that differ
(inexact chunks and their merging), opaque tokens and cuts inside a character.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_xdistill.align.chunks import Alignment, check_partition, finalize
from megatron_xdistill.align.dp_aligner import _UNBOUNDED, _min_step, align_sides, check_dp_options
from megatron_xdistill.align.offset_aligner import align_offsets, walk_offsets
from megatron_xdistill.align.sides import Side

PIECES = ["a", "b", "c", " ", "é", "ß", "你", "好", "🤖", "\n"]
OPAQUE = object()


def side(tokens: list) -> Side:
    """A side from token bytes; ``None`` is a control token (dropped), ``OPAQUE`` an opaque one
    (kept, no bytes)."""
    index, starts, opaque, stream = [], [0], [], b""
    for k, tok in enumerate(tokens):
        if tok is None:
            continue
        index.append(k)
        opaque.append(tok is OPAQUE)
        stream += b"" if tok is OPAQUE else tok
        starts.append(len(stream))
    return Side(len(tokens), np.array(index, np.int64), np.array(starts, np.int64),
                np.frombuffer(stream, np.uint8).copy(), np.array(opaque, np.bool_))


def split(data: bytes, rng: np.random.Generator, controls: bool) -> list:
    """``data`` cut at random byte positions (tokens of 1+ bytes), control tokens sprinkled."""
    cuts = sorted({0, len(data), *(rng.choice(np.arange(1, len(data)), len(data) // 3,
                                              replace=False).tolist())})
    tokens = [data[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    if controls:
        for _ in range(3):
            tokens.insert(int(rng.integers(0, len(tokens) + 1)), None)
    return tokens


def finest(s_tokens: list, t_tokens: list) -> np.ndarray:
    """The finest partition of two splits of the same bytes, in original positions."""
    s, t = side(s_tokens), side(t_tokens)
    assert bytes(s.stream) == bytes(t.stream)
    data = bytes(s.stream)
    char_start = {p for p in range(len(data) + 1) if p == len(data) or data[p] & 0xC0 != 0x80}
    common = sorted(set(s.starts.tolist()) & set(t.starts.tolist()) & char_start)
    s_at = {p: k for k, p in enumerate(s.starts.tolist())}
    t_at = {p: k for k, p in enumerate(t.starts.tolist())}
    rows = []
    for x, y in zip(common[:-1], common[1:]):
        a, b, p, q = s_at[x], s_at[y], t_at[x], t_at[y]
        rows.append([s.index[a], s.index[b - 1] + 1, t.index[p], t.index[q - 1] + 1, 1])
    return np.array(rows, np.int64).reshape(-1, 5)


def char_offsets(tokens: list) -> np.ndarray:
    """Character offsets ``[N, 2]`` of byte tokens (a token holding part of a character covers
    that character; control tokens get ``(0, 0)``, which the aligner ignores)."""
    out, char = [], -1
    for tok in tokens:
        if tok is None:
            out.append((0, 0))
            continue
        first = None
        for byte in tok:
            if byte & 0xC0 != 0x80:
                char += 1
            first = char if first is None else first
        out.append((first, char + 1))  # from inside a character: from that character
    return np.array(out, np.int64).reshape(-1, 2)


@pytest.mark.parametrize("seed", range(12))
def test_both_paths_give_the_finest_partition_of_random_splits(seed):
    rng = np.random.default_rng(seed)
    data = "".join(rng.choice(PIECES, 40)).encode()
    s_tokens, t_tokens = split(data, rng, seed % 2 == 0), split(data, rng, seed % 3 == 0)
    want = finest(s_tokens, t_tokens)
    s, t = side(s_tokens), side(t_tokens)
    got_dp = align_sides(s, t)
    np.testing.assert_array_equal(got_dp, want)
    got_offsets = align_offsets(s, char_offsets(s_tokens), t, char_offsets(t_tokens))
    np.testing.assert_array_equal(got_offsets, want)
    check_partition(got_dp, len(s_tokens), len(t_tokens))
    alignment = Alignment(np.zeros(len(s_tokens), np.int64), np.zeros(len(t_tokens), np.int64),
                          got_dp)
    assert alignment.num_exact == len(want)
    assert alignment.chunks == [tuple(r[:4]) + (True,) for r in want.tolist()]


def test_tokens_in_text_the_other_side_skips_are_chunks_of_their_own():
    """A student token over text the teacher has no token for (a dropped special token) is a
    chunk with an empty teacher side, at the start, in the middle and at the end."""
    def walk(s, t):
        s, t = np.array(s, np.int64), np.array(t, np.int64)
        return walk_offsets(s[:, 0], s[:, 1], t[:, 0], t[:, 1]).tolist()

    assert walk([(0, 5), (5, 8), (8, 10)], [(5, 7), (7, 10)]) == [[0, 1, 0, 0], [1, 3, 0, 2]]
    assert walk([(5, 7), (7, 10)], [(0, 5), (5, 8), (8, 10)]) == [[0, 0, 0, 1], [0, 2, 1, 3]]
    assert walk([(0, 3), (3, 4), (6, 9)], [(0, 3), (6, 9)]) == [[0, 1, 0, 1], [1, 2, 1, 1],
                                                                [2, 3, 1, 2]]
    assert walk([(0, 3), (3, 6)], [(0, 3)]) == [[0, 1, 0, 1], [1, 2, 1, 1]]
    assert walk([(0, 3)], [(0, 2), (2, 3), (3, 6)]) == [[0, 1, 0, 2], [1, 1, 2, 3]]
    # every token in text the other side skips, the sides taking turns: n + m chunks
    assert walk([(0, 1), (2, 3), (4, 5)], [(1, 2), (3, 4), (5, 6)]) == [
        [0, 1, 0, 0], [1, 1, 0, 1], [1, 2, 1, 1], [2, 2, 1, 2], [2, 3, 2, 2], [3, 3, 2, 3]]
    # a token that shares a character with its neighbour makes no boundary
    assert walk([(0, 2), (1, 3), (3, 4)], [(0, 1), (1, 3), (3, 4)]) == [[0, 2, 0, 2],
                                                                        [2, 3, 2, 3]]


def spans_dropping_some(text: str, rng: np.random.Generator, runs: int) -> list:
    """``text`` cut at random byte positions into ``(bytes, char_lo, char_hi)`` tokens (a token
    with part of a character covers that character), then ``runs`` runs of 1-3 tokens dropped:
    text this side skips (its offsets keep the positions in ``text``)."""
    data = text.encode()
    char_of = [k for k, ch in enumerate(text) for _ in ch.encode()]
    cuts = sorted({0, len(data), *(rng.choice(np.arange(1, len(data)), len(data) // 3,
                                              replace=False).tolist())})
    tokens = [(data[a:b], char_of[a], char_of[b - 1] + 1) for a, b in zip(cuts[:-1], cuts[1:])]
    keep = np.ones(len(tokens), bool)
    for _ in range(runs):
        start = int(rng.integers(0, len(tokens)))
        keep[start:start + int(rng.integers(1, 4))] = False
    return [tok for tok, kept in zip(tokens, keep) if kept]


def inside_a_character(data, at: int) -> bool:
    """Whether byte ``at`` of ``data`` continues a UTF-8 character (its end: no)."""
    return at < len(data) and data[at] & 0xC0 == 0x80


def normal_form_from_spans(s: list, t: list) -> list[list[int]]:
    """The chunks of two ``(bytes, char_lo, char_hi)`` token lists worked out from the
    definition (chunks.py's docstring): a cut before student token i and teacher token j exists
    when every token before it ends at or before every token after it starts (in characters);
    the pieces between consecutive cuts are exact when both sides have tokens, their bytes are
    equal and no end falls inside a character; runs of inexact pieces are merged, then checked
    again."""
    def cuts_at(i: int, j: int) -> bool:
        before = [tok[2] for tok in s[:i]] + [tok[2] for tok in t[:j]]
        after = [tok[1] for tok in s[i:]] + [tok[1] for tok in t[j:]]
        return max(before, default=-1) <= min(after, default=1 << 60)

    cuts = sorted((i, j) for i in range(len(s) + 1) for j in range(len(t) + 1) if cuts_at(i, j))
    s_bytes, t_bytes = b"".join(tok[0] for tok in s), b"".join(tok[0] for tok in t)
    s_at = np.cumsum([0] + [len(tok[0]) for tok in s]).tolist()
    t_at = np.cumsum([0] + [len(tok[0]) for tok in t]).tolist()

    def exact(a: int, b: int, p: int, q: int) -> bool:
        return (a < b and p < q and s_bytes[s_at[a]:s_at[b]] == t_bytes[t_at[p]:t_at[q]]
                and not inside_a_character(s_bytes, s_at[a])
                and not inside_a_character(s_bytes, s_at[b])
                and not inside_a_character(t_bytes, t_at[q]))

    pieces: list[list[int]] = []
    for (a, p), (b, q) in zip(cuts, cuts[1:]):
        if pieces and not exact(a, b, p, q) and not exact(*pieces[-1]):
            pieces[-1][1], pieces[-1][3] = b, q
        else:
            pieces.append([a, b, p, q])
    return [[*piece, int(exact(*piece))] for piece in pieces]


@pytest.mark.parametrize("seed", range(4))
def test_offsets_path_gives_the_normal_form_where_each_side_skips_text(seed):
    """Random byte splits of one text, each side skipping a few runs of it (text the other
    side has no token for), some tokens sharing a character: the offset path's chunks are the
    normal form worked out from the definition (40 texts a seed)."""
    rng = np.random.default_rng(1000 + seed)
    for _ in range(40):
        text = "".join(rng.choice(PIECES, 30))
        s_tokens = spans_dropping_some(text, rng, int(rng.integers(0, 3)))
        t_tokens = spans_dropping_some(text, rng, int(rng.integers(0, 3)))
        s, t = side([tok[0] for tok in s_tokens]), side([tok[0] for tok in t_tokens])
        got = align_offsets(s, np.array([tok[1:] for tok in s_tokens], np.int64).reshape(-1, 2),
                            t, np.array([tok[1:] for tok in t_tokens], np.int64).reshape(-1, 2))
        want = normal_form_from_spans(s_tokens, t_tokens)
        assert got.tolist() == want, (text, s_tokens, t_tokens)
        check_partition(got, len(s_tokens), len(t_tokens))


def test_dp_path_cuts_right_around_an_opaque_token():
    """An opaque token (no text of its own) on one side is an inexact chunk of its own, against
    the other side's token there or against nothing, and the text after it aligns exactly again
    (a step never starts at an opaque token on either side)."""
    cases = [
        (([b"a", OPAQUE, b"b"], [b"a", b"X", b"b"]),
         [[0, 1, 0, 1, 1], [1, 2, 1, 2, 0], [2, 3, 2, 3, 1]]),
        (([b"ab", OPAQUE, b"cd", b"e"], [b"ab", b"Q", b"c", b"de"]),
         [[0, 1, 0, 1, 1], [1, 2, 1, 2, 0], [2, 4, 2, 4, 1]]),
        (([b"a", OPAQUE, b"b", b"c"], [b"a", b"b", b"c"]),
         [[0, 1, 0, 1, 1], [1, 2, 1, 1, 0], [2, 3, 1, 2, 1], [3, 4, 2, 3, 1]]),
        (([OPAQUE, b"b", b"c"], [b"b", b"c"]), [[0, 1, 0, 0, 0], [1, 2, 0, 1, 1], [2, 3, 1, 2, 1]]),
    ]
    for (s_tokens, t_tokens), want in cases:
        np.testing.assert_array_equal(align_sides(side(s_tokens), side(t_tokens)), want)
        swapped = np.array(want)[:, [2, 3, 0, 1, 4]]
        np.testing.assert_array_equal(align_sides(side(t_tokens), side(s_tokens)), swapped)


def min_step_by_definition(s: Side, t: Side, i: int, j: int, cap: int) -> tuple[int, int]:
    """The minimal exact step from student token ``i`` and teacher token ``j``, from its
    definition: the shortest positive byte length ``L`` at which both sides have a token boundary
    (the first token ending there) that starts a character; the step is the tokens up to it,
    exact when neither side's start is inside a character, no token in it is opaque, each side
    takes at most ``cap`` tokens and the ``L`` bytes are equal. ``(-1, -1)`` when there is none."""
    def char_start(side_: Side, k: int) -> bool:
        return not inside_a_character(side_.stream, int(side_.starts[k]))

    def ends(side_: Side, k0: int) -> dict[int, int]:
        """Byte length from token ``k0`` -> first token index ending there, at a character."""
        out: dict[int, int] = {}
        for k in range(k0 + 1, side_.n + 1):
            length = int(side_.starts[k] - side_.starts[k0])
            if length > 0 and char_start(side_, k):
                out.setdefault(length, k)
        return out

    if s.opaque[i] or t.opaque[j] or not (char_start(s, i) and char_start(t, j)):
        return -1, -1
    s_ends, t_ends = ends(s, i), ends(t, j)
    common = sorted(set(s_ends) & set(t_ends))
    if not common:
        return -1, -1
    length = common[0]
    a, b = s_ends[length], t_ends[length]
    x, y = int(s.starts[i]), int(t.starts[j])
    if (a - i > cap or b - j > cap or s.opaque[i:a].any() or t.opaque[j:b].any()
            or bytes(s.stream[x:x + length]) != bytes(t.stream[y:y + length])):
        return -1, -1
    return a, b


def changed(tokens: list, rng: np.random.Generator) -> list:
    """``tokens`` with a few tokens opaque and a few bytes replaced by other text."""
    out = list(tokens)
    for _ in range(int(rng.integers(0, 3))):
        out[int(rng.integers(0, len(out)))] = OPAQUE
    for _ in range(int(rng.integers(0, 3))):
        k = int(rng.integers(0, len(out)))
        if out[k] is not OPAQUE:
            out[k] = str(rng.choice(PIECES)).encode()
    return out


@pytest.mark.parametrize("seed", range(3))
def test_min_step_is_the_shortest_exact_common_prefix(seed):
    """The synchronous walk's step, from every pair of start tokens and for caps of 1, 2, 3 and
    none, equals the step worked out from its definition: on splits of one text, with opaque
    tokens and replaced bytes, which end a step early or leave none (then exactly (-1, -1))."""
    rng = np.random.default_rng(2000 + seed)
    seen = {"steps": 0, "none": 0, "capped": 0}
    for _ in range(12):
        data = "".join(rng.choice(PIECES, 40)).encode()
        s = side(changed(split(data, rng, False), rng))
        t = side(changed(split(data, rng, False), rng))
        for i in range(s.n):  # the teacher's tokens at the same byte and three others
            at = np.flatnonzero(t.starts[:-1] == s.starts[i]).tolist()
            for j in at + rng.integers(0, t.n, 3).tolist():
                free = min_step_by_definition(s, t, i, j, _UNBOUNDED)
                for cap in (1, 2, 3, _UNBOUNDED):
                    want = min_step_by_definition(s, t, i, j, cap)
                    got = _min_step(i, j, s.n, t.n, cap, s.starts, s.stream, s.opaque,
                                    t.starts, t.stream, t.opaque)
                    assert tuple(got) == want, (bytes(s.stream), bytes(t.stream), i, j, cap)
                    seen["steps" if want[0] >= 0 else "none"] += 1
                    seen["capped"] += want[0] < 0 <= free[0]
    assert min(seen.values()) > 20, seen  # every outcome is exercised


def test_text_after_the_other_sides_end_is_a_chunk_of_its_own():
    """When one side's text ends and the other's goes on, the walk's last exact step is
    followed by one inexact chunk of the remaining tokens against nothing, on either side."""
    s = side([b"ab", b"c", b"de", b"f", b"gh", b"ij"])
    t = side([b"a", b"bc", b"d", b"ef"])
    want = [[0, 2, 0, 2, 1], [2, 4, 2, 4, 1], [4, 6, 4, 4, 0]]
    np.testing.assert_array_equal(align_sides(s, t), want)
    np.testing.assert_array_equal(align_sides(t, s), np.array(want)[:, [2, 3, 0, 1, 4]])


def test_an_empty_token_goes_with_the_next_token_on_both_paths():
    """A kept token with no bytes and a zero-width character span (none of the asset
    tokenizers gives one on real text, but a converted vocabulary may): both paths put it in the
    chunk of the token after it, or in the chunk before when none follows, so an exact chunk
    stays exact; the offset path from character spans, the byte path from bytes alone. On either
    side, after text the other side skips, at the start and at the end."""
    cases = [  # (student, teacher) as (bytes, first character, end character); the chunks
        (([(b"ab", 0, 2), (b"", 2, 2), (b"cd", 2, 4)], [(b"ab", 0, 2), (b"cd", 2, 4)]),
         [[0, 1, 0, 1, 1], [1, 3, 1, 2, 1]]),
        (([(b"", 0, 0), (b"ab", 0, 2)], [(b"ab", 0, 2)]), [[0, 2, 0, 1, 1]]),
        (([(b"ab", 0, 2), (b"", 2, 2)], [(b"ab", 0, 2)]), [[0, 1, 0, 1, 1], [1, 2, 1, 1, 0]]),
        (([(b"", 0, 0), (b"ab", 0, 2), (b"", 2, 2)], [(b"a", 0, 1), (b"", 1, 1), (b"b", 1, 2)]),
         [[0, 2, 0, 3, 1], [2, 3, 3, 3, 0]]),
        (([(b"X", 0, 1), (b"", 1, 1), (b"ab", 1, 3)], [(b"ab", 1, 3)]),
         [[0, 1, 0, 0, 0], [1, 3, 0, 1, 1]]),
    ]
    for (s_tokens, t_tokens), want in cases:
        for (a_tokens, b_tokens), cols in (((s_tokens, t_tokens), [0, 1, 2, 3, 4]),
                                           ((t_tokens, s_tokens), [2, 3, 0, 1, 4])):
            a, b = side([tok[0] for tok in a_tokens]), side([tok[0] for tok in b_tokens])
            spans = [np.array([tok[1:] for tok in x], np.int64).reshape(-1, 2)
                     for x in (a_tokens, b_tokens)]
            expected = np.array(want)[:, cols]
            np.testing.assert_array_equal(align_offsets(a, spans[0], b, spans[1]), expected)
            np.testing.assert_array_equal(align_sides(a, b), expected)


def test_different_text_gives_inexact_chunks_and_neighbours_merge():
    """Where the bytes differ the chunk is inexact; neighbouring inexact chunks are one."""
    s = side([b"ab", b"c", b"X", b"def"])
    t = side([b"a", b"bc", b"Y", b"d", b"ef"])
    np.testing.assert_array_equal(align_sides(s, t), [[0, 2, 0, 2, 1], [2, 3, 2, 3, 0],
                                                      [3, 4, 3, 5, 1]])
    s = side([b"a", b"X", b"Y", b"b"])
    t = side([b"a", b"Z", b"W", b"b"])
    np.testing.assert_array_equal(align_sides(s, t), [[0, 1, 0, 1, 1], [1, 3, 1, 3, 0],
                                                      [3, 4, 3, 4, 1]])
    # a token only one side has
    s = side([b"a", b"Q", b"b"])
    t = side([b"a", b"b"])
    np.testing.assert_array_equal(align_sides(s, t), [[0, 1, 0, 1, 1], [1, 2, 1, 1, 0],
                                                      [2, 3, 1, 2, 1]])


def test_finalize_marks_opaque_and_cut_characters_inexact():
    """Normal form on given spans: an opaque token makes its chunk inexact; a chunk that ends
    or starts inside a character is inexact and merges with its inexact neighbour, and the
    merged chunk, whole characters equal on both sides, is exact again; a side with no tokens is
    never exact and sits at the next kept token."""
    s = side([b"ab", OPAQUE, b"cd", b"ef"])
    t = side([b"ab", b"cd", b"ef"])
    spans = np.array([[0, 1, 0, 1], [1, 3, 1, 2], [3, 4, 2, 3]])
    want = [[0, 1, 0, 1, 1], [1, 3, 1, 2, 0], [3, 4, 2, 3, 1]]  # after it: exact again
    np.testing.assert_array_equal(finalize(spans, s, t), want)
    np.testing.assert_array_equal(finalize(spans[:, [2, 3, 0, 1]], t, s),
                                  np.array(want)[:, [2, 3, 0, 1, 4]])  # on the teacher side
    e = "é".encode()
    s = side([b"x", e[:1], e[1:] + b"y", b"z"])
    t = side([b"x", e[:1], e[1:] + b"y", b"z"])
    spans = np.array([[0, 1, 0, 1], [1, 2, 1, 2], [2, 3, 2, 3], [3, 4, 3, 4]])
    np.testing.assert_array_equal(finalize(spans, s, t), [[0, 1, 0, 1, 1], [1, 3, 1, 3, 1],
                                                          [3, 4, 3, 4, 1]])
    # bytes equal but cut after a character's first byte on the teacher side only
    s = side([b"x", e + b"y"])
    t = side([b"x", e[:1], e[1:] + b"y"])
    np.testing.assert_array_equal(finalize(np.array([[0, 1, 0, 1], [1, 2, 1, 3]]), s, t),
                                  [[0, 1, 0, 1, 1], [1, 2, 1, 3, 1]])
    # two inexact chunks (a cut character, an empty side) whose run spells the same text
    np.testing.assert_array_equal(finalize(np.array([[0, 2, 0, 2], [2, 2, 2, 3]]), s, t),
                                  [[0, 2, 0, 3, 1]])
    # the teacher lost a character's last byte (it cannot encode it): the student's chunk that
    # ends before that byte is cut inside the character (an odd-valued continuation byte, 0xA9)
    # even though the teacher's stream ends there and the bytes before it are equal
    s, t = side([b"ab" + e[:1], e[1:]]), side([b"ab" + e[:1]])
    np.testing.assert_array_equal(finalize(np.array([[0, 1, 0, 1], [1, 2, 1, 1]]), s, t),
                                  [[0, 2, 0, 1, 0]])
    np.testing.assert_array_equal(finalize(np.array([[0, 1, 0, 1], [1, 1, 1, 2]]), t, s),
                                  [[0, 1, 0, 2, 0]])  # the same on the other side
    # lengths equal, bytes differ
    s, t = side([b"ab", b"cd"]), side([b"ab", b"ce"])
    np.testing.assert_array_equal(finalize(np.array([[0, 1, 0, 1], [1, 2, 1, 2]]), s, t),
                                  [[0, 1, 0, 1, 1], [1, 2, 1, 2, 0]])
    # an empty student side, with control tokens around: original positions
    s = side([None, b"ab", None, b"cd", None])
    t = side([b"ab", b"X", b"cd"])
    np.testing.assert_array_equal(
        finalize(np.array([[0, 1, 0, 1], [1, 1, 1, 2], [1, 2, 2, 3]]), s, t),
        [[1, 2, 0, 1, 1], [3, 3, 1, 2, 0], [3, 4, 2, 3, 1]])


def test_check_partition_refuses_what_is_not_an_ordered_cover():
    check_partition(np.array([[0, 2, 0, 1, 1], [2, 3, 1, 1, 0], [3, 3, 1, 3, 0]]), 3, 3)
    check_partition(np.zeros((0, 5), np.int64), 0, 0)
    for bad, n, m in [([[0, 2, 0, 1, 1], [1, 3, 1, 2, 1]], 3, 2),   # student overlap
                      ([[0, 1, 0, 2, 1], [1, 2, 1, 3, 1]], 2, 3),   # teacher overlap
                      ([[0, 4, 0, 1, 1]], 3, 1),                    # past the student's end
                      ([[0, 1, 0, 2, 1]], 1, 1),                    # past the teacher's end
                      ([[1, 0, 0, 1, 1]], 2, 1),                    # reversed student span
                      ([[0, 1, 1, 0, 1]], 1, 2),                    # reversed teacher span
                      ([[0, 1, 0, 1, 1], [1, 1, 1, 1, 0]], 1, 1)]:  # a chunk with no tokens
        with pytest.raises(AssertionError):
            check_partition(np.array(bad), n, m)


def test_dp_options_out_of_range_are_refused():
    check_dp_options(1, 1, 1)
    check_dp_options(1000, 1, 1)
    for bad in [(0, 16, 64), (1001, 16, 64), (4, 0, 64), (4, 16, 0)]:
        with pytest.raises(ValueError, match="must be"):
            check_dp_options(*bad)
