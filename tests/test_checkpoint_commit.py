"""Checkpoint folders written by several ranks appear whole or not at all (models and training
checkpoints share one commit: models.model_checkpoint.write_collectively)."""

from __future__ import annotations

import os

from megatron_xdistill.testing.multirank import RankPool


def _commit(root: str, fail_rank: int | None) -> str:
    import torch.distributed as dist

    from megatron_xdistill.models.model_checkpoint import write_collectively
    from megatron_xdistill.storage import write_text_atomic

    rank = dist.get_rank()

    def write(tmp: str) -> None:
        with open(os.path.join(tmp, f"part{rank}"), "w") as fh:
            fh.write(str(rank))
        if rank == fail_rank:
            raise OSError(f"disk full on rank {rank}")

    final = os.path.join(root, "iter_0000002")
    try:
        write_collectively(final, write, replace=True, after_commit=lambda: write_text_atomic(
            os.path.join(root, "latest_checkpointed_iteration.txt"), "2"))
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_a_rank_that_fails_stops_all_and_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "run"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "iter_0000002" / "old").write_text("previous")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    with RankPool(2) as ranks:
        failed = ranks.run(_commit, str(root), 1)
        assert failed[1] == "OSError: disk full on rank 1"
        assert "failed on another rank; nothing was written" in failed[0]
        assert sorted(os.listdir(root / "iter_0000002")) == ["old"]  # the previous one stays
        assert not (root / "iter_0000002.tmp").exists()
        assert ranks.run(_commit, str(root), None) == ["ok", "ok"]
    assert sorted(os.listdir(root / "iter_0000002")) == ["part0", "part1"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
