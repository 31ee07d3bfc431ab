"""``xdistill-ray``: run ``pretrain_xdistill.py`` on a Ray cluster instead of torchrun per node.

    xdistill-ray --num-nodes 2 --gpus-per-node 8 [--address ADDR] -- <pretrain_xdistill.py args>
    xdistill-ray --num-nodes 2 --gpus-per-node 0 --ranks-per-node 4 -- ...   # CPU-only cluster

What follows ``--`` may start with the script, as a torchrun command line does
(``-- pretrain_xdistill.py --load ...`` or ``-- python pretrain_xdistill.py ...``): it is dropped.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence

from megatron_xdistill.launch.config import DEFAULT_ENTRY_POINT, LaunchConfig
from megatron_xdistill.launch.rank_env import forwarded_env, parse_entry_point

_EPILOG = """\
Each rank is a Ray actor that calls the entry point in-process with the environment torchrun
would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT, ...); node g holds ranks g*R .. g*R+R-1. Output is printed with a [rank N] prefix.
When a rank fails, or this command is interrupted, every rank is stopped; the exit status is the
first failing rank's. With --max-restarts the job starts again and the entry point resumes from
its latest checkpoint (pretrain_xdistill.py: pass --save).

Driver variables with the prefixes NCCL_ TORCH_ PYTORCH_ HF_ TRANSFORMERS_ TOKENIZERS_ XDISTILL_
GLOO_ (and CUDA_DEVICE_MAX_CONNECTIONS, OMP_NUM_THREADS) reach every rank; others only with --env.
"""


def build_parser() -> argparse.ArgumentParser:
    """Launcher options (the entry point's arguments follow ``--``)."""
    p = argparse.ArgumentParser(
        prog="xdistill-ray", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --num-nodes N --gpus-per-node G [options] -- [pretrain_xdistill.py] "
              "<its args>")
    p.add_argument("--num-nodes", type=int, required=True, help="nodes (placement groups)")
    p.add_argument("--gpus-per-node", type=int, required=True,
                   help="GPUs (= ranks) per node; 0 for a CPU-only run with --ranks-per-node")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (CPU-only runs; defaults to --gpus-per-node)")
    p.add_argument("--cpus-per-rank", type=float, default=1.0, help="CPUs reserved per rank")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS, a running local cluster, "
                        "or a new local one)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole job this many times after a failure")
    p.add_argument("--master-port", type=int, default=None,
                   help="MASTER_PORT (default: a free port on rank 0's node)")
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="set (or copy from this shell) a variable on every rank; repeatable")
    p.add_argument("--entry-point", default=None, metavar="MODULE:FUNCTION",
                   help="for testing and advanced use: call FUNCTION(argv) -> exit code instead "
                        "of pretrain_xdistill's main")
    p.add_argument("--placement-timeout", type=float, default=600.0,
                   help="seconds to wait for the cluster to hold all nodes' resources")
    p.add_argument("--launch-id", default=None, help="names actors xdistill-ID-rankN")
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


SCRIPT = "pretrain_xdistill.py"
_PYTHON = re.compile(r"python[0-9.]*")


def _is_script(token: str) -> bool:
    return os.path.basename(token) == SCRIPT


def entry_arguments(after: Sequence[str], entry_point: str) -> list[str]:
    """The entry point's arguments from what follows ``--``. For pretrain_xdistill's main they
    may be preceded by the script (``pretrain_xdistill.py``, any path ending so, or ``python
    pretrain_xdistill.py``), as in a torchrun command line: it is dropped, since each rank calls
    the main in-process and its parser takes only the arguments. Anything else that is not a
    flag in the script's place is refused (ValueError) before a rank starts."""
    after = list(after)
    if entry_point != DEFAULT_ENTRY_POINT or not after or after[0].startswith("-"):
        return after
    if _is_script(after[0]):
        return after[1:]
    named = after[0]
    if _PYTHON.fullmatch(os.path.basename(after[0])) and len(after) > 1:
        if _is_script(after[1]):
            return after[2:]
        named = f"{after[0]} {after[1]}"
    raise ValueError(f"after -- come the arguments of {SCRIPT}, optionally preceded by the "
                     f"script ({SCRIPT} --load ...), not {named!r}")


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that cleanup runs."""


def _on_sigterm(_signum: int, _frame: object) -> None:
    raise _Terminated()


def _interrupt_handler(flag: threading.Event):
    """Ctrl-C: remember it (the launcher's wait loop checks ``flag``), then interrupt."""

    def handler(_signum: int, _frame: object) -> None:
        flag.set()
        raise KeyboardInterrupt

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, connect to Ray, run the job; returns the exit status."""
    own, entry_args = _split(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        entry_args = entry_arguments(entry_args, args.entry_point or DEFAULT_ENTRY_POINT)
    except ValueError as exc:  # one line: nothing has started
        print(f"xdistill-ray: error: {exc}", file=sys.stderr)
        return 2
    try:
        config = _config(args, entry_args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        import ray

        from megatron_xdistill.launch.runner import INTERRUPTED, LaunchError, launch
    except ImportError as exc:
        print(f"xdistill-ray: Ray is not installed ({exc}); "
              "pip install 'megatron-xdistill[ray]'", file=sys.stderr)
        return 2
    if (config.max_restarts and config.entry_point == DEFAULT_ENTRY_POINT
            and "--save" not in entry_args):
        print("xdistill-ray: warning: --max-restarts without --save: a restart starts from "
              "--load again", file=sys.stderr)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        ray.init(address=args.address, log_to_driver=False, logging_level=logging.WARNING)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, _interrupt_handler(INTERRUPTED))
        return launch(config)
    except (LaunchError, ConnectionError) as exc:
        print(f"xdistill-ray: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("xdistill-ray: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    except _Terminated:
        print("xdistill-ray: terminated; all ranks stopped", file=sys.stderr)
        return 143
    finally:
        ray.shutdown()


def _config(args: argparse.Namespace, entry_args: list[str]) -> LaunchConfig:
    if args.num_nodes < 1:
        raise ValueError("--num-nodes must be >= 1")
    if args.gpus_per_node < 0:
        raise ValueError("--gpus-per-node must be >= 0")
    if args.gpus_per_node == 0 and not args.ranks_per_node:
        raise ValueError("--gpus-per-node 0 needs --ranks-per-node")
    if args.gpus_per_node and args.ranks_per_node not in (None, args.gpus_per_node):
        raise ValueError("with GPUs there is one rank per GPU: drop --ranks-per-node")
    if args.max_restarts < 0:
        raise ValueError("--max-restarts must be >= 0")
    entry_point = args.entry_point or DEFAULT_ENTRY_POINT
    parse_entry_point(entry_point)
    config = LaunchConfig(
        num_nodes=args.num_nodes, ranks_per_node=args.ranks_per_node or args.gpus_per_node,
        gpus_per_rank=1 if args.gpus_per_node else 0, cpus_per_rank=args.cpus_per_rank,
        entry_args=entry_args, entry_point=entry_point, max_restarts=args.max_restarts,
        master_port=args.master_port, env=forwarded_env(os.environ, args.env),
        placement_timeout_s=args.placement_timeout)
    if args.launch_id:
        config.launch_id = args.launch_id
    return config


if __name__ == "__main__":
    sys.exit(main())
