"""How one loss call lays out its work: the chunk rows of a rank and their blocks of positions
(:mod:`.chunk_rows`, sized by :mod:`.block_size`), what a kernel reads of a block
(:mod:`.block_data`), the W entries the column kernels read (:mod:`.block_entries`) and this TP
rank's rows of W (:mod:`.shard`)."""
