"""Mutation check of the numerical core (``make mutate``; not in CI, not in ``make test``).

Each mutant is one small AST change to a target module (an operator, a comparison, a constant,
a boolean operator, a dropped unary operator, a returned value, a removed statement); the tests
that cover the target run against it and must fail ("killed"). A mutant the tests pass is a
"survivor": either a test is missing, or the change computes the same thing (an "equivalent"
mutant, listed with its reason in ``tools/mutation_results/equivalent.json``).

Why a script and not mutmut / cosmic-ray: mutmut 3 runs the tests from a copy of the tree in
``mutants/`` with trampolines in every function, which Numba's ``@njit`` functions (the aligner)
cannot compile; cosmic-ray needs a session database and a config per target. Here a mutant is
written over the file itself (the original kept aside and put back after each mutant, and on the
next start if a run was killed), and the tests run in a child forked from a process that has
already imported torch, Numba and Megatron-Core, so a mutant costs its tests, not ~10 s of imports.

Stale code: every mutant gets a modification time of its own (Python's bytecode and Numba's cache
are both keyed on it and the size), bytecode is neither read from nor written to the tree
(``PYTHONPYCACHEPREFIX``) and Numba caches outside it, so a mutated ``@njit`` function is compiled
from the mutated source (and the original's cached code is used again once it is put back).

Resumable: one JSON line per mutant is appended to ``mutants.jsonl``; a rerun skips mutants already
recorded for the same source (``--retry-survivors`` runs the survivors again, after adding tests).
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "mutation_results"
PKG = "megatron_xdistill"
# Plain asserts: rewriting every imported test helper and plugin costs more than most mutants'
# tests (a failing assert still fails the test).
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow and not gpu",
               "--no-header", "--assert=plain"]


@dataclass(frozen=True)
class Target:
    """A module to mutate: which functions (None: all), and the tests that cover it."""

    name: str
    path: str
    functions: tuple[str, ...] | None
    tests: tuple[str, ...]
    sample: int | None = None  # run this many of the mutants (a fixed choice), None: all


_LOSS_REF = "tests/test_loss_reference.py"
TARGETS = [
    # Fast tests that kill many mutants first: under -x a killed mutant stops at its first failure.
    Target("reference", f"{PKG}/loss/definitions/reference.py", None, (
        f"{_LOSS_REF}::test_reference_equals_per_chunk_loop",
        f"{_LOSS_REF}::test_a_batch_without_counted_chunks_has_loss_zero",
        f"{_LOSS_REF}::test_chunks_without_a_predicting_position_on_one_side_do_not_count",
        f"{_LOSS_REF}::test_first_token_heads_form_equals_its_loop",
        f"{_LOSS_REF}::test_first_token_heads_of_every_column_onto_itself_is_the_exact_form",
        f"{_LOSS_REF}::test_top1_agreement_equals_the_loop",
        f"{_LOSS_REF}::test_reference_refuses_an_unknown_mode_and_a_headed_reverse_kl",
        f"{_LOSS_REF}::test_sparse_projection_gives_the_dense_loss_and_gradient",
        f"{_LOSS_REF}::test_compressed_form_is_a_bound_that_tightens_with_k",
        f"{_LOSS_REF}::test_sample_weights_scale_each_samples_chunks",
        "tests/test_chunk_starts.py::test_merged_payload_holds_the_top_k_mass_on_the_heads",
    )),
    Target("formulas", f"{PKG}/loss/definitions/formulas.py", None, (
        "tests/test_loss_formulas.py",
        f"{_LOSS_REF}::test_reference_equals_per_chunk_loop",
        f"{_LOSS_REF}::test_compressed_form_is_a_bound_that_tightens_with_k",
        f"{_LOSS_REF}::test_tail_row_sums_match_dense_products",
        f"{_LOSS_REF}::test_exact_form_teacher_terms_do_not_depend_on_the_slice",
        f"{_LOSS_REF}::test_sample_weights_scale_each_samples_chunks",
        # the compact gold form: its formulas against a loop and against gold (float64)
        "tests/test_loss_gold_topk.py::test_formula_equals_a_loop_and_gold_at_full_sizes",
        "tests/test_loss_gold_topk.py::test_formula_grows_to_gold_within_the_tail_bound",
        "tests/test_loss_gold_topk.py::test_reference_converges_to_todays_gold",
    )),
    Target("chunk_starts", f"{PKG}/loss/definitions/chunk_starts.py", None, (
        "tests/test_chunk_starts.py",
    )),
    Target("chunk_rows", f"{PKG}/loss/blocks/chunk_rows.py", None, (
        "tests/test_chunk_rows.py",
        "tests/test_loss_kernels.py::test_blocks_end_where_chunks_end_and_hold_their_rows_whole",
        "tests/test_loss_kernels.py::test_each_blocks_rows_held_whole_or_split_are_found_once",
        "tests/test_device_placement.py::test_chunk_rows_move_every_tensor",
    ), sample=40),
    Target("align_chunks", f"{PKG}/align/chunks.py", None, (
        "tests/test_align_finest.py",
        "tests/test_align_real.py::test_paths_agree_on_tricky_texts",
        "tests/test_align_real.py::test_dp_handles_control_tokens_and_odd_tokenisation",
        "tests/test_align_real.py::test_out_of_range_and_unknown_ids_are_inexact",
        "tests/test_align_real.py::test_unknown_tokens_give_inexact_chunks",
        "tests/test_align_real.py::test_nfd_text_aligns_inexactly_where_qwen_normalises",
        "tests/test_align_partition.py",
    ), sample=35),
    Target("align_offsets", f"{PKG}/align/offset_aligner.py", ("walk_offsets", "align_offsets"), (
        "tests/test_align_finest.py",
        "tests/test_align_real.py::test_paths_agree_on_tricky_texts",
        "tests/test_align_real.py::test_dp_handles_control_tokens_and_odd_tokenisation",
        "tests/test_align_partition.py",
    ), sample=30),
    # The synchronous walk and its minimal exact steps; the re-alignment fallback's bulk
    # (_window_keys, _unique_keys, _anchors, _nw_window) is not mutated here.
    Target("align_dp", f"{PKG}/align/dp_aligner.py",
           ("_char_start", "_min_step", "dp_spans", "check_dp_options", "align_sides"), (
        "tests/test_align_finest.py",
        "tests/test_align_real.py::test_paths_agree_on_tricky_texts",
        "tests/test_align_real.py::test_dp_handles_control_tokens_and_odd_tokenisation",
        "tests/test_align_real.py::test_dp_resyncs_after_corruption_in_near_linear_time",
        "tests/test_align_real.py::test_bad_inputs_raise_clear_errors",
        "tests/test_align_partition.py",
    ), sample=30),
]

# --------------------------------------------------------------------------- mutants

_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
          ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr,
          ast.BitOr: ast.BitAnd}
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
        ast.NotIn: ast.In}
_SYM = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
        ast.BitAnd: "&", ast.BitOr: "|", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
        ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
        ast.NotIn: "not in", ast.And: "and", ast.Or: "or", ast.USub: "-", ast.Not: "not ",
        ast.Invert: "~"}


# Methods whose first argument is a dimension (mutating it mostly picks the same axis of a 2-D
# tensor, or fails at once: neither says anything about the tests).
_DIM_FIRST = {"sum", "amax", "amin", "argmax", "argmin", "argsort", "cumsum", "softmax",
              "log_softmax", "gather", "scatter", "scatter_add", "scatter_reduce", "unsqueeze",
              "squeeze", "sort", "flip", "logsumexp", "mean", "all", "any", "max", "min"}


@dataclass(frozen=True)
class Mutant:
    """One change: bytes [start, end) of the file replaced by ``text``."""

    key: str        # stable across unrelated edits: function, kind, original text, occurrence
    line: int
    kind: str
    start: int
    end: int
    text: str
    original: str


def _copy(node: ast.AST) -> ast.AST:
    return ast.parse(ast.unparse(node), mode="eval").body if isinstance(node, ast.expr) else \
        ast.parse(ast.unparse(node)).body[0]


def _skipped(tree: ast.Module) -> set[int]:
    """Nodes never mutated inside: docstrings, annotations, decorators, raise/assert messages,
    f-strings, ``__all__``."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            mark(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in node.decorator_list:
                mark(dec)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for a in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
                mark(a.annotation)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.Raise):
            mark(node.exc)
        if isinstance(node, ast.Assert):
            mark(node.msg)
        if isinstance(node, ast.JoinedStr):
            mark(node)
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            mark(node)
        if isinstance(node, ast.Call):  # dimension arguments: -1 -> 1 is often the same axis
            name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            for kw in node.keywords:
                if kw.arg in ("dim", "axis", "keepdim"):
                    mark(kw.value)
            if name in _DIM_FIRST and isinstance(node.func, ast.Attribute):
                for arg in node.args[:1]:
                    mark(arg)
        if isinstance(node, ast.ClassDef):  # dataclass fields: declarations, not code
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign):
                    mark(stmt)
    return skip


