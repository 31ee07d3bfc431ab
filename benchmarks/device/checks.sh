#!/usr/bin/env bash
# The device session's checks in one call (issue 18 / 21 GPU work), on one H100/H200:
#   run(command="bash benchmarks/device/checks.sh", carry=[".whl", ".devassets"], timeout_s=540)
# after benchmarks/device/prepare_carry.sh here. Each part writes its log under $OUT and is cut
# off by its own time limit, so a slow part cannot take the others' time. Parts: the gpu-marked
# tests (CUDA IPC stream, KV-cached greedy generation vs HF), the loss benchmark on the GPU, the
# step-time benchmark (colocated), on-policy generation speed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDISTILL_SHARED_ASSETS=$PWD/.devassets
TOK=$PWD/.devassets/tokenizers
nvidia-smi -L | tee "$OUT/device.txt"
git rev-parse HEAD >> "$OUT/device.txt" 2>/dev/null
part() {  # part NAME SECONDS COMMAND...: one check, its own log and limit
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s"; tail -n 25 "$OUT/$name.log"
}
part gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
part bench_loss 90 python3 benchmarks/bench_loss.py --device cuda --tokens 16384 \
  --forms topk chunk_topk gold full --repeat 5
part bench_step 150 python3 benchmarks/bench_step_time.py --device cuda --nproc 1 --bf16 \
  --random-weights --tokenizers "$TOK" --seq-length 2048 --micro-batch-size 2 \
  --global-batch-size 8 --kd-topk 64 0
part bench_onpolicy 120 python3 benchmarks/bench_onpolicy.py --device cuda --nproc 1 --bf16 \
  --random-weights --tokenizers "$TOK" --global-batch-size 16 --new-tokens 64 256
