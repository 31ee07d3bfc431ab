"""Ray launcher pieces that need no Ray: rank layout, environments, CLI checks, output capture."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from megatron_xdistill.launch.cli import build_parser, entry_arguments, main
from megatron_xdistill.launch.config import DEFAULT_ENTRY_POINT
from megatron_xdistill.launch.rank_env import (
    assign_ranks,
    forwarded_env,
    parse_entry_point,
    rank_env,
    visible_devices,
)


def test_ranks_are_contiguous_per_node():
    specs = assign_ranks(num_nodes=3, ranks_per_node=2)
    assert [s.rank for s in specs] == list(range(6))
    assert [(s.group_rank, s.local_rank) for s in specs] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert {(s.world_size, s.local_world_size, s.num_nodes) for s in specs} == {(6, 2, 3)}
    with pytest.raises(ValueError):
        assign_ranks(0, 2)


def test_rank_env_is_torchruns():
    spec = assign_ranks(2, 4)[6]
    env = rank_env(spec, "10.0.0.1", 29500, restart_count=1, max_restarts=2)
    assert env == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                   "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "6",
                   "ROLE_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                   "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2"}


def test_visible_devices_list_the_node_in_local_rank_order():
    # Ray gave local ranks 0..2 GPUs 5, 2, 7: device LOCAL_RANK of the list is each rank's own.
    assert visible_devices([["5"], ["2"], ["7"]]) == "5,2,7"
    assert visible_devices([[], []]) is None
    with pytest.raises(ValueError):
        visible_devices([["0", "1"], ["2", "3"]])


def test_forwarded_env():
    driver = {"NCCL_DEBUG": "INFO", "HF_HOME": "/hf", "HOME": "/root", "RANK": "3",
              "SECRET": "x", "PYTHONPATH": "/src"}
    env = forwarded_env(driver, ["PYTHONPATH", "FOO=bar=baz"])
    assert env == {"NCCL_DEBUG": "INFO", "HF_HOME": "/hf", "PYTHONPATH": "/src",
                   "FOO": "bar=baz", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    assert forwarded_env({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"
    with pytest.raises(ValueError, match="not set"):
        forwarded_env(driver, ["MISSING"])
    with pytest.raises(ValueError, match="launcher"):
        forwarded_env(driver, ["RANK=1"])


def test_parse_entry_point():
    assert parse_entry_point("megatron_xdistill.training.run:main") == (
        "megatron_xdistill.training.run", "main")
    for bad in ("module", "module:", ":main", "a:b.c"):
        with pytest.raises(ValueError):
            parse_entry_point(bad)


@pytest.mark.parametrize("argv, message", [
    (["--num-nodes", "2", "--gpus-per-node", "0"], "needs --ranks-per-node"),
    (["--num-nodes", "2", "--gpus-per-node", "8", "--ranks-per-node", "4"], "one rank per GPU"),
    (["--num-nodes", "0", "--gpus-per-node", "8"], "--num-nodes"),
    (["--num-nodes", "1", "--gpus-per-node", "1", "--entry-point", "nocolon"], "module.path"),
    (["--num-nodes", "1", "--gpus-per-node", "1", "--env", "WORLD_SIZE=3"], "launcher"),
])
def test_cli_refuses_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--", "--train-iters", "1"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_help_names_the_entry_point_option():
    text = build_parser().format_help()
    assert "--entry-point" in text and "[rank N]" in text


def test_capture_delivers_lines_from_python_c_and_children():
    """fd-level capture: print, os.write, a child, \\r redraws, a partial last line; in order."""
    code = textwrap.dedent("""
        import os, subprocess, sys
        from megatron_xdistill.launch.capture import LineCapture
        got = []
        cap = LineCapture(got.extend, interval_s=0.05).start()
        print("py line")
        os.write(2, b"fd2 line\\n")
        subprocess.run([sys.executable, "-c", "print('child line')"], check=True)
        print("a\\r\\nb")
        print("10%\\r50%\\r100%")
        sys.stdout.write("partial")
        cap.stop()
        print()
        print(repr(got))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    *tee, last = done.stdout.splitlines()
    got = ast.literal_eval(last)
    assert [x for x in got if x[0] == "stdout"] == [
        ("stdout", "py line"), ("stdout", "child line"), ("stdout", "a"), ("stdout", "b"),
        ("stdout", "100%"), ("stdout", "partial")]
    assert [x for x in got if x[0] == "stderr"] == [("stderr", "fd2 line")]
    # tee: the original descriptors still saw everything
    assert tee[:2] == ["py line", "child line"] and "fd2 line" in done.stderr


@pytest.mark.parametrize("after", [
    ["--train-iters", "1", "--save", "runs/x"],
    ["pretrain_xdistill.py", "--train-iters", "1", "--save", "runs/x"],
    ["/src/megatron-xdistill/pretrain_xdistill.py", "--train-iters", "1", "--save", "runs/x"],
    ["python", "pretrain_xdistill.py", "--train-iters", "1", "--save", "runs/x"],
    ["/usr/bin/python3.11", "./pretrain_xdistill.py", "--train-iters", "1", "--save", "runs/x"],
])
def test_what_follows_the_separator_may_name_the_script(after):
    """`xdistill-ray ... -- pretrain_xdistill.py ARGS` as torchrun is called: the script is
    dropped (each rank calls its main in-process), only ARGS reach its parser."""
    assert entry_arguments(after, DEFAULT_ENTRY_POINT) == [
        "--train-iters", "1", "--save", "runs/x"]
    assert entry_arguments([], DEFAULT_ENTRY_POINT) == []


def test_another_entry_point_gets_what_follows_the_separator_as_it_is():
    assert entry_arguments(["out", "--steps", "3"], "tests.ray_entry:main") == [
        "out", "--steps", "3"]


@pytest.mark.parametrize("after, named", [
    (["train.py", "--train-iters", "1"], "'train.py'"),
    (["python", "train.py", "--train-iters", "1"], "'python train.py'"),
])
def test_another_script_is_refused_in_one_line_before_anything_starts(after, named, capsys):
    code = main(["--num-nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "2", "--",
                 *after])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("xdistill-ray: error: "), err
    assert named in err and "arguments of pretrain_xdistill.py" in err