def _scopes(tree: ast.Module, functions: tuple[str, ...] | None) -> list[tuple[str, ast.AST]]:
    """(name, node) of the code to mutate: the named top-level functions (and methods of
    top-level classes), or every top-level function and class."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if functions is None or node.name in functions:
                out.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and (
                        functions is None or f"{node.name}.{sub.name}" in functions):
                    out.append((f"{node.name}.{sub.name}", sub))
    return out


def _safe_to_remove(stmt: ast.stmt) -> bool:
    """Statements whose removal leaves every name bound: calls, stores into subscripts or
    attributes, augmented assignments, ``continue``, ``raise`` and ``assert``."""
    if isinstance(stmt, (ast.Expr, ast.Continue, ast.Raise, ast.Assert, ast.AugAssign)):
        return not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
    if isinstance(stmt, ast.Assign):
        return all(isinstance(t, (ast.Subscript, ast.Attribute)) for t in stmt.targets)
    return False


def mutants_of(source: str, functions: tuple[str, ...] | None) -> list[Mutant]:
    """Every mutant of ``source`` inside ``functions`` (None: all functions and methods)."""
    data = source.encode()
    tree = ast.parse(source)
    skip = _skipped(tree)
    line_start = [0]
    for line in data.splitlines(keepends=True):
        line_start.append(line_start[-1] + len(line))

    def span(node: ast.AST) -> tuple[int, int]:
        return (line_start[node.lineno - 1] + node.col_offset,
                line_start[node.end_lineno - 1] + node.end_col_offset)

    found: list[tuple[str, str, ast.AST, str]] = []  # (scope, kind, node, new text)
    for scope, fn in _scopes(tree, functions):
        for node in ast.walk(fn):
            if id(node) in skip or node is fn:
                continue
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
                new = _copy(node)
                new.op = _BINOP[type(node.op)]()
                found.append((scope, f"{_SYM[type(node.op)]}->{_SYM[type(new.op)]}", node,
                              f"({ast.unparse(new)})"))
            elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP:
                new = _copy(node)
                new.op = _BINOP[type(node.op)]()
                found.append((scope, f"{_SYM[type(node.op)]}=->{_SYM[type(new.op)]}=", node,
                              ast.unparse(new)))
            elif isinstance(node, ast.Compare):
                for k, op in enumerate(node.ops):
                    if type(op) in _CMP:
                        new = _copy(node)
                        new.ops[k] = _CMP[type(op)]()
                        found.append((scope, f"{_SYM[type(op)]}->{_SYM[type(new.ops[k])]}", node,
                                      f"({ast.unparse(new)})"))
            elif isinstance(node, ast.BoolOp):
                new = _copy(node)
                new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
                found.append((scope, f"{_SYM[type(node.op)]}->{_SYM[type(new.op)]}", node,
                              f"({ast.unparse(new)})"))
            elif isinstance(node, ast.UnaryOp) and type(node.op) in (ast.USub, ast.Not,
                                                                     ast.Invert):
                found.append((scope, f"drop {_SYM[type(node.op)].strip()}", node,
                              f"({ast.unparse(node.operand)})"))
            elif isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)):
                v = node.value
                if isinstance(v, bool):
                    new_v = not v
                elif isinstance(v, int):
                    new_v = 1 - v if v in (0, 1) else v + 1
                elif isinstance(v, float):
                    new_v = 1.0 - v if v in (0.0, 1.0) else v * 2.0
                else:
                    continue
                found.append((scope, f"{v!r}->{new_v!r}", node, repr(new_v)))
            elif isinstance(node, ast.Return) and node.value is not None and not (
                    isinstance(node.value, ast.Constant) and node.value.value is None):
                found.append((scope, "return None", node.value, "None"))
            if isinstance(node, ast.stmt) and _safe_to_remove(node):
                found.append((scope, "remove", node, "pass"))

    out, seen = [], {}
    for scope, kind, node, text in found:
        start, end = span(node)
        original = data[start:end].decode()
        mutated = (data[:start] + text.encode() + data[end:]).decode()
        try:
            if ast.dump(ast.parse(mutated)) == ast.dump(tree):
                continue
        except SyntaxError:
            continue
        base = f"{scope}|{kind}|{' '.join(original.split())}"
        seen[base] = seen.get(base, 0) + 1
        out.append(Mutant(f"{base}|{seen[base]}", node.lineno, kind, start, end, text, original))
    return sorted(out, key=lambda m: (m.start, m.end, m.kind))


def selected(target: Target, mutants: list[Mutant]) -> list[Mutant]:
    """The mutants a run covers: all, or ``target.sample`` of them picked by a hash of their
    keys (the same ones on every run while the source is unchanged)."""
    if target.sample is None or target.sample >= len(mutants):
        return mutants
    ranked = sorted(mutants, key=lambda m: hashlib.sha256(m.key.encode()).hexdigest())
    keep = {m.key for m in ranked[:target.sample]}
    return [m for m in mutants if m.key in keep]


# --------------------------------------------------------------------------- running

def _preload() -> None:
    """Import what every test imports and is slow to import, once, before forking."""
    import _hypothesis_pytestplugin  # noqa: F401
    import hypothesis  # noqa: F401
    import numba  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401

    try:
        import megatron.core  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        pass
    assert not any(m.startswith(PKG) for m in sys.modules), "the package must not be preloaded"


def _run_tests(tests: tuple[str, ...], log: Path, timeout: float) -> tuple[str, float]:
    """Run ``tests`` in a forked child; ("killed" | "survived" | "timeout", seconds)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.setpgid(0, 0)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
            os.chdir(ROOT)
            import pytest

            code = pytest.main([*tests, *PYTEST_ARGS])
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(int(code))
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                return ("survived" if rc == 0 else "killed"), time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                _kill(pid)
                return "timeout", time.monotonic() - t0
            time.sleep(0.05)
    except BaseException:
        _kill(pid)
        raise


