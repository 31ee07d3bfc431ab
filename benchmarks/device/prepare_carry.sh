#!/usr/bin/env bash
# Prepare what the lent GPU machine lacks (run here, on the CPU machine, before a device session):
#   .whl/        wheels for its Python 3.12 of what the image does not hold (see the device tool's
#                KINDS.md package list): megatron-core (the training path), omegaconf and its
#                antlr4 runtime (--teachers-config; antlr4 4.9 has no wheel on PyPI: built here,
#                pure Python)
#   .devassets/  the shared assets the GPU tests and benchmarks read: the tokenizers of the demo
#                pair and of Gemma 3 (bench_teachers' second teacher) and the enwiki texts
#                (../shared does not travel; the carry limit is 64 MiB; models are too large:
#                the benchmarks there use --random-weights, published architectures)
# Both are git-ignored; name them in the device call's `carry`. Then run
#   benchmarks/device/checks.sh   on the device (see its header for the call).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
WHEELS=(megatron-core==0.19.2 omegaconf==2.3.1)
rm -rf .whl && mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "$spec"
done
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
rm -rf .devassets && mkdir -p .devassets/tokenizers .devassets/corpora
cp -r ../shared/assets/tokenizers/{smollm2,qwen2,gemma3} .devassets/tokenizers/
cp ../shared/assets/corpora/enwiki_*.jsonl .devassets/corpora/
du -sh .whl .devassets
echo "carry: [\".whl\", \".devassets\"]"
