"""Time and peak memory of the student-side KD loss vs Megatron's vocab-parallel cross-entropy.

Same student logits [1, tokens, V_s] for both (fp32 by default), TP = 1 on one process, forward +
backward. Each (method, size) runs in a fresh child process (CPU threads pinned to ``--threads``):
the KD child never imports Megatron; the CE child does (``mcore_compat.install()``) and calls
``tensor_parallel.vocab_parallel_cross_entropy`` on [s, b, v] logits, refreshing the logits it
destroys in place (outside the timed region). Time: the minimum over ``--repeat`` runs after one
warm-up, as wall and as process CPU time (the CPU figure is steadier on a shared machine). Memory:
peak RSS of the timed runs (not the warm-up's) minus the RSS with all inputs allocated
(before the warm-up: what it keeps counts), and net of the .grad buffer where one is created
(the CE's; the KD loss writes its gradient over the logits, as training's teacher-0 call does,
unless ``--fresh-grad``). Chunks: ~0.7 per token, sizes 1-2; W has up to 4 entries per row (45%
one-to-one rows), rows normalised to sum 1, 0.1% empty rows (like the builders' output).

  python benchmarks/bench_loss.py [--tokens 4096] [--vs 49152 128256] [--forms topk chunk_topk]

Measured (2-core CPU, fp32, V_t = 151,936, k = 256; CPU-time ratio to Megatron CE; extra memory
net of .grad as a share of the logits):

  tokens  V_s      form         x CE   extra / logits
  16,384  49,152   topk         0.77        8.6%
  16,384  49,152   chunk_topk   0.77        8.2%
  16,384  128,256  topk         0.69        3.6%
  16,384  128,256  chunk_topk   0.66        3.1%
   4,096  49,152   topk         1.04       10.3%
   4,096  49,152   chunk_topk   1.27        9.7%
   4,096  128,256  topk         1.18        5.9%
   4,096  128,256  chunk_topk   1.13        5.9%

Gold / H-KL and the exact form (all of V_t), 4,096 tokens, V_s = 49,152, A/B on the same machine
state (the study paused; 2026-11-25): before = commit be3baac, after = the image projection
(``loss/kernels/image_projection.py``, commit 1427b4b, before 0d398ef made the exact form's per-row teacher terms fp64 sums) and NumPy's sort of the uncommon values (``loss/cpu/sorted_top.py``):

  threads  form   before x CE  after x CE   extra / logits (after)
  1        full      18.7         13.3         33%  (Numba's runtime, ~0.1 GiB, counts here)
  1        gold       8.3          4.6         9.7%
  2        full      23.6         16.0         33%
  2        gold       9.2          5.9         9.5%
  (V_s = 128,256, 2 threads, after: full 9.6x, gold 5.4x, chunk_topk 1.3x)
  Re-measured at b8166f2 (2026-11-28, another machine, 4,096 tokens, V_s = 49,152): gold 5.7x
  (1 thread) / 7.8x (2 threads), chunk_topk 0.84x / 0.90x: gold is 7-9x the top-k form.
  Not a regression: A/B on one machine state (2,048 tokens, 1 thread, runs alternated twice),
  bf91f04 (before the JSD and sample-weight changes to gold's kernel) 6.95x / 6.62x, bf70a2b
  6.86x / 6.24x; the 5.9x of 2026-11-25 was another machine.
  Gold's backward without a second sort and without autograd (``loss/cpu/sorted_l1.py``: the
  forward sorts the values and keeps where the signs of sorted student - teacher change; the
  backward finds each value's sign by comparing it with those few values, in NumPy, and
  ``GoldKernel.raw_grad`` writes the forward KL's gradient directly: the common part's is
  -p_teacher, no recompute of the student's means; 2026-11-28, A/B of f753cbe (before) and
  c1173b8 (after) on one machine state, runs alternated; s per forward + backward, CPU-time
  ratio to CE):

  tokens  threads  dtype  before                  after
   2,048     1     fp32   2.54-2.65 s, 6.3-6.4x   1.63-1.65 s, 3.95-3.97x
   2,048     1     bf16   2.67 s, 4.9x            1.77 s, 3.2x
   4,096     1     fp32   4.97 s, 6.2x            3.21 s, 4.0x
   4,096     2     fp32   4.37 s wall, 8.3x       2.41 s wall, 5.1x

  Then the forward KL stopped computing exp of the student's common means (it needs only the
  teacher's): 4,096 tokens, 1 thread, 3.06 s, 3.7x CE (91865cb and 785c61b alike).
  Same extra memory (8-11% of the logits). (A first step, the second sort gone but the
  backward still by autograd through ``kl``: 4.8-5.2x at 2,048 tokens, 4.9-5.1x / 8.1-8.3x at
  4,096.) Then the forward's sort by a Numba radix select + sort in linear time
  (``loss/cpu/sorted_top.py``; NumPy's partition + sort, not SIMD on this AMD EPYC, took 0.29 of
  0.36 ms a row): A/B of cfc4c94 (before) and the commit that made it, runs alternated, s per
  forward + backward, CPU-time ratio to CE:

  V_s      threads  before                     after
  49,152      1     2.97-3.04 s, 3.73-3.80x    2.44-2.46 s, 2.97-3.07x
  49,152      2     2.38 s wall, 5.2x          2.30 s wall, 5.0x (OMP_WAIT_POLICY=PASSIVE: 2.13 s)
  128,256     2     6.04 s wall, 4.8x          4.56 s wall, 3.9x

  Extra memory 0.06 -> 0.10 GB at V_s 49,152 (7.8% -> 13.5% of these logits; 3.4% at 16k
  tokens): Numba's runtime, ~40 MB once per process.
  Then each chunk row's work in few passes (``loss/cpu/gold_rows.py``: the means, the common
  part's KL and argmax in one pass a row; the gradient written in vocabulary order in one;
  the block's logits gradient without a [positions, V] gather; ``loss/cpu/sorted_l1.py``: the sign
  runs and the slopes by branch-free Numba passes, no NumPy masks or small torch operations):
  A/B of 65155e8 (before) and the commit that made it, runs alternated, s per forward +
  backward, CPU-time ratio to CE (wall at 2 threads):

  V_s      threads  before                     after
  49,152      1     2.60-2.72 s, 3.18-3.45x    2.00-2.17 s, 2.46-2.61x
  49,152      2     1.96 s, 4.0x               1.80 s, 3.6x
  128,256     1     -                          5.34 s, 2.57x
  128,256     2     4.33 s, 3.7x               3.82 s, 2.85x

  Extra memory 13.9% -> 12.3% of the logits (V_s 128,256: 10.1% -> 6.9%). What is left: the
  softmax twice (as CE; ~20%), the sort (~12%), the chunk rows' sums of the logits (forward and
  recompute), and torch's exp of the teacher's and the student's chunk values.
  Then no softmax buffer and vectorised exps (``loss/cpu/rows.py``): the forward's
  log-partitions by one exp-and-sum pass, the backward's gradient written from the logits in
  one pass (was a softmax, then a pass for the rows' part), the teacher's and the chunk means'
  exps inside gold_rows' passes (a float32 polynomial LLVM vectorises: 0.33 ns an element,
  torch's exp 0.82, Numba's math.exp a scalar libm call). A/B of 55972ec (before) and c58ffae
  (after), in one process (``parallel_kd_loss`` forward + backward, 2nd and 3rd call, 1
  thread, 4,096 tokens, V_s 49,152), runs alternated three times: before 2.12-2.23 s, after
  1.74-1.85 s (one 2.06). In this script's separate processes the same pair measured 2.41x /
  2.85x after against 2.49x / 2.79x before (runs alternated; this machine's speed drifts
  10-15% between runs). A sixth of what is left is the page faults of the fresh
  [positions, V] gradient: a softmax written into 4,096 x 49,152 fp32 takes 0.40 s on fresh
  pages, 0.13 s on touched ones. With THP_MEM_ALLOC_ENABLE=1 (torch's huge pages for large CPU
  buffers) it takes 0.19 s, but Megatron's CE gains as much (0.79 -> 0.56-0.61 s), so the
  ratio does not.
  Then training's call (the loss's weights given ahead) takes a block from its logits to its
  gradient in two passes (``loss/cpu/gold_block.py``, 212668a): per chunk row its positions'
  log-partitions and summed logits in a buffer of the thread's, then the row's means, KL and
  argmax from it; after the sort, each row's raw gradient made in that buffer and spread
  over its positions as they are written. No [rows, V] raw sums or raw gradient. 16k tokens,
  V_s 49,152, the real W, 1 thread, an AMD EPYC (CE 7.5 s), runs alternated: 6d25521 4.97 /
  5.14 s, 212668a 4.34 / 4.72 s; extra memory 0.12-0.14 -> 0.07 GiB. In-process (the 2nd and
  3rd call): 5.25 -> 4.35 s; the block pass 1.6 s (log-partitions 0.44, the rows' gathers
  and KL 0.58), the sort 0.74, the sign runs 0.26, the spread 1.25. On the way: with the raw
  sums gone, the sort's per-row allocations (now once per thread) churned glibc's heap, its
  trims and page faults taking the sign runs from 1.2 to 2.5-3.0 s.

The exact form with its per-row teacher work in few vectorised passes (``loss/cpu/exact.py``:
the teacher-only terms by one torch exp and one Numba pass per few rows, was seven torch passes;
the forward KL on W's image from a direct gather of the payload's columns, no [rows, V_t] copy;
its gradient on the projected mass written directly, no autograd through a recompute) and the
projection eight rows at a time (``loss/kernels/image_projection.py``: each of W's nonzeros read once per
eight rows, no per-column inner loop). 2026-11-28, A/B of 7e44447 (before) and the commit that
made them (after) on one machine state, runs alternated twice; 4,096 tokens, s per forward +
backward, CPU-time ratio to CE (wall at 2 threads):

  V_s      threads  before                       after
  49,152      1     10.87-11.21 s, 13.5-13.6x    5.97-6.45 s, 7.7-8.0x
  49,152      2     9.54-9.88 s, 17.9-19.9x      5.13-5.34 s, 10.1-10.3x
  128,256     2     15.72 s, 12.7x               10.39 s, 6.7x

  With the demo's real W (``--projection`` of SmolLM2-135M -> Qwen2.5-Coder-0.5B: 1.22
  entries a row, |I| = 40,132; the synthetic W has 2.65 and 87,607, with no locality), 1
  thread, A/B of 7e44447 (before, with this script) and 0d732f3 (after):

  tokens  form         before              after
   1,024  full         1.75 s, 8.6x CE     1.23 s, 6.0x CE
   4,096  full         6.22 s, 7.7x        4.20 s, 5.2x
   4,096  chunk_topk   0.68 s, 0.85x       0.68 s, 0.83x

  Extra memory 22-26% of the logits at V_s 49,152 (was 24-35%; real W at 4,096 tokens 18%,
  was 27%; Numba's runtime ~0.1 GiB counts here). Then the teacher's exp and the KL's log
  inside the Numba passes (``loss/cpu/rows.py``: vectorised float32 polynomials), the payload
  rows read where they lie: teacher terms 0.98 -> 0.41 s, the KL 1.10 -> 0.59 s, its gradient
  0.13 -> 0.07 s per 20 blocks; A/B of 55972ec (before) and c58ffae (after), runs
  alternated, 1 thread, V_s 49,152: before 6.29-6.42 s (7.6-8.1x), after 5.02-5.06 s (6.2x);
  extra memory 22% -> 16-18% of the logits. The projection is now 60% of what is left (W's
  nonzeros read per eight rows, forward and in the recomputing backward, and transposed). At 2
  threads a quarter of the CPU time is torch's OpenMP threads spinning after each torch op
  while Numba's threads run: with OMP_WAIT_POLICY=PASSIVE the same run takes 4.16 s
  wall, 7.1x (not set by the library: it is the process's choice).

The gradient written over the logits (``parallel_kd_loss(..., grad_into_logits=True)``, what
training's call of teacher 0 does and what Megatron's CE does to its logits): no fresh
[positions, V] buffer to fault in page by page (``--fresh-grad`` measures the old way, still
what the calls of teachers 1, 2, ... do when there are several). Blocks whose logits nothing
reads after their gradient (gold's and CE's logits-only path) write it over them directly,
with a Numba pass on one array (``cpu_rows._exp_spread_over``: two aliased arrays send LLVM's
vectorised loop to its scalar fallback, 0.89 s against 0.16 s a 4,096 x 49,152 pass); the
others go through a block workspace. 2026-11-29, commit 6e256e1 (memory: the peak from the
inputs' setup on; the rule of f716890, below, counts from the timed runs), another machine
(Intel Xeon, 260 MiB L3: page faults cost more here and the exact form is slower than on the
AMD EPYC above; c58ffae's exact form: 9.74 s, 11.0x CE), 1 thread, V_s 49,152, CPU-time ratio
to CE, runs alternated (4,096 tokens: three times for gold, twice for the others; 16,384:
twice; the two "one run" rows at the commits they name):

  tokens  form        over the logits                  --fresh-grad
   4,096  gold        1.96-1.98 s, 2.22-2.24x, 7.5%    2.22-2.48 s, 2.48-2.78x, 7.3-7.8%
   4,096  full        7.41-7.58 s, 8.1-8.3x, 15-16%    8.97-9.59 s, 9.9-10.8x, 14%
   4,096  chunk_topk  0.76 s, 0.81-0.85x               0.97-0.98 s, 1.07-1.10x
  16,384  gold        7.32-7.50 s, 0.86x, 4.4-4.6%     15.40-17.85 s, 1.77-3.36x, 4.4-4.6%
  16,384  chunk_topk  2.97-3.22 s, 0.35-0.37x, 17-24%  9.45-12.05 s, 1.09-2.27x, 16-17%
  16,384  full        34.4 s, 3.6x, 7.5% (one run, 6e256e1)  -
  16,384  gold (V_s 128,256)  16.3 s, 0.59x, 1.4% (one run, e4de832; CE 27.8 s)

  (Megatron's CE: 0.88-0.94 s at 4,096 tokens; at 16,384 8.46-8.70 s in the runs beside
  ``over the logits`` and 5.30-8.67 s beside ``--fresh-grad``: it allocates and faults in a
  logits-sized buffer per call, whose cost swings on this machine. Against its fastest run,
  gold over the logits is 1.4x CE at 16k tokens.) The memory column is now the peak from the
  inputs' setup on (``/proc/self/clear_refs``; the process's lifetime peak could hide a loss
  whose peak is below the setup's), net of a .grad buffer where one is made. With no gradient
  buffer the forward's own peak shows: chunk_topk's W entries expanded for all blocks at once
  (``block_entries``, per chunk row k columns x their W entries, int64 indices) are 15-24% of
  these logits at 16k tokens, above the 10% target; the 8.2% above was net of a gradient that
  the backward allocated after that peak was gone. Then the column entries as one pair index
  (row * k + slot) and their expansion without [E] block or position temporaries: the
  expansion's peak 0.57 -> 0.36 GiB (16k tokens, k 256, 5.4 M entries). This script still
  shows 17-18% (0.52 GiB; the peak of the timed runs over the RSS before the warm-up): ~0.3 GiB
  of it is what glibc's heap keeps after the first call (malloc_trim returns it all); with the
  heap trimmed after each call a call's own peak is 0.40-0.44 GiB, 13-14%. At the default k = 64
  the entries are a quarter of these.

The exact form's projection with all of a block's rows at once (``loss/kernels/image_projection.py``:
the rows transposed, [V, rows], so each W entry adds one contiguous vector of all of them;
was eight rows at a time with a strided store per row and entry: 37 -> ~16 ms a projection
at 90 rows), its teacher terms in one pass over each payload row (commit 0b08c28), then the
forward KL reading each payload row once, the teacher-only terms in the same pass
(``loss/cpu/exact.py``, 6a58251). 2026-11-29, A/B of 16f39a7 (before) and 6a58251 (after),
runs alternated, 1 thread, V_s 49,152, s per forward + backward, CPU-time ratio to CE:

  tokens  before                             after
   4,096  7.03-7.36 s, 8.0-8.1x, 18-19%      4.56-4.75 s, 5.2-5.3x, 17-18%
  16,384  31.5-33.7 s, 8.0-9.4x, 7.6-8.2%    22.5-23.8 s, 5.3-6.3x, 6.2-10.7%

  (Megatron's CE at 16,384 tokens took 3.6-4.3 s in these runs, 8.5 s in the session before
  and 5.6 s in a run between: its logits-sized buffer's page faults swing with the machine's
  state. The exact form's extra memory swings with glibc's retained heap; after 6a58251 the
  projection's gradient and h take the projection's two buffers, the last row, 6.2%.)
  With the demo's real W (``--projection``, as above), 4,096 tokens, one run each: 16f39a7
  4.79 s (5.22x CE), dfffd57 3.68-3.69 s (4.0-4.1x), extra memory 14% -> 12-13%.
  Two threads, 4,096 tokens, one run each: 16f39a7 6.79 s wall (10.1x CE), 6254a3a 5.17 s
  (7.6x): slower than one thread, because torch's OpenMP threads spin after each torch op
  while Numba's run on the same two cores; with OMP_WAIT_POLICY=PASSIVE 3.44 s (5.4x).
  (torchrun's one thread a rank has neither.)

The gradient written by the forward (``parallel_kd_loss(..., loss_weights=(a, b))``: the
loss's weights on the KD and CE sums known before the call, as in training's one-teacher call
with global-batch denominators; the default here, ``--recompute`` measures the other way):
each block's gradient right after its sums, from the softmax and projection at hand, the
exact form's KL and gradient in one pass over each payload row; the backward only scales it.
2026-11-29, commit 34afc02, runs alternated, 1 thread, V_s 49,152, CPU-time ratio to CE:

  tokens  form        forward-written               --recompute
   4,096  full        4.13-4.22 s, 4.5-4.7x, 13%    5.04-5.38 s, 5.6-6.1x, 16%
   4,096  gold        2.06-2.15 s, 2.2-2.4x, 10-11% 1.97-2.07 s, 2.2-2.3x, 10-11%
   4,096  chunk_topk  0.73-0.75 s, 0.80-0.83x       0.73-0.78 s, 0.83-0.87x
  16,384  full        16.7-18.8 s, 3.4-3.8x, 4.4%   21.6-22.1 s, 4.4-5.8x, 6.1%
   4,096  full, real W  2.77 s, 3.24x, 10%          3.45 s, 4.02x, 12%   (one run each)

  Then the payload's sums in float32 partials of 256 (commit 0e59678) and P gathered on I from
  the piece's exps for the KL and its gradient alike (9e22162), forward-written, one run each:

   4,096  full        0e59678: 3.30-3.39 s, 3.75-3.95x; 9e22162: 3.06-3.22 s, 3.6-3.7x, 12%
  16,384  full        0e59678: 13.4 s, 2.83x, 4.9%;  9e22162: 14.4 s, 3.03x, 4.4%
   4,096  full, real W                               9e22162: 2.53 s, 2.87x, 10%

  Then the payload pass's cross sum and gradient in one loop, W's rows fetched 8 entries ahead
  in the line products (``cpu_rows.prefetch``) and the rows' sums transposed 32 rows at a time
  (2026-11-29, A/B of 7cee3ae (before) and the commit that made them (after), runs
  alternated, one machine state; Megatron's CE 3.43-3.86 s here, faster than in the runs
  above):

  tokens  V_s      form          before                       after
  16,384  49,152   full          13.69-14.60 s, 3.55-4.14x    12.28-12.54 s, 3.57-3.62x, 4.4-4.9%
   4,096  49,152   full, real W  2.33 s, 2.65x                2.21 s, 2.47x, 10.4%   (one run each)

  (Without the rows' sums change: 12.84-13.19 s at 16,384 tokens.)

  At V_s 128,256 (7cee3ae, 16,384 tokens, one run): CE 23.9 s, full 28.1 s (1.17x CE, extra
  memory 1.5% of the logits), chunk_topk 8.6 s: the exact form is within 1.5x CE there, and
  3.3x chunk top-k.

  The ``image`` form (``--forms image``; what training's ``--kd-topk 0`` ships since the
  commit that added it): the teacher sends W's image I only, with its float64 sums of P log P
  and of P over the other columns and its argmax (log P on I then; P since 2026-11-29), and the student reads each row in one
  contiguous pass (``cpu.image_rows.image_kl_rows``: no pieces, no gather, no exp of the columns
  outside I). The same inputs as ``full`` (the payload rows cut to I, the sums taken here);
  one run each, 1 thread, V_s 49,152:

  tokens  W                       full                   image                  chunk_topk
  16,384  synthetic (|I| 58%)     11.81 s, 2.42x CE      9.90 s, 2.03x, 4.9%    -
   4,096  synthetic               3.02 s, 3.49x          2.53 s, 2.92x, 5.8%    -
   4,096  demo's real W (26%)     2.16 s, 2.52x          1.64 s, 1.92x, 7.8%    0.68 s, 0.79x

  At V_s 128,256, 16,384 tokens (e45884d, one run): image 20.7 s, 0.86x CE (24.1 s), extra
  memory 0.9% of the logits; 2.4x the chunk top-k's 8.6 s above.

  (CE 4.88 s at 16,384 tokens in that run, 0.86-0.87 s at 4,096.) Its payload is |I| + 5
  floats a chunk instead of V_t + 1: 26% of the full rows with the real W. The teacher pays
  for the sums outside I once per chunk: on CPU one Numba pass (``exact_rows.image_sums``,
  23.5 ms for 128 rows x 151,936 at b1199c1 against its log-softmax's 46 ms; torch's float64
  sums took 397 ms; 9.4 ms for 64 rows at 6876b68); on a GPU an exp and two sums over the
  logits it already holds.

  The block's softmax written straight into its rows of the gradient buffer (no [block, V]
  copy a block) and the image pass's gradient into a reused buffer (62c5055; A/B against
  65dfb03, runs alternated, CE 3.4-3.5 s at 16,384 tokens, 0.86-0.89 s at 4,096):

  tokens  W           before                     after
  16,384  synthetic   9.91-10.95 s, 2.78-3.24x   9.17-10.14 s, 2.60-2.87x, 3.8%
  16,384  real W      6.34-6.94 s, 1.80-1.97x    5.85-6.23 s, 1.64-1.77x, 3.3-4.2%  (chunk_topk 2.89 s)
   4,096  real W      1.65-1.68 s, 1.84-1.93x    1.59-1.66 s, 1.84-1.87x, 6.3%      (chunk_topk 0.65-0.71 s)

  Block size at 16,384 tokens, real W (``--block-mib``, one run each, positions a block: s):
  42: 5.95, 85 (the default): 6.09, 170: 6.61, 341: 7.04; the default stays. In-process at
  16,384 tokens with the real W (6.0 s): W's two products 1.4 s, the blocks' softmax with its
  log-partitions 1.2 (torch's softmax 0.69 of it, the two row maxima 0.37), the image pass
  1.2, the gradient's transposed copy ~0.5, the rows' sums 0.63, the gradient's dots and
  combine 0.35 each. Tried and left: the image pass writing its gradient transposed (tiles of
  2,048 columns of all the rows; no faster, ``loss/cpu/image_rows.py``; 16 rows at a time in tiles
  of 4,096 columns, d^T in whole cache lines and the gradient's shift applied by W's product:
  7.3-7.5 against 7.7 ms a block at 60 rows x |I| 40,132 for the pass and the copy, 18.5
  against 20.4 at 87,607, and no gain in-process at 16k tokens), one pass for the dots and
  the combine with one TP rank (0.96 against 0.90 s over 16k positions: both are bound by
  memory), a Numba softmax that returns the log-partitions (1.03 against torch's 1.06 s with
  the two maxima).

  The forward's softmax left unnormalised for the exact form (``cpu_rows.row_exp_``: a max and
  one exp pass; 1 / the row's sum goes into the per-row factor the projection and its
  backward read the softmax through, so no normalising pass and no second maximum for the
  log-partition): in-process at 16,384 tokens, real W, one thread, alternated 3x, the
  softmax part 1.27-1.34 -> 0.96-1.00 s, the call 6.30-6.60 -> 5.91-6.23 s; bench A/B
  against f9cf8f3, alternated 3x (machine state drifting: CE 3.5 s), 6.41 / 7.21 / 7.38 ->
  6.64 / 7.03 / 6.40 s (means 7.00 -> 6.69). Tried and left (2026-11-29): the scaling done in
  the rows' sums' pass instead (in place: the block written twice; the call 5.96-6.24 s
  before, 6.04-6.30 after, alternated 3x: no gain);
  the dots <p, h> taken in W's backward product while a tile of h is in L1 (1.15 -> 1.89 s for
  the two products against the 0.39 s of the dots' own pass: 85 short runs of p a tile);
  W's products in groups of 8-30 rows so the gathered operand fits L2 (1.97 / 2.01 ms a block
  whole, 2.07-3.90 / 2.28-6.21 in groups, forward / backward). W's forward product with its
  operand rows permuted by their first column of I was 1.48 against 1.97 ms (the rows'
  sums would then scatter their rows: not taken). At 2 threads on this 2-vCPU machine the
  vector-bound Numba passes do not scale (the image pass 5.97 -> 6.13 ms a block) while CE,
  bound by memory, halves its wall time: compare forms at one thread here.

  Then (2026-11-29, 16,384 tokens, real W, one thread; in-process runs alternated 3x with the
  commit before): the softmax's shift taken as it goes (``row_exp_``: the first 256 columns'
  maximum, moved up only where a later piece's exps pass ~e^62; torch's row max had taken
  1.45-1.49 of 4.5-5.0 ms a block), the CPU scratch buffers on transparent huge pages (W's
  products read their rows at random, a 4 KiB page each: 1.37-1.46 -> 1.09-1.29 s for the two)
  and the rows' sums prefetching the next position's tile (3.47-3.66 -> 3.17-3.34 ms a block):
  the softmax part 0.96-0.99 -> 0.71-0.72 s, the call 5.78-6.06 -> 4.98-5.38 s (3aa5656;
  bench: 5.37 / 5.52 s, 1.56-1.57x CE). The image payload holding P instead of log P (the
  teacher has the exps already; the sum of P log P over all of V_t shipped with it): the
  image pass 1.16-1.21 -> 0.90-0.94 s, the call 5.10-5.31 -> 4.85-5.15 s (0ec3cf1; bench,
  three runs: 5.25 / 5.13 / 5.04 s against CE 3.48 / 3.60 / 3.72 s: 1.50x / 1.42x / 1.35x CE,
  chunk_topk 2.87-2.99 s: 1.71-1.83x it). Tried and left: a Numba transposing copy of the
  gradient on q (1.34 against torch's 1.69 ms a block in isolation; no gain in-process).
  A chunk row at a time from the logits (``loss/cpu/image_block.py``, 97b7ee3; one TP rank, the
  forward-written call): the row's positions' softmaxes summed in the thread's buffer and still
  in the caches when their gradient is written, W's one-entry rows as one int32 column each.
  On an AMD EPYC (Zen 4), one thread, 16k tokens: demo W (V_s 49,152) 4.76 s (f545e4b) ->
  2.48-2.97 s, chunk_topk 1.85-2.12, CE 3.62-4.31 (1.25-1.50x chunk_topk, 0.57-0.78x CE;
  a7c7f04: 2.51 s, two threads 1.59 s wall against CE's 2.62; f032339: 2.48 s);
  real Llama-3 -> Qwen2 W (V_s 128,257, |I| 109,827) 14.9 -> 8.15 s, chunk_topk 5.52, CE
  18.56 (1.48x, 0.44x; one run, before the flat loop over W's other entries). Per chunk row at 49k (parts timed alone): the positions' exps 28 us a
  position, u on I 80 (the one-entry rows' scatter 46-59, the others' 19), the KL on I 52, h
  45, the dot and the gradient 9 a position.

  (CE 0.85-0.92 s at 4,096 tokens, 3.8-5.0 s at 16,384.) Gold gains nothing measurable: its
  backward recomputed little (the block's logits summed per chunk row). chunk_topk keeps the
  recomputing backward either way: its kernel finishes all rows together, after every block's
  sums, so a block's gradient cannot be written with them.

(Since 212668a and 97b7ee3 both are within 2x on CPU in training's call: gold 0.6-0.8x CE, the
exact form 1.25-1.50x chunk_topk, see above and README.md. What follows is the blockwise
passes' account, which the other calls still take.) Both stayed above the <= 2x target on
CPU, for reasons of the forms themselves. The exact form
reads the teacher's [chunks, V_t] payload, 2.2x the student's logits at these sizes, with an
exp, and its projection is a sparse gather of ~2.7 entries per student column with no
locality, done twice (forward, and the gradient's transpose; three times with the recomputing
backward): at 16k tokens (in-process profile, 6a58251, recomputing) the projections were half
of the time (11.7 of 23.8 s: the line products 5.8 s), the payload's passes 40% (the forward
KL 6.1 s, its gradient 3.1); forward-written (in-process, 9e22162, 15.0 s): the payload's one
pass 5.7 s, the projection 3.3 s, the gradient's projection with its transpose 4.0 s, the
blocks' softmax 1.5 s; with the one loop and the prefetch above (13.2 s): 4.8, 2.9 (the rows'
sums 1.2, before they were blocked), 3.4 and 1.5 s. Half of a line product's time is the transposed write-out of its
[tile, rows] pieces (the same sums written [lines, rows]: 3.7 against 7.6 ms at 60 rows), and
the products are not bound by W's gathers: with the rows' sums in L1 (1,024 student columns)
they still take 0.6-1.1 ns a row and entry, against 1.1-1.2 from L3.
LLVM gives Numba's loops 256-bit vectors on this CPU (Intel Emerald Rapids, AVX-512): with
512-bit ones (``NUMBA_CPU_NAME=emeraldrapids NUMBA_CPU_FEATURES=<the host's features>,
-prefer-256-bit``, a process-wide choice the library leaves to the user) the exp, log and
fp64 sums of those passes ran 1.3-1.6x faster in isolation; in-process at 4,096 tokens the
forward KL 1.39 -> 1.11 s, its gradient 0.72 -> 0.63 s, forward + backward 4.80 -> 4.63 s
(one run each, 6a58251; the projections, bound by W's gathers, unchanged).
Gold's L1 needs each chunk's 8,192 largest uncommon values sorted (0.1-0.3 ms per row,
values only; before ``sorted_l1`` the backward sorted again with their columns, 2.2x that), and
every chunk row costs several passes over both halves of the vocabulary (means, exps, the
common-vocabulary KL) forward and again in the recomputing backward. The compact default
(chunk top-64 + tail) is the form to train with; these two are for checking and for gold's
uncommon-vocabulary term.

The time target (<= 1.5x CE) is met by both compressed forms at the issue's size (16k tokens;
Megatron's CE makes several full passes and temporaries there); the memory target (<= 10% of
the logits) by the compressed forms' backward, not by chunk_topk's forward at k = 256 on CPU
(its expanded W entries, above). On a GPU:
``--device cuda`` (wall-time ratio, torch's allocated bytes).

Measured on one H100 (torch 2.11 cu130, megatron-core 0.19.2, ``--device cuda --tokens 16384
--threads 8``, 2026-11-25; wall-time ratio to Megatron CE; extra net of .grad / logits):

  dtype  V_s      method        ms     x CE   extra / logits
  fp32   49,152   megatron CE     15    1.00      0.0%
  fp32   49,152   topk           169   11.6       5.5%
  fp32   49,152   chunk_topk     165   11.3       7.3%
  fp32   49,152   gold           642   44.0       4.1%
  fp32   49,152   full           916   62.8      13.2%
  fp32   128,256  megatron CE     37    1.00      0.0%
  fp32   128,256  topk           396   10.6       2.2%
  fp32   128,256  chunk_topk     441   11.8       2.9%
  fp32   128,256  gold          1532   41.0       1.5%
  fp32   128,256  full          2181   58.4       3.0%
  bf16   49,152   megatron CE     16    1.00    200%   (its fp32 upcast of the logits)
  bf16   49,152   topk           144    8.8      19.7%
  bf16   49,152   chunk_topk     197   12.1      22.7%
  bf16   49,152   gold           549   33.6      10.4%
  bf16   128,256  megatron CE     42    1.00    200%
  bf16   128,256  topk           310    7.3       7.5%
  bf16   128,256  chunk_topk     464   11.0       8.9%
  bf16   128,256  gold          1451   34.4       3.8%

On the GPU the memory target holds but the time target (<= 1.5x CE) is missed by 7-60x: the
block loop issues many small kernels and host syncs per block (CE is a few fused passes at
HBM speed), so the GPU waits on the host. Fusing the per-block work (torch.compile or Triton)
is the open item; a NeMo-RL-style dense P-KL core measured 3.4-4.3x CE on an H100.

On one H200 (same software and command, 2026-11-26; fp32, k = 256; ms per forward + backward;
all rows on the same machine): old = commit 74eaced; final = commit 76a1e6a; expanded = the column forms' W entries
expanded once per call with block-relative indices (``loss/blocks/block_entries.py``: a block issues no
index arithmetic and no host waits); final = also the per-position label and block-row
arithmetic once per call and, with one TP rank, no partition reductions or factor products
(``bench_loss_launches.py``: chunk top-k 209 -> 37 operations per block with CE):

  V_s      method        block MiB   old   expanded   final   final x CE   extra / logits
  49,152   megatron CE                12       12        12       1.00          0.0%
  49,152   topk              64       39       35        26       2.25          8.6%
  49,152   topk             256        -       30        23       1.98          9.6%
  49,152   chunk_topk        64       59       46        30       2.54         10.4%
  49,152   chunk_topk       256        -       43        29       2.49         11.4%
  128,256  megatron CE                 30       30        30       1.00          0.0%
  128,256  topk              64        -       83        60       2.00          5.3%
  128,256  chunk_topk        64        -      120        68       2.26          5.9%

(The H100 table above came from another machine and host: compare within a table.) A profile
of the "expanded" chunk top-k step (k = 64, fused CE): 6,105 kernels with the GPU busy 21.7 ms
(softmax 7.5 ms) while the host launched them: launch-bound, hence the per-block cuts. Left to
reach <= 1.5x CE: fewer, larger blocks on the GPU (the 1/32-of-positions cap that keeps the
scratch buffers under 10% of the logits) or fusing a block's work into a few kernels. A GPU test
checks that the host waits do not grow with the number of blocks (35-39 per call).

Fused (``loss/gpu/row_softmax.py``, Triton; commits 2d26fea and 6fe4fa1), one H200, 2026-11-26, k =
256, ``--with-ce``: the column forms and CE read the logits twice in all (one kernel computes the
forward's log-partitions and tail mass, one writes the backward's dense gradient) and keep no
[block, V] buffer, so a call is one block (bf16 gradients written in place, the sparse
corrections rounded once). "unfused" = the blockwise path above (``XDISTILL_FUSED_SOFTMAX=0``),
in the same call as the first fused fp32 row; the fp32 rows are two calls on two machines
(the spread is the machines'):

  dtype  V_s      method        ms      x CE         extra / logits
  fp32   49,152   megatron CE   12      1.00              0.0%
  fp32   49,152   topk          14-15   1.15-1.28         6.5%   (unfused 32 ms, 2.71x)
  fp32   49,152   chunk_topk    15-19   1.25-1.61         7.3%   (unfused 42 ms, 3.50x)
  fp32   128,256  megatron CE   30      1.00              0.0%
  fp32   128,256  topk          22-23   0.74              4.7%
  fp32   128,256  chunk_topk    20-24   0.65-0.79         4.7%
  bf16   49,152   megatron CE   14      1.00            200%   (its fp32 copy of the logits)
  bf16   49,152   topk          14      1.01             23.0%
  bf16   49,152   chunk_topk    15      1.07             24.8%   (blockwise fused: 56 ms, 4.07x)
  bf16   128,256  megatron CE   35      1.00            200%
  bf16   128,256  topk          19      0.54             21.2%
  bf16   128,256  chunk_topk    21      0.59             22.7%

A profile of the fused chunk top-k step (fp32, 49k): 309 kernels, the GPU busy 5.2 ms (the two
dense kernels 0.85 + 1.67 ms, near the H200's bandwidth); the rest of the step is the host's
per-call setup of the chunk rows and W's entries. The extra memory is those entries (about 36
bytes each), which the bf16 share doubles. Not fused: the exact form (``full``) and gold / H-KL,
still blockwise at 35x and 39x CE on the H200 at 047d041 (``full`` 416 ms, gold 456 ms at 49k:
many small blocks, torch.topk's radix passes for gold; GPU busy 290 ms / 157 ms).

Again on one H200 at 7801264 (2026-11-26, ``benchmarks/device/checks.sh``; fp32, 16k tokens,
V_s 49,152, k = 256, no CE fused; ms per forward + backward): megatron CE 12, topk 11 (0.96x),
chunk_topk 10 (0.86x), gold 572 (48x), full 487 (41x). The fused column forms hold at or below
CE; the exact and gold forms stay blockwise (at most 1/128 of the positions per block, for the
memory target) and launch-bound.

The exact and gold forms by block size, one H200 at 0bf2ee4 (2026-11-27, ``checks.sh
bench_loss_blocks``; fp32, 16k tokens, V_s 49,152; the exact form's teacher terms read in 64
slices, the blocks' rows selected on the host; "block" = positions a block, ``--block-mib`` is
four times its fp32 buffer):

  block   blocks   gold ms   x CE    extra / logits   full ms   x CE    extra / logits
     85      193       378   32.2        3.3%             403   34.3        6.6%
    682       24       113    9.7       25.7%             249   21.3       51.2%
  2,730        6       101    8.5      102.5%             242   20.5      203.9%

(The default-block rows of that session's bench_loss part: gold 535, full 341 ms.) Launch-bound
at small blocks, ~1.6 ms (gold) and ~0.9 ms (full) a block; the extra memory grows 6.2 and 12.3
block buffers. Hence the accelerator default of ``loss.blocks.block_size.block_positions``: the largest
block whose buffers stay within 10% of the logits (gold 264 positions, full 133 here, from 85).
The profile at 85 positions: gold's GPU busy 154 ms of its 378 (torch.topk of 8,192 of the
~24k uncommon columns: 55 ms), full's 269 ms (the sparse projection and its transpose 91 ms,
gathers and sums of the [rows, |I|] projected mass 61 ms): at large blocks both are bound by
that GPU work, so the targets (2x / 1.5x CE) need fused kernels, not block sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, resource, sys, time
cfg = json.loads(sys.argv[1])
import torch
torch.set_num_threads(cfg["threads"])
import psutil

def rss():
    return psutil.Process().memory_info().rss

def reset_peak():  # from here on: the inputs' setup (payload, W) has its own, higher peak
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    elif os.path.exists("/proc/self/clear_refs"):  # Linux: VmHWM restarts from the RSS now
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

def peak_rss():
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak

n, vs, vt, form, k = cfg["tokens"], cfg["vs"], cfg["vt"], cfg["form"], cfg["topk"]
dtype = getattr(torch, cfg["dtype"])
dev = torch.device(cfg["device"])
gpu = dev.type == "cuda"
if gpu:
    dev = torch.device("cuda", dev.index or 0)
    torch.cuda.set_device(dev)

def fill(t):  # the same logits every time (B = 1: [1, n, v] and [n, 1, v] share one layout)
    return t.normal_(0.0, 2.0, generator=torch.Generator(dev).manual_seed(0))

def clock():  # (wall, process CPU) seconds, after the device's queued work
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()

def memory():  # bytes in use now (GPU: allocated by torch; CPU: resident set)
    return torch.cuda.memory_allocated() if gpu else rss()

gen = torch.Generator().manual_seed(0)
logits = fill(torch.empty((n, 1, vs) if form == "ce" else (1, n, vs), dtype=dtype, device=dev))
labels = torch.randint(0, vs, (1, n), generator=torch.Generator().manual_seed(1)).to(dev)
timings = []
if form == "ce":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    from megatron_xdistill.mcore import compat as mcore_compat
    mcore_compat.install()
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    work = logits  # [s, b, v]; the CE overwrites it, so it is refilled before every run
    target = labels.t().contiguous()
    base = memory()
    for i in range(cfg["repeat"] + 1):
        if i == 1:
            reset_peak()  # the timed runs' peak, not the warm-up's one-time work
        fill(work)
        leaf = work.requires_grad_(True)
        t0, c0 = clock()
        loss = vocab_parallel_cross_entropy(leaf, target, tp_group=dist.group.WORLD).mean()
        loss.backward()
        t1, c1 = clock()
        timings.append((t1 - t0, c1 - c0))
        leaf.grad = None
        work = work.detach()
else:
    from megatron_xdistill.loss import (PayloadSpec, ProjectionShard, TeacherPayload,
                                        parallel_kd_loss)
    c = int(n * 0.7)
    ids = (torch.arange(n) * c // n).view(1, n)
    real_w = None
    if cfg["projection"]:  # a real W (its vocabularies set vs and vt)
        from megatron_xdistill.projection.runtime import load_projection
        real_w = load_projection(cfg["projection"])
        idx, w = real_w.local_shard(0, vs)
    else:
        idx = torch.randint(0, vt, (vs, 4), generator=gen)
        w = torch.rand(vs, 4, generator=gen)
        kind = torch.rand(vs, 1, generator=gen)
        w[:, 1:] *= (kind > 0.45).float()        # ~45% one-to-one rows
        idx[:, 1:][(kind <= 0.45).expand(-1, 3)] = -1
        w /= w.sum(1, keepdim=True)              # rows sum to 1, as the projection builders write
        empty = torch.rand(vs, generator=gen) < 0.001  # a few empty rows (tokens W cannot map)
        idx[empty], w[empty] = -1, 0.0
    shard = ProjectionShard(idx, w, 0, vt)
    has = torch.ones(1, c, dtype=torch.bool)
    logp = torch.log_softmax(torch.randn(1, c, k, generator=gen), -1)
    common = None
    if form == "topk":
        payload = TeacherPayload(PayloadSpec("topk", c, k), logp, has,
                                 columns=torch.randperm(vt, generator=gen)[:k].sort().values[None])
    elif form == "chunk_topk":
        payload = TeacherPayload(PayloadSpec("chunk_topk", c, k), logp, has,
                                 columns=torch.randint(0, vt, (1, c, k), generator=gen),
                                 tail_logprob=torch.full((1, c), -2.0))
    elif form == "full":  # [c, V_t] log-probs written block by block (no full-size transient,
        spec = PayloadSpec("full", c, vt)  # which the peak RSS would count as the loss's memory)
        flat = torch.empty(1, spec.numel)
        rows = flat[0, : c * vt].view(c, vt)
        for lo in range(0, c, 256):
            rows[lo: lo + 256] = torch.log_softmax(
                torch.randn(min(256, c - lo), vt, generator=gen), -1)
        flat[0, c * vt:] = 1.0  # has_teacher
        payload = TeacherPayload.from_flat(flat, spec)
    elif form == "image":  # P on W's image from the full form's rows, the teacher's sums
        from megatron_xdistill.loss import teacher_image
        from megatron_xdistill.loss.definitions.payload import float64_as_pair
        image = teacher_image(idx, w, vs)
        spec = PayloadSpec("image", c, image.numel())
        flat = torch.empty(1, spec.numel)
        rows = flat[0, : c * image.numel()].view(c, image.numel())
        sums = torch.empty(c, 2, dtype=torch.float64)
        argmax = torch.empty(c)
        rest = torch.ones(vt, dtype=torch.bool)
        rest[image] = False
        for lo in range(0, c, 256):
            block = torch.log_softmax(torch.randn(min(256, c - lo), vt, generator=gen), -1)
            rows[lo: lo + 256] = block[:, image].exp()
            every = block.double()
            sums[lo: lo + 256, 0] = (every.exp() * every).sum(-1)
            sums[lo: lo + 256, 1] = every[:, rest].exp().sum(-1)
            argmax[lo: lo + 256] = block.argmax(-1).float()
        at = c * image.numel()
        flat[0, at + c: at + 5 * c] = float64_as_pair(sums).reshape(-1)  # after has_teacher
        flat[0, at: at + c] = 1.0
        flat[0, at + 5 * c:] = argmax
        payload = TeacherPayload.from_flat(flat, spec)
    else:  # gold: half of the student vocabulary is common (a real W: its strict pairs)
        common = (torch.randperm(vs, generator=gen)[: vs // 2].sort().values if real_w is None
                  else real_w.common_vocab("strict")[0])
        m = common.numel()
        unc = min(8192, vt - m)
        payload = TeacherPayload(
            PayloadSpec("gold", c, m, unc), torch.log_softmax(torch.randn(1, c, m), -1), has,
            uncommon_probs=torch.rand(1, c, unc).sort(-1, descending=True).values * 1e-3)
    mode = "gold" if form == "gold" else "pkl"
    if form not in ("full", "image") or gpu:
        payload = TeacherPayload.from_flat(payload.to_flat().to(dev), payload.spec)
    ids, has = ids.to(dev), has.to(dev)
    common = None if common is None else common.to(dev)
    shard = shard.to(dev)
    base = memory()
    work = logits

    def kd_step():  # one forward + backward of the KD loss (+ CE with --with-ce)
        global work  # like the CE, the loss writes its gradient over the logits (training's
        fill(work)   # call with one teacher): refilled outside the timed region
        leaf = work.requires_grad_(True)
        t0, c0 = clock()
        terms = parallel_kd_loss(leaf, payload, ids, has, has, shard, student_vocab_size=vs,
                                 mode=mode, common_student_ids=common,
                                 labels=labels if cfg["with_ce"] else None,
                                 block_bytes=None if cfg["block_mib"] is None
                                 else cfg["block_mib"] << 20,
                                 grad_into_logits=cfg["grad_into_logits"],
                                 loss_weights=None if cfg["recompute"] else (1.0 / c, 1.0))
        (terms.kd_sum / c + terms.ce_sum).backward()  # every chunk counts: kd_count = c
        t1, c1 = clock()
        leaf.grad = None
        work = work.detach()
        return t1 - t0, c1 - c0

    for i in range(cfg["repeat"] + 1):
        if i == 1:
            reset_peak()  # the timed runs' peak, not the warm-up's (Numba's compiling, caches)
        timings.append(kd_step())
# .grad: a new buffer, except where the KD loss writes it over the logits
grad_bytes = (0 if form != "ce" and cfg["grad_into_logits"]
              else logits.numel() * logits.element_size())
if gpu:
    peak = torch.cuda.max_memory_allocated()
else:
    peak = peak_rss()
profile = None
if cfg["profile"] and form != "ce":  # one more forward + backward under torch.profiler
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profiler(activities=acts) as prof:
        kd_step()
        clock()
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    profile = prof.key_averages().table(sort_by=key, row_limit=cfg["profile"])
best = timings[1:]
print(json.dumps({
    "wall_s": min(t[0] for t in best), "cpu_s": min(t[1] for t in best),
    "extra_gib": (peak - base) / 2**30, "grad_gib": grad_bytes / 2**30,
    "logits_gib": logits.numel() * logits.element_size() / 2**30, "profile": profile,
}))
"""


