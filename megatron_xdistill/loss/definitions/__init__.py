"""The losses' definitions, written once and backend-free: the constants and the next-token
shift (:mod:`.common`), the per-chunk formulas (:mod:`.formulas`), the dense single-process
reference every implementation must equal (:mod:`.reference`), what the teacher ships
(:mod:`.payload`) and the chunk-start transforms of ``--kd-first-token`` (:mod:`.chunk_starts`)."""
