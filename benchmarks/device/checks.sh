#!/usr/bin/env bash
# The device session's checks (issue 18 / 21 GPU work), on one H100/H200, after
# benchmarks/device/prepare_carry.sh here:
#   run(command="bash benchmarks/device/checks.sh PART...", carry=[".whl", ".devassets"],
#       timeout_s=<sum of the parts' limits + 30>)
# Parts (each writes $OUT/PART.log and is cut off by its own limit, so a slow part cannot take
# the others' time):
#   gpu_tests       360 s  every gpu-marked test under tests/, collected by marker (CUDA IPC
#                          stream, GPU loss vs reference, training on the GPU vs the CPU run,
#                          KV-cached greedy generation vs HF, device placement, fused loss)
#   fused_loss      300 s  the exact (image) and gold / H-KL forms (full and compact payload,
#                          gold_topk at 64 / 256) on the fused Triton passes
#                          (issue 60): their gpu-marked tests, then bench_loss.py at 16k tokens,
#                          V_s 49,152 and 128,256, fp32 and bf16, with CE: ms, x CE, kernel
#                          launches, share of the bandwidth floor, extra memory; result files
#                          under $OUT/results
#   bench_loss      200 s  the loss forms vs Megatron's CE at 16k tokens, V_s 49,152 and 128,256
#   bench_loss_blocks 150 s  the exact and gold forms: a kernel profile, and three block sizes
#   bench_loss_image 200 s  the image form (training's exact payload), gold and chunk top-k vs
#                          CE at 16k tokens, V_s 49,152 (bench_loss.py's synthetic W); the
#                          GPU paths of the first two make the KL and its gradient together
#                          since 070b99b / 9926b69 (bench_loss_launches: 74.5 -> 40.5 and
#                          84.0 -> 46.6 operations a block): their GPU times are owed
#   bench_sorted_top 90 s  gold's sorted top-8192 of ~24k columns: topk vs a full sort
#   bench_step      200 s  step time, colocated, bf16, random weights, chunk top-64
#   bench_onpolicy  200 s  on-policy generation speed and its share of a step
#   bench_teachers  420 s  1 vs 2 teachers, colocated vs disaggregated (issue 20), on the
#                          machine's CPU cores (gloo; one GPU cannot hold NCCL ranks of both
#                          sides): student 2 ranks, each teacher 2 more, 2 threads a rank
# Measured on an H200 (2026-11-26): a part's start (imports, random-weight models, packing)
# takes 60-90 s, so 15 device minutes hold about two calls. 2026-11-27 (H200): gpu_tests took
# 230 s, bench_step 134 s, bench_loss and bench_loss_blocks ran into their limits (150 s).
# Plan: `gpu_tests bench_loss_blocks bench_sorted_top` (~450 s), then `bench_loss bench_step`
# (~350 s); bench_loss_image and bench_onpolicy in a later session (the image form's GPU rows
# are still owed to issue 18: `gpu_tests bench_loss_image` first when a device is lent).
# CHECKS_DRY_RUN=1: install nothing, run nothing; print each part's command as a line
# "+ ARG..." (shell-quoted), so the CPU suite can check what a part runs
# (tests/test_device_checks.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=${CHECKS_DRY_RUN:-}
OUT=${OUT:-/tmp/device-out}
TOK=$PWD/.devassets/tokenizers
if [ -z "$DRY" ]; then
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDISTILL_SHARED_ASSETS=$PWD/.devassets
  nvidia-smi -L | tee -a "$OUT/device.txt"
  git rev-parse HEAD >> "$OUT/device.txt" 2>/dev/null
fi
part() {  # part NAME SECONDS COMMAND...: one check, its own log and limit
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  if [ -n "$DRY" ]; then printf '+'; printf ' %q' "$@"; echo; return; fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s"; grep -v -i "warn" "$OUT/$name.log" | tail -n 25
}
fused() {  # the fused passes' gpu tests, then their rows in both dtypes
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_loss_fused_forms.py || return
  for dtype in bfloat16 float32; do
    XDISTILL_RESULTS_DIR=$OUT/results python3 benchmarks/bench_loss.py --device cuda \
      --tokens 16384 --vs 49152 128256 --forms chunk_topk image gold hkl gold_topk --with-ce \
      --dtype "$dtype" --repeat 2 || return
  done
}
blocks() {  # the exact and gold forms: the default blocks (accelerators: within 10% of the
  # logits, loss.student.block_positions) with a kernel profile, then the CPU rule's 85
  # positions a block (--block-mib 64) and 682 (512) at V_s 49,152
  python3 benchmarks/bench_loss.py --device cuda --tokens 16384 --vs 49152 \
    --forms gold full --repeat 3 --profile 15 || return
  for mib in 64 512; do
    python3 benchmarks/bench_loss.py --device cuda --tokens 16384 --vs 49152 \
      --forms gold full --repeat 3 --block-mib "$mib" || return
  done
}
[ $# -gt 0 ] || set -- gpu_tests bench_loss
for name in "$@"; do
  case $name in
    gpu_tests) part gpu_tests 360 python3 -m pytest -q -m gpu -p no:cacheprovider \
                 --durations=0 tests ;;
    fused_loss) part fused_loss 300 bash -c "OUT=$OUT; $(declare -f fused); fused" ;;
    bench_loss) part bench_loss 200 python3 benchmarks/bench_loss.py --device cuda \
                  --tokens 16384 --forms topk chunk_topk gold full --repeat 3 ;;
    bench_loss_blocks) part bench_loss_blocks 150 bash -c "$(declare -f blocks); blocks" ;;
    bench_loss_image) part bench_loss_image 200 python3 benchmarks/bench_loss.py --device cuda \
                        --tokens 16384 --vs 49152 --forms chunk_topk image gold --repeat 3 ;;
    bench_sorted_top) part bench_sorted_top 90 python3 benchmarks/bench_sorted_top.py \
                        --device cuda --rows 1024 4096 16384 ;;
    bench_step) part bench_step 200 python3 benchmarks/bench_step_time.py --device cuda \
                  --nproc 1 --bf16 --random-weights --tokenizers "$TOK" --seq-length 2048 \
                  --micro-batch-size 2 --global-batch-size 8 --kd-topk 64 ;;
    bench_onpolicy) part bench_onpolicy 200 python3 benchmarks/bench_onpolicy.py --device cuda \
                      --nproc 1 --bf16 --random-weights --tokenizers "$TOK" \
                      --global-batch-size 16 --new-tokens 64 ;;
    bench_teachers) part bench_teachers 420 python3 benchmarks/bench_teachers.py \
                      --random-weights --tokenizers "$TOK" --placement both --nproc 2 \
                      --teacher-ranks 2 --threads-per-rank 2 --train-iters 4 --seq-length 128 ;;
    *) echo "unknown part $name"; exit 2 ;;
  esac
done