def _kill(pid: int) -> None:
    """Kill a test child and the ranks it started (its own process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class Workspace:
    """Writes mutants over a target file and always puts the original back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending = RESULTS / ".pending" / path.name
        self.pending.parent.mkdir(parents=True, exist_ok=True)
        self.restore_pending()
        self.original = path.read_bytes()
        st = path.stat()
        self.times = (st.st_atime_ns, st.st_mtime_ns)

    def restore_pending(self) -> None:
        """Put back an original left by a run that was killed while a mutant was written."""
        if self.pending.exists():
            self.path.write_bytes(self.pending.read_bytes())
            self.pending.unlink()
            print(f"restored {self.path} from a killed run", flush=True)

    def write(self, data: bytes) -> None:
        self.pending.write_bytes(self.original)
        self.path.write_bytes(data)
        # A modification time of this mutant's own (Python's bytecode and Numba's cache index
        # are keyed on it with the size): ahead of the original by an hour plus a hash of the
        # mutated text, so the Numba cache can be kept from run to run.
        ahead = 3600 + int(hashlib.sha256(data).hexdigest()[:7], 16)
        mtime = self.times[1] + ahead * 1_000_000_000
        os.utime(self.path, ns=(mtime, mtime))

    def restore(self) -> None:
        self.path.write_bytes(self.original)
        os.utime(self.path, ns=self.times)
        self.pending.unlink(missing_ok=True)


