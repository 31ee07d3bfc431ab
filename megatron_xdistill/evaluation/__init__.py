"""evaluation stage: held-out bits per byte of a Megatron checkpoint, a training run or a Hugging
Face folder, comparable across tokenizers (``xdistill-evaluate``; :mod:`.bits_per_byte`)."""