def run(cfg: dict) -> dict:
    """One measurement in a child process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]))
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _positions_a_block(name: str, tokens: int, vs: int, args: argparse.Namespace) -> str:
    """Positions per block of the blockwise forms (the exact and gold ones; "-" for the others,
    which a GPU runs as one fused block)."""
    import torch

    from megatron_xdistill.loss.blocks.block_size import block_positions
    from megatron_xdistill.loss.kernels.gold import GoldKernel
    from megatron_xdistill.loss.kernels.pkl import DenseKernel

    kernel = {"KD full": DenseKernel, "KD image": DenseKernel, "KD gold": GoldKernel}.get(name)
    if kernel is None:
        return "-"
    itemsize = 2 if args.dtype == "bfloat16" else 4
    block_bytes = None if args.block_mib is None else args.block_mib << 20
    return str(block_positions(kernel, tokens, vs, itemsize, torch.device(args.device),
                               block_bytes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--vs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--vt", type=int, default=151936)
    parser.add_argument("--forms", nargs="+", default=["topk", "chunk_topk"],
                        choices=["topk", "chunk_topk", "full", "image", "gold"])
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda[:i]; on a GPU the ratio uses wall time and memory is "
                             "torch's allocated bytes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--block-mib", type=int, default=None,
                        help="one block's fp32 [block, V] buffer (default: the loss's own choice, "
                             "64 MiB and a share of the positions)")
    parser.add_argument("--with-ce", action="store_true", help="KD rows also fuse the CE")
    parser.add_argument("--fresh-grad", action="store_true",
                        help="the KD loss allocates the logits' gradient (grad_into_logits=False: "
                             "what a later-made loss on the same logits needs, e.g. teacher 1 "
                             "of several); default: written over the logits, as training's "
                             "call of teacher 0 and Megatron's CE do")
    parser.add_argument("--recompute", action="store_true",
                        help="the KD call gets no loss_weights: its backward recomputes each "
                             "block's softmax and sums (what a call gets whose loss weights are "
                             "not known before it, dynamic scaling, and teacher 0 of several "
                             "where another teacher's call recomputes); default: the forward "
                             "writes the gradient, as training's calls with known weights")
    parser.add_argument("--projection", default=None, metavar="PATH",
                        help="a real W (.safetensors from the projection CLI) instead of the "
                             "synthetic one; its vocabularies set V_s and V_t (gold: its strict "
                             "common pairs)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after each KD row, the ROWS operations (GPU: kernels) that took "
                             "the most time in one more forward + backward (torch.profiler)")
    args = parser.parse_args(argv)
    if args.projection:
        from megatron_xdistill.projection.runtime import load_projection
        real_w = load_projection(args.projection)
        args.vs, args.vt = [real_w.student_vocab_size], real_w.teacher_vocab_size
    port = 29000 + os.getpid() % 1000
    clock = "wall_s" if args.device.startswith("cuda") else "cpu_s"
    head = (f"{'tokens':>6} {'V_s':>7} {'method':<16} {'wall s':>7} {'cpu s':>7} {'x CE':>5} "
            f"{'extra GiB':>9} {'net of grad':>11} {'% logits':>8} {'pos/block':>9}")
    print(f"V_t={args.vt} W={args.projection or 'synthetic'} topk={args.topk} "
          f"dtype={args.dtype} threads={args.threads} "
          f"block={'default' if args.block_mib is None else f'{args.block_mib} MiB'}"
          f"{' +CE' if args.with_ce else ''} KD grad="
          f"{'fresh buffer' if args.fresh_grad else 'over the logits'}, "
          f"{'recomputed in the backward' if args.recompute else 'written by the forward'}")
    print(head)
    kept = []  # the printed rows, for benchmarks/results.py
    for tokens in args.tokens:
        for vs in args.vs:
            base = dict(tokens=tokens, vs=vs, vt=args.vt, topk=args.topk, dtype=args.dtype,
                        device=args.device,
                        threads=args.threads, repeat=args.repeat, port=port,
                        block_mib=args.block_mib, with_ce=args.with_ce,
                        grad_into_logits=not args.fresh_grad, recompute=args.recompute,
                        profile=args.profile, projection=args.projection)
            ce = run({**base, "form": "ce"})
            rows = [("megatron CE", ce)]
            for form in args.forms:
                rows.append((f"KD {form}", run({**base, "form": form})))
            for name, r in rows:
                net = r["extra_gib"] - r["grad_gib"]
                print(f"{tokens:>6} {vs:>7} {name:<16} {r['wall_s']:>7.3f} {r['cpu_s']:>7.3f} "
                      f"{r[clock] / ce[clock]:>5.2f} {r['extra_gib']:>9.3f} {net:>11.3f} "
                      f"{100 * net / r['logits_gib']:>7.1f}% "
                      f"{_positions_a_block(name, tokens, vs, args):>9}", flush=True)
                kept.append({"tokens": tokens, "vs": vs, "method": name, **{
                    k: v for k, v in r.items() if k != "profile"},
                    "x_ce": r[clock] / ce[clock], "net_gib": net,
                    "net_pct_logits": 100 * net / r["logits_gib"],
                    "positions_a_block": _positions_a_block(name, tokens, vs, args)})
            for name, r in rows:
                if r.get("profile"):
                    print(f"\n{name}, {tokens} tokens, V_s {vs}: one forward + backward\n"
                          f"{r['profile']}", flush=True)
    from results import write_rows

    write_rows("bench_loss", kept, params={k: v for k, v in vars(args).items()
                                           if k not in ("tokens", "vs")})


if __name__ == "__main__":
    main()
