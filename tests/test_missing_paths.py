"""A missing input path is reported as missing (``no such directory: PATH``), not as a folder of
the wrong kind ("not a megatron-xdistill checkpoint", "no config.json"), by ``xdistill-convert``
and ``xdistill-evaluate``, before any rank starts or model loads."""

from __future__ import annotations

import json

import pytest

from conversion.cli import main as convert
from megatron_xdistill.evaluation.bits_per_byte import main as evaluate
from megatron_xdistill.models import CheckpointError, load_model_info


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_convert_says_a_missing_checkpoint_is_missing(tmp_path, capsys):
    missing = tmp_path / "runs" / "nope"
    assert convert(["mcore-to-hf", "--load", str(missing), "--out", str(tmp_path / "hf")]) == 2
    err = _error(capsys)
    assert f"no such directory: {missing}" in err and "not a megatron-xdistill" not in err
    assert convert(["verify", "--hf-dir", str(tmp_path), "--load", str(missing)]) == 2
    assert f"no such directory: {missing}" in _error(capsys)


def test_convert_keeps_naming_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    assert convert(["mcore-to-hf", "--load", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = _error(capsys)
    assert "not a megatron-xdistill or Megatron-LM checkpoint" in err
    assert "no such directory" not in err


def test_convert_says_a_missing_hf_folder_is_missing(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert convert(["hf-to-mcore", "--hf-dir", str(missing), "--out", str(tmp_path / "c")]) == 2
    err = _error(capsys)
    assert f"no such directory: {missing}" in err and "config.json" not in err
    assert convert(["verify", "--hf-dir", str(missing), "--load", str(tmp_path)]) == 2
    assert f"no such directory: {missing}" in _error(capsys)
    assert convert(["mcore-to-hf", "--load", str(tmp_path), "--out", str(tmp_path / "hf"),
                    "--hf-template", str(missing)]) == 2
    assert f"--hf-template: no such directory: {missing}" in _error(capsys)
    (tmp_path / "empty").mkdir()  # a folder that exists: still named as not an HF folder
    assert convert(["hf-to-mcore", "--hf-dir", str(tmp_path / "empty"), "--out",
                    str(tmp_path / "c")]) == 2
    assert "no config.json (not a Hugging Face model folder)" in _error(capsys)


def test_a_missing_checkpoint_is_missing_wherever_it_is_read(tmp_path):
    with pytest.raises(CheckpointError, match=r"^no such directory: .*nope$"):
        load_model_info(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="not a megatron-xdistill"):
        load_model_info(str(tmp_path))


def test_evaluate_says_missing_inputs_are_missing(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    missing = tmp_path / "runs" / "nope"
    for which in ("--load", "--hf-dir"):
        assert evaluate([which, str(missing), "--tokenizer-model", str(tmp_path),
                         "--data-path", str(data)]) == 2
        err = _error(capsys)
        assert f"{which}: no such directory: {missing}" in err, err
        assert evaluate([which, str(missing), "--data-path", str(data)]) == 2
        assert f"{which}: no such directory: {missing}" in _error(capsys)
    assert evaluate(["--hf-dir", str(tmp_path), "--data-path", str(tmp_path / "none.jsonl")]) == 2
    assert f"--data-path: no such file: {tmp_path / 'none.jsonl'}" in _error(capsys)
