"""Bad input is refused with a message that names the file and says what was expected."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from scratch import scratch_dir
from shared_assets import TOKENIZERS, needs_shared_assets

from megatron_xdistill.data.packing import load_documents
from megatron_xdistill.data.sources import DataSource, read_documents


# ---------------------------------------------------------------------------- data
def test_non_utf8_bytes_in_a_jsonl_file_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not UTF-8 .*re-encode the file"):
        read_documents(str(path))


def test_no_documents_and_empty_texts_name_the_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"no documents in \[.*empty.jsonl'\]"):
        load_documents([DataSource(str(empty))], "text")
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": "  "}\n')
    with pytest.raises(ValueError, match=r"every document in .*blank.jsonl.* is empty \(field "
                                         r"'text'\); is --text-field"):
        load_documents([DataSource(str(blank))], "text")
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "some text"}\n')
    with pytest.raises(ValueError, match=r"blank.jsonl: no text .* weight 0.5"):
        load_documents([DataSource(str(good), 0.5), DataSource(str(blank), 0.5)], "text")
    docs, counts = load_documents([DataSource(str(good)), DataSource(str(blank))], "text")
    assert docs[0] == "some text" and counts == [1, 2]  # unweighted: empty ones are skipped


# ---------------------------------------------------------------------------- projection
def _projection(tmp_path):
    from megatron_xdistill.projection.fileio import write_projection_file

    path = tmp_path / "proj.safetensors"
    write_projection_file(path, {"indices": torch.zeros(40, 4, dtype=torch.int32),
                                 "weights": torch.ones(40, 4)}, {"student_vocab_size": "40",
                                                                 "teacher_vocab_size": "9"})
    return path


def test_truncated_projection_file_is_named(tmp_path):
    from megatron_xdistill.projection import load_projection

    path = _projection(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"proj.safetensors: truncated or corrupt projection "
                                         r"file .*xdistill-projection build"):
        load_projection(path)


def test_a_file_that_is_no_projection_is_named(tmp_path):
    from megatron_xdistill.projection import load_projection

    path = tmp_path / "proj.pt"
    for seed in range(64):  # random bytes fail torch's unpickler in many ways (IndexError, ...)
        path.write_bytes(random.Random(seed).randbytes(300))
        with pytest.raises(ValueError, match=r"proj.pt: cannot be unpickled"):
            load_projection(path)


# ---------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def converted(request, tmp_path_factory):
    from conversion import convert_hf_to_mcore
    from megatron_xdistill.testing.multirank import RankPool
    from megatron_xdistill.testing.tiny_models import make_tiny_model

    root = scratch_dir(request, tmp_path_factory, "bad_ckpt")
    hf = make_tiny_model("smollm2", str(root / "hf"), seed=1)
    with RankPool(1) as pool:
        pool.run(convert_hf_to_mcore, hf, str(root / "ckpt"))
    return root


def test_damaged_model_description_is_named(converted, tmp_path):
    import shutil

    from megatron_xdistill.models import CheckpointError, load_model_info

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted / "ckpt", ckpt)
    (ckpt / "xdistill_model.json").write_text('{"format": "xdistill-mcore", "model_in')
    with pytest.raises(CheckpointError, match=r"xdistill_model.json: not valid JSON .*convert"):
        load_model_info(str(ckpt))
    (ckpt / "xdistill_model.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(CheckpointError, match=r"no 'model_info'"):
        load_model_info(str(ckpt))


def test_partial_checkpoint_is_named(converted, tmp_path):
    import shutil

    from conversion import verify_conversion
    from megatron_xdistill.testing.multirank import RankError, RankPool

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted / "ckpt", ckpt)
    shards = sorted((ckpt / "release").glob("*.distcp"))  # a Megatron-LM release root
    assert shards, list(ckpt.iterdir())
    shards[0].unlink()  # a save cut short by a kill
    with RankPool(1) as pool, pytest.raises(
            RankError, match=r"ckpt/release: cannot load the model from this checkpoint "
                             r".*incomplete"):
        pool.run(verify_conversion, str(converted / "hf"), str(ckpt), 1, 1, 1, 8, 0, False)
    (ckpt / "release" / "metadata.json").unlink()
    with RankPool(1) as pool, pytest.raises(RankError, match=r"not a complete "
                                                             r"dist_checkpointing checkpoint"):
        pool.run(verify_conversion, str(converted / "hf"), str(ckpt), 1, 1, 1, 8, 0, False)


@needs_shared_assets
def test_checkpoint_and_tokenizer_of_different_vocabularies_are_refused(converted):
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.models import CheckpointError, check_tokenizer_fits, load_model_info

    info = load_model_info(str(converted / "ckpt"))  # SmolLM2's 49,152
    own = load_tokenizer(os.path.join(TOKENIZERS, "smollm2"))
    check_tokenizer_fits(info, len(own), "ckpt", "smollm2", "student")
    for name, size in (("qwen2", 151936), ("mistral", 32000)):
        tok = load_tokenizer(os.path.join(TOKENIZERS, name))
        with pytest.raises(CheckpointError, match=rf"student checkpoint ckpt has a vocabulary of "
                                                  rf"49152 but its tokenizer {name} has {size}"):
            check_tokenizer_fits(info, len(tok), "ckpt", name, "student")


def test_a_run_refuses_a_tokenizer_that_is_not_the_checkpoints(e2e_setup):
    """pretrain_xdistill with the teacher's tokenizer given for the student stops before any
    model is built: exit code 2 from its main on the rank (the line it prints, naming the
    checkpoint, the tokenizer and both sizes: tests/test_user_path.py)."""
    from test_e2e import _argv, _run_main

    from megatron_xdistill.testing.multirank import RankPool

    root, s_tok, t_tok = e2e_setup
    argv = _argv(root, s_tok, t_tok, "wrong_tokenizer", [])
    argv[argv.index("--tokenizer-model") + 1] = str(t_tok)
    with RankPool(1) as pool:
        assert pool.run(_run_main, argv) == [2]