def _load(path: Path) -> dict[tuple[str, str], dict]:
    """Latest record per (target source digest, mutant key)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[(rec["source_sha"], rec["key"])] = rec
    return out


def summarize(targets: list[Target], records: dict, equivalent: dict[str, str]) -> list[dict]:
    """One row per target: mutants, killed, survived, equivalent, killed % of the
    non-equivalent mutants; and the survivors."""
    rows = []
    for t in targets:
        pending = RESULTS / ".pending" / Path(t.path).name  # a run has a mutant written now
        source = (pending if pending.exists() else ROOT / t.path).read_bytes()
        sha = hashlib.sha256(source).hexdigest()[:16]
        mutants = mutants_of(source.decode(), t.functions)
        got = [records.get((sha, m.key)) for m in selected(t, mutants)]
        done = [r for r in got if r]
        killed = sum(r["outcome"] in ("killed", "timeout") for r in done)
        survivors = [r for r in done if r["outcome"] == "survived"]
        equiv = [r for r in survivors if f"{t.name}|{r['key']}" in equivalent]
        live = [r for r in survivors if f"{t.name}|{r['key']}" not in equivalent]
        scored = killed + len(live)
        rows.append({
            "target": t.name, "path": t.path, "functions": list(t.functions or []),
            "tests": list(t.tests), "mutants": len(mutants), "sampled": t.sample,
            "run": len(done), "killed": killed,
            "survived": len(live), "equivalent": len(equiv),
            "percent": round(100.0 * killed / scored, 1) if scored else None,
            "survivors": [{"line": r["line"], "kind": r["kind"], "original": r["original"],
                           "key": r["key"]} for r in live],
            "equivalents": [{"line": r["line"], "kind": r["kind"], "original": r["original"],
                             "reason": equivalent[f"{t.name}|{r['key']}"]} for r in equiv],
        })
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'target':<14}{'mutants':>8}{'run':>6}{'killed':>8}{'survived':>10}{'equiv':>7}"
          f"{'killed %':>10}")
    for r in rows:
        pct = "-" if r["percent"] is None else f"{r['percent']:.1f}"
        print(f"{r['target']:<14}{r['mutants']:>8}{r['run']:>6}{r['killed']:>8}"
              f"{r['survived']:>10}{r['equivalent']:>7}{pct:>10}")
    for r in rows:
        for s in r["survivors"]:
            print(f"  survivor {r['path']}:{s['line']} {s['kind']}: {s['original'][:70]!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", help="target name(s); default all")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--summary", action="store_true", help="print the table from the records")
    ap.add_argument("--baseline", action="store_true", help="time the tests on the originals")
    ap.add_argument("--retry-survivors", action="store_true")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per mutant (default: 3 x the baseline + 30)")
    args = ap.parse_args(argv)
    targets = [t for t in TARGETS if not args.target or t.name in args.target]
    RESULTS.mkdir(parents=True, exist_ok=True)
    records_path = RESULTS / "mutants.jsonl"
    equivalent = json.loads((RESULTS / "equivalent.json").read_text()) \
        if (RESULTS / "equivalent.json").exists() else {}

    if args.list:
        for t in targets:
            ms = mutants_of((ROOT / t.path).read_text(), t.functions)
            print(f"== {t.name}: {len(ms)} mutants")
            for m in ms:
                print(f"  {m.line:4d} {m.kind:<14} {m.original[:60]!r} -> {m.text[:40]!r}")
        return 0
    if not args.summary:
        _run(targets, records_path, args)
    rows = summarize(targets, _load(records_path), equivalent)
    print_table(rows)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.results import machine  # the record fields every result file has
    from megatron_xdistill.demo.provenance import commit

    summary = {"machine": machine(), "commit": commit(),
               "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "command": "python tools/mutate.py " + " ".join(argv or sys.argv[1:]),
               "rows": rows}
    if not args.target:
        (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(r["percent"] is not None and r["percent"] >= 90.0 for r in rows) else 1


def _run(targets: list[Target], records_path: Path, args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="mutate-"))
    # Numba's cache outside the tree, kept between runs (see Workspace.write).
    os.environ["NUMBA_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "mutate-numba-cache")
    os.environ["PYTHONPYCACHEPREFIX"] = str(work / "pyc")
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(ROOT))
    _preload()
    baseline_path = RESULTS / "baseline.json"
    baseline = json.loads(baseline_path.read_text()) if baseline_path.exists() else {}
    for t in targets:
        tests = tuple(x for x in t.tests if (ROOT / x.split("::")[0]).exists())
        if args.baseline or t.name not in baseline:
            outcome, sec = _run_tests(tests, work / f"{t.name}.base.log", 3600)
            print(f"baseline {t.name}: {outcome} in {sec:.1f} s", flush=True)
            if outcome != "survived":
                print((work / f"{t.name}.base.log").read_text()[-3000:])
                raise SystemExit(f"the tests of {t.name} fail on the original: fix that first")
            baseline[t.name] = round(sec, 1)
            baseline_path.write_text(json.dumps(baseline, indent=1) + "\n")
        timeout = args.timeout or 3 * baseline[t.name] + 30
        source = (ROOT / t.path).read_bytes()
        sha = hashlib.sha256(source).hexdigest()[:16]
        records = _load(records_path)
        ws = Workspace(ROOT / t.path)
        assert ws.original == source
        mutants = selected(t, mutants_of(source.decode(), t.functions))
        todo = [m for m in mutants if (sha, m.key) not in records or (
            args.retry_survivors and records[(sha, m.key)]["outcome"] == "survived")]
        print(f"== {t.name}: {len(mutants)} mutants, {len(todo)} to run "
              f"(timeout {timeout:.0f} s)", flush=True)
        for n, m in enumerate(todo, 1):
            data = source[:m.start] + m.text.encode() + source[m.end:]
            try:
                ws.write(data)
                outcome, sec = _run_tests(tests, work / "mutant.log", timeout)
            finally:
                ws.restore()
            rec = {"target": t.name, "source_sha": sha, "key": m.key, "line": m.line,
                   "kind": m.kind, "original": m.original, "mutated": m.text,
                   "outcome": outcome, "seconds": round(sec, 1)}
            if outcome == "survived":
                rec["log_tail"] = (work / "mutant.log").read_text(errors="replace")[-300:]
            with records_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"[{t.name} {n}/{len(todo)}] {outcome:<8} {sec:5.1f}s  line {m.line} "
                  f"{m.kind}: {m.original[:50]!r}", flush=True)
        assert (ROOT / t.path).read_bytes() == source, f"{t.path} not restored"


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: restore the file
    sys.exit(main())
