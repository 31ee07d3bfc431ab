"""storage stage: files and folders written whole or not at all (used by every later stage)."""

from megatron_xdistill.storage.atomic import (
    atomic_directory,
    atomic_file,
    refuse_existing,
    swap_in_directory,
    write_json_atomic,
    write_text_atomic,
)

__all__ = ["atomic_directory", "atomic_file", "refuse_existing", "swap_in_directory", "write_json_atomic", "write_text_atomic"]
