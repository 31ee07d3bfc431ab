"""Bad input reported as one message from one rank, exit code 2, no traceback of ours.

A user error (a wrong path, a projection built for other tokenizers, a data file without the
text field, a TP size that does not divide the heads, ...) would otherwise reach the user as each
rank's traceback with the useful line in the middle. While a run checks and reads its inputs
(:func:`reading_inputs`) the errors that mean bad input become :class:`InputError`, which
``pretrain_xdistill.py`` prints once as ``pretrain_xdistill.py: error: ...`` on stderr and exits
2, as argparse does. ``XDISTILL_TRACEBACK=1`` prints our traceback too. Errors raised later, or
of other types (bugs), keep their tracebacks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator

PROG = "pretrain_xdistill.py"
TRACEBACK_ENV = "XDISTILL_TRACEBACK"


class InputError(Exception):
    """Bad input, said in one message. ``shared``: every rank raises the same one (it comes
    from inputs every rank checks alike, or from rank 0's read broadcast to all), so rank 0
    alone reports it."""

    def __init__(self, message: str, shared: bool = True) -> None:
        super().__init__(message)
        self.shared = shared


def _input_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean bad input while a run reads its inputs: ours are
    ValueError (data, arguments, projection, model configs) and the missing-file family; the
    checkpoint and teacher-cache errors name their file."""
    types: list[type[BaseException]] = [ValueError, FileNotFoundError, NotADirectoryError,
                                         IsADirectoryError, PermissionError]
    for module, name in (("megatron_xdistill.models.description", "CheckpointError"),
                         ("megatron_xdistill.teacher_cache.store", "CacheError")):
        loaded = sys.modules.get(module)  # only a loaded module can have raised it
        if loaded is not None:
            types.append(getattr(loaded, name))
    return tuple(types)


#: Attribute set on an error that rank 0 raised and broadcast to every rank.
SHARED_MARK = "_xdistill_shared"


@contextlib.contextmanager
def reading_inputs(shared: bool = True) -> Iterator[None]:
    """Within the block, errors that mean bad input become :class:`InputError` (its cause
    chained). ``shared``: the block computes the same on every rank (else only errors that
    rank 0 broadcast, marked with ``SHARED_MARK``, are reported by rank 0 alone)."""
    try:
        yield
    except InputError:
        raise
    except _input_error_types() as exc:
        message = str(exc)
        if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
            message = f"{exc.filename}: {exc.strerror}"
        raise InputError(message, shared=shared or getattr(exc, SHARED_MARK, False)) from exc


def report(error: InputError, rank: int | None = None, prog: str = PROG) -> int:
    """Print ``error`` on stderr (rank 0 only when it is shared; another rank prefixes its
    rank) and return the exit code 2. With ``XDISTILL_TRACEBACK=1`` the traceback of its
    cause comes first."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if error.shared and rank != 0:
        wait_for_rank0()
        return 2
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        cause = error.__cause__ or error
        traceback.print_exception(type(cause), cause, cause.__traceback__, file=sys.stderr)
    where = "" if error.shared else f"[rank {rank}] "
    print(f"{prog}: error: {where}{error}", file=sys.stderr, flush=True)
    return 2


#: The longest a rank that does not report an error waits for rank 0 to report and exit.
RANK0_GRACE_S = 60.0


def wait_for_rank0() -> None:
    """Under torchrun, a rank that leaves the reporting of an error to rank 0 waits before it
    exits: torchrun stops every other rank as soon as one exits, so a rank that left first
    could stop rank 0 before its message is out. Rank 0 exits right after reporting, and
    torchrun then ends this wait; elsewhere (one process, a test's rank pool) it returns at
    once."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("RANK", "0")) != 0:
        import time

        time.sleep(RANK0_GRACE_S)


__all__ = ["InputError", "RANK0_GRACE_S", "SHARED_MARK", "TRACEBACK_ENV", "reading_inputs",
           "report", "wait_for_rank0"]
