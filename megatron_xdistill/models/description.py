"""A checkpoint's model description: ``xdistill_model.json`` beside the tensors, or a Megatron-LM
run's ``args`` in its common state; the tracker of a training root; the tokenizer it fits.

Reading it needs neither torch.distributed nor Megatron-Core (those are imported only for a
Megatron-LM checkpoint without the JSON), so a run checks its models' shapes against its layouts
in a moment, before anything is built (``training.preflight``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_xdistill.mcore.importable import make_megatron_importable
from megatron_xdistill.models.hf_config import ModelInfo
from megatron_xdistill.models.megatron_lm import (
    TRACKER_FILE,
    TrackerError,
    model_info_from_megatron_args,
    read_tracker,
    tracked_folder,
)
from megatron_xdistill.storage import write_json_atomic

MODEL_INFO_FILE = "xdistill_model.json"
FORMAT = "megatron-xdistill/model"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete, or not one of ours."""


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's folder of one iteration's checkpoint under a training root."""
    return tracked_folder(root, iteration)


def _tracked(root: str) -> str | int | None:
    try:
        return read_tracker(root)
    except TrackerError as err:
        raise CheckpointError(str(err)) from None


def tracked_iteration(root: str) -> int | None:
    """The iteration that ``root``'s tracker file names (Megatron-LM's
    ``latest_checkpointed_iteration.txt``, written last by a save), or None without one or for
    a ``release`` tracker (a released model, not a run to resume)."""
    tracked = _tracked(root)
    return tracked if isinstance(tracked, int) else None


def resolve_checkpoint_dir(path: str) -> str:
    """The dist_checkpointing directory behind ``path`` (a training root -> its tracked
    ``iter_N`` or ``release`` folder)."""
    tracked = _tracked(path)
    if tracked is not None:
        path = tracked_folder(path, tracked)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not is_distributed_checkpoint(path):
        raise CheckpointError(f"{path}: not a complete dist_checkpointing checkpoint "
                              "(no metadata.json); was the write interrupted?")
    return path


def is_distributed_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a complete dist_checkpointing checkpoint: its ``metadata.json``
    (written last) is there and readable, as Megatron-Core's own check asks."""
    try:
        with open(os.path.join(path, "metadata.json")) as fh:
            return isinstance(json.load(fh), dict)
    except (OSError, ValueError):
        return False


def _info_path(path: str) -> str | None:
    if not os.path.isdir(path):  # named as missing, not as a folder that is no checkpoint
        raise CheckpointError(f"no such directory: {path}" if not os.path.exists(path) else
                              f"{path} is a file; a checkpoint is a directory")
    candidates = [os.path.join(path, MODEL_INFO_FILE)]
    if os.path.isfile(os.path.join(path, TRACKER_FILE)):
        candidates.insert(0, os.path.join(resolve_checkpoint_dir(path), MODEL_INFO_FILE))
    else:  # an iteration folder: the description sits at its training root; a root's parent
        # is another folder (a Megatron-LM root there is described by its own args)
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(path)), MODEL_INFO_FILE))
    return next((c for c in candidates if os.path.isfile(c)), None)


def save_model_info(info: ModelInfo, ckpt_dir: str, extra: dict[str, Any] | None = None) -> str:
    """Write ``xdistill_model.json`` into ``ckpt_dir`` (atomically); returns its path."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, MODEL_INFO_FILE)
    write_json_atomic(path, {"format": FORMAT, "version": FORMAT_VERSION,
                             "model_info": info.to_dict(), **(extra or {})},
                      indent=2, sort_keys=True)
    return path


def read_model_json(path: str) -> dict[str, Any]:
    """The whole ``xdistill_model.json`` of a checkpoint (model info plus conversion notes)."""
    info_path = _info_path(path)
    if info_path is None:
        raise CheckpointError(
            f"{path}: no {MODEL_INFO_FILE} and no Megatron-LM 'args' in its common state; not a "
            "megatron-xdistill or Megatron-LM checkpoint (create one with "
            "`xdistill-convert hf-to-mcore`)")
    try:
        with open(info_path) as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{info_path}: not valid JSON ({err}); the checkpoint's model "
                              f"description is damaged: convert the model again") from None
    if not isinstance(data, dict) or "model_info" not in data:
        raise CheckpointError(f"{info_path}: no 'model_info'; the checkpoint's model description "
                              f"is damaged: convert the model again")
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{info_path}: format {data.get('format')!r}, expected {FORMAT!r}")
    if int(data.get("version", 0)) > FORMAT_VERSION:
        raise CheckpointError(f"{info_path}: version {data['version']} is newer than this code "
                              f"({FORMAT_VERSION})")
    return data


def load_model_info(path: str) -> ModelInfo:
    """ModelInfo of a checkpoint (a converted checkpoint, or a training root / iteration): its
    ``xdistill_model.json``, or else the Megatron-LM run's ``args`` in its common state."""
    tracked = os.path.isfile(os.path.join(path, TRACKER_FILE))
    if _info_path(path) is None and (tracked or is_distributed_checkpoint(path)):
        ckpt = resolve_checkpoint_dir(path)
        make_megatron_importable()
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import (
            CheckpointException as TorchCheckpointException,
        )

        try:
            common = dist_checkpointing.load_common_state_dict(ckpt)
        # torch's CheckpointException (a failed read) is a BaseException
        except (Exception, TorchCheckpointException) as err:  # noqa: BLE001 - name the checkpoint
            raise CheckpointError(
                f"{ckpt}: no {MODEL_INFO_FILE}, and its common state (Megatron-LM's args) cannot "
                f"be read here ({_first_cause(err)}); it may need a module of the "
                f"Megatron-LM version that wrote it. Convert the model from HF instead "
                f"(`xdistill-convert hf-to-mcore`)") from err
        if isinstance(common, dict) and "args" in common:
            return model_info_from_megatron_args(common["args"], ckpt)
    return ModelInfo.from_dict(read_model_json(path)["model_info"])


#: A model's embedding may have more rows than its tokenizer has tokens (padded to a multiple,
#: reserved ids: Qwen2.5 151,936 for 151,665 tokens), but not this many times as many.
VOCAB_SLACK = 1.1


def check_tokenizer_fits(info: ModelInfo, tokenizer_size: int, checkpoint: str,
                         tokenizer: str, who: str) -> None:
    """Refuse a checkpoint whose vocabulary is not its tokenizer's: more tokens than embedding
    rows (ids would index past the embedding), or far fewer (another tokenizer)."""
    size = info.vocab_size
    if tokenizer_size > size or size > VOCAB_SLACK * tokenizer_size:
        raise CheckpointError(
            f"the {who} checkpoint {checkpoint} has a vocabulary of {size} but its tokenizer "
            f"{tokenizer} has {tokenizer_size} tokens: they do not belong together (pass the "
            f"tokenizer the model was trained with)")


def _first_cause(err: BaseException) -> str:
    """One line for an error: torch's CheckpointException carries each rank's own."""
    failures = getattr(err, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:500]


__all__ = ["FORMAT", "FORMAT_VERSION", "MODEL_INFO_FILE", "VOCAB_SLACK", "CheckpointError",
           "check_tokenizer_fits", "is_distributed_checkpoint", "iteration_dir",
           "load_model_info", "read_model_json", "resolve_checkpoint_dir", "save_model_info",
           "tracked_iteration"]
