"""Command-line arguments of ``pretrain_xdistill.py``, in Megatron-LM's names and style.

Teacher-side arguments mirror the student's with a ``--teacher-`` prefix. The parser and the
options derived from its values; :mod:`.checks` validates them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_xdistill.onpolicy.arguments import add_onpolicy_arguments
from megatron_xdistill.parallel.placement import PLACEMENTS
from megatron_xdistill.teachers.spec import COMBINATIONS
from megatron_xdistill.training.arguments.config_file import parse_with_config
from megatron_xdistill.training.arguments.megatron_lm import (
    MegatronArgumentParser,
    add_megatron_lm_arguments,
)

KD_LOSSES = ("pkl", "gold", "hkl")
TOPK_MODES = ("global", "chunk")


def _parallel(parser: argparse.ArgumentParser, prefix: str, who: str) -> None:
    group = parser.add_argument_group(f"{who} parallelism")
    group.add_argument(f"--{prefix}tensor-model-parallel-size", type=int, default=1,
                       help=f"{who}: tensor parallel size (TP)")
    group.add_argument(f"--{prefix}pipeline-model-parallel-size", type=int, default=1,
                       help=f"{who}: pipeline parallel size (PP)")
    group.add_argument(f"--{prefix}context-parallel-size", type=int, default=1,
                       help=f"{who}: context parallel size (CP); DP is what remains")
    group.add_argument(f"--{prefix}expert-model-parallel-size", type=int, default=1,
                       help=f"{who}: expert parallel size (EP, mixture-of-experts models): the "
                       f"experts are spread over EP of each stage's CP x DP ranks")
    group.add_argument(f"--{prefix}sequence-parallel", action="store_true",
                       help=f"{who}: sequence parallelism (norms, dropout and residuals on 1/TP "
                       f"of the sequence; needs TP > 1)")


def build_parser() -> argparse.ArgumentParser:
    """All arguments, grouped as in Megatron-LM."""
    p = MegatronArgumentParser(
        prog="pretrain_xdistill.py",
        description="Cross-tokenizer knowledge distillation on Megatron-Core "
        "(run with torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true",
                   help="check every input and exit: the arguments, each model's configuration "
                   "against its layout, the resume point and its learning-rate schedule, the "
                   "tokenizers against the checkpoints and the projections, the first records "
                   "of the data files and the teacher caches; nothing is built or trained")
    p.add_argument("--config", default=None, metavar="RUN.yaml",
                   help="YAML file of these arguments (keys: the flag names, grouped or not: "
                   "teacher: {load: ...}), followed by dotted key=value overrides; flags given "
                   "on the command line win")
    _parallel(p, "", "student")
    _parallel(p, "teacher-", "teacher")
    g = p.add_argument_group("teacher placement")
    g.add_argument("--teacher-placement", choices=PLACEMENTS, default="colocated",
                   help="colocated: every rank holds a student shard and a teacher shard "
                   "(time-shared); disaggregated: the last --teacher-ranks ranks run only the "
                   "teacher, which computes the next global batch while the student ranks train "
                   "on the current one (payloads double-buffered, sent non-blocking)")
    g.add_argument("--teacher-ranks", type=int, default=None,
                   help="with --teacher-placement disaggregated: how many of the world's ranks "
                   "serve the teacher (the last N ranks); the student gets the rest")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks")
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="student: reduce gradients over DP bucket by bucket during the backward "
                   "(Megatron-Core DDP), instead of after it")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="student, with --use-distributed-optimizer: gather the updated "
                   "parameters bucket by bucket during the next forward")
    p.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per DDP communication bucket (default: Megatron-Core's, "
                   "max(40M, 1M x DP) with overlap)")
    g = p.add_argument_group("activation recomputation (student; the teacher keeps none)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute whole transformer layers in backward (needs "
                   "--recompute-method and --recompute-num-layers); selective: recompute the "
                   "core attention only")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="uniform: checkpoint every group of --recompute-num-layers layers; "
                   "block: recompute the first --recompute-num-layers layers of each stage")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recompute group (uniform) or per stage (block)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--load", default=None,
                   help="required unless --teacher-cache-only (which builds no student). "
                   "Student checkpoint: a converted model (xdistill-convert), a --save dir "
                   "(resumed), or a Megatron-LM / Megatron-Bridge torch_dist checkpoint root "
                   "('release' tracker, or with --finetune)")
    g.add_argument("--teacher-load", default=None,
                   help="teacher checkpoint (xdistill-convert, or a Megatron-LM / Megatron-Bridge "
                   "torch_dist checkpoint root); optional when --teacher-cache holds a complete "
                   "cache (the teacher is then neither loaded nor run)")
    g.add_argument("--finetune", action="store_true",
                   help="as in Megatron-LM: take only the model weights of --load (even a "
                   "training checkpoint) and start at iteration 0 with a fresh optimizer")
    g.add_argument("--no-load-optim", action="store_true",
                   help="when resuming, keep a fresh optimizer and LR schedule (Megatron-LM's flag)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="when resuming, keep this run's RNG state (Megatron-LM's flag)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="when resuming with other learning-rate schedule flags than the "
                   "checkpoint's (e.g. a longer --train-iters): follow these arguments from the "
                   "checkpoint's iteration on (Megatron-LM's flag; without it or "
                   "--use-checkpoint-opt_param-scheduler such a run is refused)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler",
                   help="when resuming: keep the checkpoint's learning-rate schedule whatever "
                   "the schedule flags say (Megatron-LM's flag; iterations past its decay train "
                   "at its --min-lr)")
    g.add_argument("--save", default=None, help="directory for training checkpoints")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves")
    g.add_argument("--keep-last-checkpoints", type=int, default=None, metavar="N",
                   help="after each save keep only the N newest checkpoints under --save (the "
                   "older ones are removed once the new one is complete). Default: keep all, as "
                   "Megatron-LM does; a 135M student's checkpoint with its Adam state takes "
                   "about 1.6 GB")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving) once the iteration is a multiple of this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (what schedulers send before killing a job), save a "
                   "checkpoint after the current step and exit 0; rerun the command to resume")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save a checkpoint and exit 0 once the run has been going this long "
                   "(set it below the allocation's time limit)")

    g = p.add_argument_group("tokenizers and projection")
    g.add_argument("--tokenizer-model", required=True, help="student HF tokenizer directory")
    g.add_argument("--teacher-tokenizer-model", default=None,
                   help="teacher HF tokenizer directory (required unless --teachers-config "
                   "names each teacher's)")
    g.add_argument("--projection-path", default=None,
                   help="projection file (xdistill-projection build); built on the fly if omitted, "
                        "not used with --kd-weight 0 (CE alone)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", required=True,
                   help="training files ([weight] path ...): .jsonl/.parquet/.arrow/.txt, globs, "
                        "HF datasets folders, Megatron indexed dataset prefixes (PREFIX.bin/.idx)")
    g.add_argument("--valid-data-path", nargs="+", default=None, help="held-out files")
    g.add_argument("--split", default=None,
                   help="Megatron-LM's train,valid,test document split of --data-path (e.g. "
                        "969,30,1): the valid part is held out and evaluated instead of "
                        "--valid-data-path, the test part is not used")
    g.add_argument("--text-field", default="text", help="field/column holding the text")
    g.add_argument("--data-tokenizer-model", default=None,
                   help="HF tokenizer directory that made the Megatron indexed datasets "
                        "(PREFIX.bin/.idx) among the data paths; they are decoded back to text "
                        "with it (default: --tokenizer-model, as in Megatron-LM)")
    g.add_argument("--seq-length", type=int, required=True, help="student sequence length")
    g.add_argument("--teacher-seq-length", type=int, default=None,
                   help="the most teacher tokens a sample holds (each teacher micro-batch "
                   "runs only the positions its longest text needs). Default: derived from the "
                   "data: the 98th percentile of the teacher / student token ratio on a sample "
                   "of the documents times --seq-length, so a student sample's text nearly "
                   "always fits")
    g.add_argument("--samples-per-epoch", type=int, default=None, metavar="N",
                   help="pack the training data into N samples and train in passes over them "
                   "(epochs, the same samples in the same order each pass) when --train-iters x "
                   "--global-batch-size is larger: fine-tuning on a small set for several "
                   "epochs. Default: --train-iters x --global-batch-size (one pass, new text "
                   "every step). A complete teacher cache holds its own plan: N must match it")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    g.add_argument("--data-cache-path", default=None,
                   help="where packing plans are cached (default: <save>/data_cache, else "
                   "$XDG_CACHE_HOME/megatron-xdistill/data, i.e. ~/.cache/...; never the "
                   "current directory)")
    g.add_argument("--seed", type=int, default=1234, help="data order and initialisation seed")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--train-iters", type=int, default=None,
                   help="iterations to train (global batches); or --train-samples")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train, as in Megatron-LM: --train-samples / "
                   "--global-batch-size iterations, and a learning-rate schedule counted in "
                   "samples (--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples)")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=("exponential", "linear", "cosine", "minus_sqrt"),
                   help="WSD: the decay over the last --lr-wsd-decay-iters")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: iterations of the final decay (the rest after warmup is stable)")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay length (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate at the start of the warmup")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples: the decay length in samples (default: "
                   "--train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="with --train-samples: the warmup length in samples")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="with --train-samples and WSD: the final decay's length in samples")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="Megatron's optimizer (sgd: plain SGD with --sgd-momentum)")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true", help="bf16 weights and activations")

    g = p.add_argument_group("distillation")
    g.add_argument("--kd-loss", choices=KD_LOSSES, default="gold",
                   help="gold/ULD hybrid (gold, the default), H-KL (hkl) or projected KL (pkl). "
                   "gold is the default by measurement: in the quality study (11M random-init "
                   "student, SmolLM2-135M teacher, 3 seeds) gold from its compact payload "
                   "(--kd-gold-topk 64, --kd-gold-uncommon-topk 256: 1,554 B per student token) "
                   "taught 0.135 / 0.048 bits/byte better than pkl top-64 on the two held-out "
                   "sets, every seed, beyond twice the seed spread, and within the spread of gold "
                   "from its full payload (120-190 KB per token). It costs 3x pkl's payload (522 B "
                   "per token) and, on CPU, 2.9x the time of Megatron's CE (2,048 tokens, "
                   "49,152 columns; benchmarks/bench_loss.py, whose GPU rows of the fused "
                   "compact kernels a device run still owes; pkl's chunk top-64 is 0.6-1.6x CE "
                   "there). hkl, gold with cross-token common pairs, tied full "
                   "gold but lost more to the compact payload. pkl is the cheapest payload that "
                   "trains and the only form of --kd-topk, --kd-topk-mode and --kd-first-token; "
                   "on the study's pretrained pair (SmolLM2-135M <- Qwen2.5-Coder-0.5B) pkl with "
                   "--kd-first-token led full gold by 0.005 / 0.009, within the spread "
                   "(examples/cross_tokenizer_distillation/REPORT.md, docs/losses.md)")
    g.add_argument("--kd-gold-topk", type=int, default=None, metavar="K",
                   help="gold / hkl: the teacher ships each chunk's K most probable common "
                   "pairs and one bucket for its mass on the others (the student's bucket is "
                   "exact); 0 = every common pair. Default 64: with --kd-gold-uncommon-topk 256 "
                   "the payload is 1,548 B a chunk (2K + K' + 3 floats) instead of 120-190 KB "
                   "per token; 0 and 0 ship the full gold payload (docs/losses.md, 'Compact "
                   "gold / H-KL')")
    g.add_argument("--kd-gold-uncommon-topk", type=int, default=None, metavar="K'",
                   help="gold / hkl: the teacher ships its K' largest uncommon probabilities, "
                   "sorted, and one tail for the rest of the 8,192 ranks the loss compares "
                   "(the student's tail is exact); 0 = all of them. Default 256, which keeps "
                   "the default payload under 2 KB per token")
    g.add_argument("--kd-temperature", type=float, default=1.0,
                   help="softens both sides' distributions (the KL is scaled by T^2). 1 by "
                   "measurement: in the quality study (3 seeds) T = 2 lost most of T = 1's gain "
                   "over CE only (examples/cross_tokenizer_distillation/REPORT.md)")
    g.add_argument("--kd-topk", type=int, default=None,
                   help="pkl: teacher columns shipped (default 64): N = top-N (see mode); 0 = "
                   "the exact P-KL "
                   "over the full vocabulary, whose teacher ships the columns of W's image with "
                   "its sums over the rest (2.4x the loss time of chunk top-256 on CPU with the "
                   "SmolLM2 -> Qwen2.5 W at 4,096 tokens, 300x top-64's payload, was 1,200x with "
                   "every column; "
                   "top-64 per chunk keeps the gradient's direction to cosine 0.999, "
                   "benchmarks/bench_loss_compression.py). Top-64 is the default for its payload "
                   "(522 B per student token); in the quality study (random-init student, 3 seeds) "
                   "top-1024 taught better by 0.03 / 0.06 bits/byte at 16x the bytes and 2.6x "
                   "the loss time on CPU: worth it where the payload is cheap (an online teacher "
                   "on the same node); top-8 kept three quarters of top-64's gain")
    g.add_argument("--kd-topk-mode", choices=TOPK_MODES, default=None,
                   help="pkl (default chunk): global: one top-N column set per micro-batch "
                   "(NeMo-RL vocab_topk); chunk: top-N per chunk plus a tail bucket")
    g.add_argument("--kd-reverse", action="store_true", help="reverse KL (student || teacher)")
    g.add_argument("--gkd-beta", type=float, default=None, metavar="BETA",
                   help="GKD's generalized Jensen-Shannon divergence: beta KL(P || M) + "
                   "(1 - beta) KL(Q || M), M = beta P + (1 - beta) Q (teacher P, student Q), as "
                   "TRL's GKD trainer: 0 is the forward KL, 1 the reverse KL (--kd-reverse). "
                   "Default: forward KL")
    g.add_argument("--kd-skip-student-split-chunks", action="store_true",
                   help="P-KL: count no chunk that the student spells in more tokens than the "
                   "teacher (e.g. student 'de' + 'f', teacher 'def'). There the teacher's mass "
                   "sits on a token that no student token projects to, so the KL cannot fall "
                   "(pretrained pair of the quality study: 10%% of the chunks, 45%% of the KL) "
                   "and its gradient pulls the student towards other spellings of the text")
    g.add_argument("--kd-first-token", action="store_true",
                   help="P-KL, chunk top-k payload: compare what both models predict the text "
                   "continues with at each chunk start: the student position that predicts the "
                   "chunk's first token against the teacher's (chunks of one teacher token; the "
                   "others are not counted), with the teacher's mass on each token moved to the "
                   "teacher twin of the student token its text begins with (teacher ');\\n' "
                   "counts for the student's ');'), where the chunk average of P-KL sets the "
                   "student's 'de' and 'f' against the teacher's 'def'. Student side only: a "
                   "teacher cache of the same payload serves it. Off by default: in the quality "
                   "study it led the chunk average by 0.011 and 0.035 bits/byte (11M student, 4 "
                   "epochs of 1000 samples, 5 of 6 seed and held-out pairs; within twice the "
                   "seed spread, both 0.09-0.14 ahead of CE only) and tied it on the pretrained "
                   "pair (one pass, one seed); the chunk average serves every payload form")
    g.add_argument("--kd-weight", type=float, default=1.0,
                   help="weight of the KD term (see --ce-weight). On the quality study's "
                   "pretrained pair (SmolLM2-135M fine-tuned on code, Qwen2.5-Coder-0.5B "
                   "teacher) the teacher counts most on a small set seen several times: 3 "
                   "epochs of 200 samples at weight 1 with --kd-first-token ended 0.048 "
                   "bits/byte ahead of CE-only on unseen code and 0.026 on held-out stdlib "
                   "modules (3 of 3 seeds; CE alone overfitted); an 11M random-init student, 4 "
                   "epochs of 1000 samples, SmolLM2-135M teacher: 0.10 and 0.17 ahead on both "
                   "held-out sets at chunk starts, 0.09 and 0.14 with the chunk average (3 of 3 "
                   "seeds each). One pass over 600 samples: weight "
                   "1 led CE-only on unseen code (0.006-0.008) and trailed it on the stdlib "
                   "(0.009), where 0.1-0.3 tied it (one seed)")
    g.add_argument("--ce-weight", type=float, default=1.0,
                   help="L = kd_weight * KD + ce_weight * CE. Default 1 (KD + CE) from the "
                   "quality study (examples/cross_tokenizer_distillation, 3 seeds, 1M student "
                   "tokens each): P-KL + CE was ahead of CE-only fine-tuning in 5 of 6 "
                   "held-out comparisons; --ce-weight 0.1 trailed CE-only on all 6, KD alone "
                   "(--ce-weight 0) by over 1 bit/byte")
    g.add_argument("--kd-dynamic-scaling", action="store_true",
                   help="L = sg(CE / KD) * KD + CE (one teacher: weights ignored; several: KD "
                   "is their weighted sum). Off by default: in the quality study it matched "
                   "weights 1 / 1 on one held-out set and was noisier on the other")

    add_onpolicy_arguments(p)
    add_megatron_lm_arguments(p)

    g = p.add_argument_group("several teachers")
    g.add_argument("--teachers-config", default=None, metavar="TEACHERS.yaml",
                   help="distil from several teachers: a YAML list under 'teachers', each with "
                   "its own load, tokenizer_model, projection_path, tensor/pipeline/context "
                   "parallel sizes, seq_length, kd_loss, kd_topk, kd_topk_mode, kd_gold_topk, "
                   "kd_gold_uncommon_topk, kd_temperature, "
                   "kd_reverse, gkd_beta, kd_skip_student_split_chunks, kd_first_token, weight, "
                   "ranks and cache "
                   "(unset keys: the --teacher-* / --kd-* "
                   "flags). A teacher with the student's tokenizer takes a direct token-level "
                   "KL (no projection). Colocated: the teachers run one after the other on every "
                   "rank; disaggregated: each on its own 'ranks' (after the student's), all "
                   "computing the next batch while the student trains")
    g.add_argument("--teacher-combination", choices=COMBINATIONS, default=None,
                   help="sum: L = sum_k weight_k * KD_k + ce_weight * CE; select: per sample, "
                   "only the teacher with the lowest CE on the sample's text (nats, summed over "
                   "its own tokens, so tokenizers compare) teaches it. Default: the config's "
                   "'combination', else sum")

    g = p.add_argument_group("teacher payload cache")
    g.add_argument("--teacher-cache", default=None, metavar="DIR",
                   help="teacher payload cache: a complete cache in DIR is read (teacher neither "
                   "loaded nor run; any student layout, any number of epochs over its plan); an "
                   "empty or partial one is filled by this run as it computes the payloads")
    g.add_argument("--teacher-cache-only", action="store_true",
                   help="fill --teacher-cache and exit: no student is built, every rank serves "
                   "the teacher (its layout spans the world); resumes where a killed pass "
                   "stopped. The plan has --samples-per-epoch (default --train-iters x "
                   "--global-batch-size) samples")
    g.add_argument("--teacher-cache-shard-mib", type=int, default=256,
                   help="size of the cache's shard files (each is committed atomically)")
    g.add_argument("--teacher-cache-commit-seconds", type=float, default=120.0,
                   help="commit queued payloads as a shard at least this often, whatever its "
                   "size: a killed pass loses at most this much teacher work")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=4,
                   help="global batches of --valid-data-path per evaluation (as in Megatron-LM)")
    g.add_argument("--eval-tasks", nargs="+", default=None, metavar="TASK",
                   help="lm-evaluation-harness tasks (names, or paths of local task YAMLs; "
                   "xdistill_humaneval) scored on the student at each evaluation: every "
                   "--eval-interval iterations and at the end (docs/evaluation.md)")
    g.add_argument("--eval-limit", type=int, default=None,
                   help="documents per --eval-tasks task at each evaluation (default: all)")
    g.add_argument("--metrics-file", default=None, help="JSON Lines file of logged metrics")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None,
                   help="log to Weights & Biases under this project (pip install wandb; "
                   "WANDB_MODE=offline writes locally)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name")
    g.add_argument("--wandb-save-dir", default=None, help="where W&B writes its files")
    g.add_argument("--wandb-entity", default=None, help="W&B team or user")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    return p


def model_options(args: argparse.Namespace, who: str) -> dict:
    """TransformerConfig fields of one side's arguments: sequence parallelism, and the
    student's activation recomputation."""
    prefix = "" if who == "student" else "teacher_"
    options = {"sequence_parallel": bool(getattr(args, f"{prefix}sequence_parallel"))}
    if who == "student":
        options.update(recompute_options(args))
    return options


def recompute_options(args: argparse.Namespace) -> dict:
    """The student's TransformerConfig fields for activation recomputation (Megatron's names)."""
    if args.recompute_granularity is None:
        return {}
    options = {"recompute_granularity": args.recompute_granularity}
    if args.recompute_granularity == "full":
        options.update(recompute_method=args.recompute_method,
                       recompute_num_layers=args.recompute_num_layers)
    return options


def trains_ce_only(args: argparse.Namespace) -> bool:
    """``--kd-weight 0`` without dynamic scaling: the teacher's term would be multiplied by 0, so
    the run trains on CE alone and needs no teacher, payload or projection. With several
    teachers (each weight > 0) never."""
    teachers = getattr(args, "teachers", None)
    if teachers is not None and len(teachers) > 1:
        return False
    return args.kd_weight == 0 and not args.kd_dynamic_scaling


def parse_command_line(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, not yet validated: ``--config run.yaml [key=value ...]`` gives defaults
    for every flag (see :mod:`.config_file`), flags given on the command line win. Argparse
    errors exit with usage; a bad config raises ValueError."""
    return parse_with_config(build_parser(), list(sys.argv[1:] if argv is None else argv))
