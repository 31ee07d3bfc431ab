"""storage stage: files and folders written whole or not at all (used by every later stage), and
input paths refused as missing before they are read."""

from megatron_xdistill.storage.atomic import (
    atomic_directory,
    atomic_file,
    follow_umask,
    refuse_existing,
    swap_in_directory,
    write_json_atomic,
    write_text_atomic,
)
from megatron_xdistill.storage.inputs import require_directory, require_file

__all__ = ["atomic_directory", "atomic_file", "follow_umask", "refuse_existing",
           "require_directory", "require_file", "swap_in_directory", "write_json_atomic",
           "write_text_atomic"]
