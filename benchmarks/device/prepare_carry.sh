#!/usr/bin/env bash
# Prepare what the lent GPU machine lacks (run here, on the CPU machine, before a device session):
#   .whl/        wheels for its Python 3.12: megatron-core, the one package the training path needs
#                that the image does not hold (see the device tool's KINDS.md package list)
#   .devassets/  the shared assets the GPU tests and benchmarks read: the demo pair's tokenizers
#                and the enwiki texts (../shared does not travel; the carry limit is 64 MiB; models
#                are too large: the GPU benchmarks use --random-weights, published architectures)
# Both are git-ignored; name them in the device call's `carry`. Then run
#   benchmarks/device/checks.sh   on the device (see its header for the call).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
WHEELS=(megatron-core==0.19.2)  # omegaconf (--config only) needs an sdist-only antlr4 4.9
rm -rf .whl && mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "$spec"
done
rm -rf .devassets && mkdir -p .devassets/tokenizers .devassets/corpora
cp -r ../shared/assets/tokenizers/smollm2 ../shared/assets/tokenizers/qwen2 .devassets/tokenizers/
cp ../shared/assets/corpora/enwiki_*.jsonl .devassets/corpora/
du -sh .whl .devassets
echo "carry: [\".whl\", \".devassets\"]"
