"""Capture this process's stdout/stderr at the file-descriptor level, line by line.

Redirecting descriptors 1 and 2 (not just ``sys.stdout``) also catches C/C++ output (gloo, NCCL)
and child processes started while the capture is active (DataLoader workers).
"""

from __future__ import annotations

import codecs
import os
import selectors
import sys
import threading
import time
from collections.abc import Callable

Batch = list[tuple[str, str]]  # (stream name, line without its newline)
_STREAMS = ((1, "stdout"), (2, "stderr"))
_MAX_PARTIAL = 1 << 16  # a longer unterminated line is delivered as it is


class LineCapture:
    """While active, lines written to fds 1 and 2 reach ``sink`` in batches.

    ``sink(batch)`` is called from a reader thread at most every ``interval_s`` (and once more
    on :meth:`stop`); a sink that raises is dropped. With ``tee`` the bytes are also copied to
    the original descriptors (for a Ray worker: its log files, which outlive a killed actor).
    """

    def __init__(self, sink: Callable[[Batch], object], interval_s: float = 0.1,
                 tee: bool = True) -> None:
        self._sink: Callable[[Batch], object] | None = sink
        self._interval = interval_s
        self._tee = tee
        self._saved: dict[int, int] = {}
        self._readers: dict[int, str] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LineCapture:
        """Point fds 1 and 2 at pipes and start the reader thread."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, name in _STREAMS:
            self._saved[fd] = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            self._readers[read_end] = name
        self._thread = threading.Thread(target=self._read, name="xdistill-log-capture",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Restore fds 1 and 2, deliver what was written so far (partial lines included)."""
        if self._thread is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
        self._stopping.set()
        self._thread.join(timeout_s)
        self._thread = None
        for fd in [*self._readers, *self._saved.values()]:
            os.close(fd)
        self._readers.clear()
        self._saved.clear()

    def __enter__(self) -> LineCapture:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read(self) -> None:
        selector = selectors.DefaultSelector()
        decoders = {}
        partial = {}
        for fd, name in self._readers.items():
            selector.register(fd, selectors.EVENT_READ, name)
            decoders[name] = codecs.getincrementaldecoder("utf-8")(errors="replace")
            partial[name] = ""
        saved_by_name = {name: self._saved[fd] for fd, name in _STREAMS}
        batch: Batch = []
        last_flush = time.monotonic()
        while True:
            # Once stopping, keep reading only while data is still arriving.
            events = selector.select(0.02 if self._stopping.is_set() else self._interval)
            for key, _ in events:
                data = os.read(key.fd, 1 << 16)
                name = key.data
                if not data:
                    selector.unregister(key.fd)
                    continue
                if self._tee:
                    _write_all(saved_by_name[name], data)
                lines = (partial[name] + decoders[name].decode(data)).split("\n")
                partial[name] = _overwritten(lines.pop())
                if len(partial[name]) > _MAX_PARTIAL:
                    lines.append(partial[name])
                    partial[name] = ""
                batch.extend((name, _overwritten(line.rstrip("\r"))) for line in lines)
            done = (self._stopping.is_set() and not events) or not selector.get_map()
            if done:
                batch.extend((name, rest) for name, rest in partial.items() if rest)
            if batch and (done or time.monotonic() - last_flush >= self._interval):
                self._deliver(batch)
                batch = []
                last_flush = time.monotonic()
            if done:
                selector.close()
                return

    def _deliver(self, batch: Batch) -> None:
        if self._sink is None:
            return
        try:
            self._sink(batch)
        except Exception:  # a broken sink must not take the rank down; the tee still has it
            self._sink = None


def _overwritten(line: str) -> str:
    """What a terminal shows of a line redrawn with carriage returns (progress bars)."""
    return line[line.rfind("\r") + 1:]


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass
