"""The metrics file is strict JSON, the progress line carries a timestamp and the iteration
time, and TensorBoard gets Megatron-LM's tag names beside ours."""

from __future__ import annotations

import json
import math

from megatron_xdistill.training.metrics import MetricsWriter, format_line, tensorboard_scalars


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_null_in_the_metrics_file(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), None, enabled=True)
    writer.write({"iteration": 3, "train_iters": 10, "kd": math.nan, "ce": 2.5,
                  "top1_agree": math.inf, "elapsed_ms_per_iteration": 812.5})
    writer.close()
    record = _strict(path.read_text().splitlines()[0])
    assert record["kd"] is None and record["top1_agree"] is None and record["ce"] == 2.5
    line = capsys.readouterr().out.strip()
    assert line.startswith("[20") and "] iteration 3/10 | " in line
    assert "elapsed_ms_per_iteration 812.5000" in line


def test_megatron_tag_names_beside_ours():
    scalars = tensorboard_scalars({"iteration": 5, "time": 1.0, "ce": 2.0, "lr": 1e-4,
                                   "grad_norm": 0.5, "kd": math.nan, "eval_ce": 2.2,
                                   "elapsed_ms_per_iteration": 1500.0})
    assert scalars["lm loss"] == 2.0 and scalars["ce"] == 2.0
    assert scalars["learning-rate"] == 1e-4 and scalars["grad-norm"] == 0.5
    assert scalars["lm loss validation"] == 2.2
    assert scalars["iteration-time"] == 1.5  # seconds, as Megatron-LM logs it
    assert "kd" not in scalars and "iteration" not in scalars and "time" not in scalars


def test_progress_line_without_time_has_no_stamp():
    assert format_line({"iteration": 1, "ce": 1.0}) == "iteration 1 | ce 1.0000"


class _FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.finished = init, [], False

    def log(self, scalars, step):
        self.logged.append((step, dict(scalars)))

    def finish(self):
        self.finished = True


def test_wandb_gets_the_tensorboard_scalars_at_each_step(tmp_path, monkeypatch):
    """--wandb-project / --wandb-exp-name / --wandb-save-dir reach wandb.init; each record is
    logged at its iteration with the same tags as TensorBoard (ours and Megatron-LM's)."""
    import sys
    import types

    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    save = tmp_path / "wandb"
    writer = MetricsWriter(None, None, enabled=True,
                           wandb={"project": "xd", "name": "exp", "dir": str(save),
                                  "entity": None, "config": {"lr": 1e-4}})
    writer.write({"iteration": 7, "ce": 2.0, "kd": math.nan, "lr": 1e-4})
    writer.close()
    (run,) = runs
    assert run.init == {"project": "xd", "name": "exp", "dir": str(save),
                        "config": {"lr": 1e-4}} and save.is_dir()
    assert run.logged == [(7, {"ce": 2.0, "lm loss": 2.0, "lr": 1e-4, "learning-rate": 1e-4})]
    assert run.finished
    disabled = MetricsWriter(None, None, enabled=False, wandb={"project": "xd"})
    disabled.write({"iteration": 1, "ce": 1.0})  # other ranks: nothing
    assert len(runs) == 1


def test_wandb_missing_says_how_to_install(monkeypatch):
    import sys

    import pytest

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RuntimeError, match="pip install wandb"):
        MetricsWriter(None, None, enabled=True, wandb={"project": "xd"})


def test_tensorboard_missing_says_which_extra_installs_it(monkeypatch, tmp_path):
    """--tensorboard-dir without the package: one line naming the extra, before a writer opens."""
    import sys

    import pytest

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    line = ("--tensorboard-dir needs the tensorboard package: pip install "
            "'megatron-xdistill[tensorboard]' (or pip install tensorboard)")
    with pytest.raises(RuntimeError) as exc:
        MetricsWriter(None, str(tmp_path / "tb"), enabled=True)
    assert str(exc.value) == line
    assert not (tmp_path / "tb").exists()
    # the same line for a check before the run starts (argument checks)
    from megatron_xdistill.training.metrics import missing_writer_package

    assert missing_writer_package(str(tmp_path / "tb"), None) == line
    assert missing_writer_package(None, None) is None  # not asked for: not needed


def test_the_tensorboard_extra_is_declared():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["tensorboard"] == ["tensorboard"]
