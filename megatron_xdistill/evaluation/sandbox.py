"""Running model-written Python (HumanEval completions and their tests) away from everything else.

Each program runs in its own process (a fresh ``python -I``), in a new temporary directory that
is its working directory, ``HOME`` and ``TMPDIR`` and is removed afterwards, with:

* limits (``resource.setrlimit``): CPU seconds, address space, file size, no core files; a
  wall-clock limit in the parent kills the whole process group (a program that sleeps);
* no network: a new network namespace (``unshare(CLONE_NEWNET)``, inside a new user namespace
  where the process is not root) where the OS allows it -- :func:`network_isolation` says
  whether it does, and the first run logs a warning when it does not;
* an audit hook installed before the program's first line (``sys.addaudithook``; Python code
  cannot remove one): writing, deleting or renaming a file outside the directory, sockets,
  starting processes, signalling other processes and loading C libraries with ``ctypes`` raise
  ``PermissionError`` -- the containment that holds also where namespaces are not allowed.

The training run, its files and the evaluating process are out of reach; the result says
how the program ended: ``passed`` (exit 0), ``failed``, ``timed out`` or ``out of memory``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

#: runs first in the child: the audit hook (see the module docstring); BASE is the program's dir
_GUARD = r'''
import os, sys
BASE = os.path.realpath(os.getcwd())
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _inside(path):
    try:
        path = os.fsdecode(path) if not isinstance(path, int) else None
    except TypeError:
        return False
    if path is None:
        return True  # an already open descriptor
    full = os.path.realpath(os.path.join(BASE, path))
    return full == BASE or full.startswith(BASE + os.sep)

PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
               "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree",
               "shutil.copyfile", "shutil.move", "os.replace"}
BLOCKED = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.__new__",
           "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym",
           "os.chdir", "pty.spawn"}

def _hook(event, args):
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in PATH_EVENTS:
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path):
                raise PermissionError(f"sandbox: {event} {path!r} outside the sandbox directory")
    elif event in BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")

sys.addaudithook(_hook)
del _hook
_source = open(sys.argv[1]).read()
exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use: CPU seconds, wall seconds, address space and file size."""

    cpu_seconds: float = 10.0
    wall_seconds: float = 20.0
    memory_mb: int = 1024
    file_mb: int = 16


@dataclass(frozen=True)
class SandboxResult:
    status: str  # "passed", "failed", "timed out", "out of memory"
    returncode: int | None
    output: str  # the end of stdout + stderr
    network_isolated: bool

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _unshare(flags: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(flags) == 0


def _enter_new_network() -> bool:
    """A new network namespace (only loopback, down) for this process: directly where it may,
    else inside a new user namespace."""
    return _unshare(_CLONE_NEWNET) or _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)


@functools.lru_cache(maxsize=1)
def network_isolation() -> bool:
    """Whether this machine lets a process enter a new network namespace (probed once, in a
    child process)."""
    probe = ("import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             f"sys.exit(0 if libc.unshare({_CLONE_NEWNET}) == 0 or "
             f"libc.unshare({_CLONE_NEWUSER | _CLONE_NEWNET}) == 0 else 1)")
    try:
        ok = subprocess.run([sys.executable, "-I", "-c", probe], timeout=30,
                            capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        log.warning("sandbox: this machine does not allow a network namespace (unshare "
                    "CLONE_NEWNET, also not in a user namespace): generated code runs without "
                    "one; its audit hook still refuses sockets")
    return ok


def _child_setup(limits: SandboxLimits, isolate: bool) -> None:
    """In the child before ``exec``: its own session (killed as a group), limits, network."""
    os.setsid()
    cpu = max(1, int(limits.cpu_seconds + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    files = limits.file_mb << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolate and not _enter_new_network():
        os._exit(97)  # the probe said it works: refuse to run unisolated instead


def run_program(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``source`` as a Python program in the sandbox; how it ended."""
    isolate = network_isolation()
    workdir = tempfile.mkdtemp(prefix="xdistill_sandbox_")
    try:
        with open(os.path.join(workdir, "program.py"), "w") as fh:
            fh.write(source)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
               "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _GUARD, "program.py"], cwd=workdir, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(_child_setup, limits, isolate))
        try:
            out, _ = proc.communicate(timeout=limits.wall_seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            timed_out = True
        text = out.decode("utf-8", errors="replace")[-2000:]
        code = proc.returncode
        if timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL):
            status = "timed out"
        elif code == 0:
            status = "passed"
        elif "MemoryError" in text:
            status = "out of memory"
        else:
            status = "failed"
        return SandboxResult(status, code, text, isolate)
    finally:
        try:  # anything the program started in its session goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, UnboundLocalError):
            pass
        shutil.rmtree(workdir, ignore_errors=True)
