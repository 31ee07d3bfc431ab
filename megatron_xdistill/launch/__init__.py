"""launch stage of megatron-xdistill (see DESIGN.md): the Ray launcher ``xdistill-ray``.

``cli`` parses the command line, ``runner.launch(LaunchConfig)`` runs a job on a connected Ray
cluster (placement groups, one actor per rank, log streaming, failures, restarts), ``worker``
holds what runs on the cluster, ``layout`` the rank/environment arithmetic and ``capture`` the
per-rank stdout/stderr capture. Only ``runner``, ``worker`` and ``cli.main`` need Ray.
"""

from megatron_xdistill.launch.config import DEFAULT_ENTRY_POINT, LaunchConfig

__all__ = ["DEFAULT_ENTRY_POINT", "LaunchConfig"]
