"""``xdistill-convert``: HF <-> Megatron checkpoint conversion and verification.

    xdistill-convert hf-to-mcore --hf-dir DIR --out CKPT [--tp N --pp M --ep E] [--dtype bf16|fp32]
    xdistill-convert mcore-to-hf --load CKPT --out DIR [--hf-template DIR] [--dtype bf16|fp32]
    xdistill-convert verify --hf-dir DIR --load CKPT [--tp N --pp M --cp C --ep E]

hf-to-mcore runs TP x PP x EP and verify TP x PP x lcm(CP, EP) CPU ranks (spawned here, or the
world of ``torchrun``); EP (expert parallelism) applies to mixture-of-experts models.
Exit status: 0 ok, 1 verification above tolerance or a rank failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

_BAD_INPUT = (ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xdistill-convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    imp = sub.add_parser("hf-to-mcore", help="HF folder -> Megatron dist checkpoint")
    imp.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    imp.add_argument("--out", required=True,
                     help="checkpoint directory to create: a Megatron-LM release root (tracker + "
                     "release/), which our --load and Megatron-LM's --load both take")
    imp.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks that write")
    imp.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks that write")
    imp.add_argument("--ep", type=int, default=1,
                     help="expert-parallel ranks that write (mixture-of-experts models)")
    imp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                     help="weights dtype (default: the HF config's)")
    imp.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    exp = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF folder")
    exp.add_argument("--load", required=True,
                     help="converted checkpoint, or a training run (its latest iteration)")
    exp.add_argument("--out", required=True, help="HF folder to create")
    exp.add_argument("--hf-template", default=None,
                     help="HF folder whose config.json and tokenizer files to use")
    exp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                     help="weights dtype (default: the original HF model's)")
    exp.add_argument("--max-shard-size-gb", type=float, default=5.0)
    exp.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    ver = sub.add_parser("verify", help="compare HF and Megatron logits on the same tokens")
    ver.add_argument("--hf-dir", required=True)
    ver.add_argument("--load", required=True)
    ver.add_argument("--tp", type=int, default=1)
    ver.add_argument("--pp", type=int, default=1)
    ver.add_argument("--cp", type=int, default=1,
                     help="context-parallel ranks (--seq-length a multiple of 2 x CP)")
    ver.add_argument("--ep", type=int, default=1,
                     help="expert-parallel ranks (mixture-of-experts models)")
    ver.add_argument("--batch", type=int, default=2)
    ver.add_argument("--seq-length", type=int, default=64)
    ver.add_argument("--seed", type=int, default=0)
    ver.add_argument("--random-tokens", action="store_true",
                     help="only random ids (default: the first row is text, when a tokenizer is there)")
    ver.add_argument("--max-rel-diff", type=float, default=1e-3,
                     help="fail (exit 1) above this max |diff| / max |HF logit|")
    ver.add_argument("--json", default=None, help="also write the metrics to this file")
    for command in (imp, exp, ver):
        command.add_argument("--dry-run", action="store_true",
                             help="check the inputs (paths, the model's configuration against "
                             "the layout, the checkpoint's description, the tensors' names and "
                             "shapes where weights are there) and exit: nothing is converted")
    return parser


def _dry_run_hf(hf_dir: str, tp: int, pp: int, cp: int = 1, ep: int = 1) -> str:
    """``--dry-run`` of an HF folder: its configuration and layout, and its tensors' names and
    shapes from their headers when it holds weights (said when it does not)."""
    from conversion.mapping import check_hf_tensors
    from conversion.safetensors_io import SafetensorsFolder
    from megatron_xdistill.models.hf_config import check_layout, model_info_from_hf
    from megatron_xdistill.models.moe import moe_config_kwargs

    info = model_info_from_hf(hf_dir)
    check_layout(info, tp, pp, cp)
    moe_config_kwargs(info, ep)
    try:
        folder = SafetensorsFolder(hf_dir)
    except FileNotFoundError:
        tensors = "no weights there: tensor names and shapes not checked"
    else:
        with folder:
            check_hf_tensors(folder, info)
        tensors = "tensor names and shapes checked"
    return (f"{hf_dir}: {info.architecture}, {info.num_layers} layers, vocab {info.vocab_size}, "
            f"fits TP {tp} x PP {pp} x CP {cp}" + (f" x EP {ep}" if ep > 1 else "")
            + f"; {tensors}")


def _hf_to_mcore(args) -> int:
    from conversion.hf_to_mcore import convert_hf_to_mcore, preflight
    from conversion.launch import log, run_distributed
    from megatron_xdistill.storage import refuse_existing, require_directory

    require_directory(args.hf_dir, "--hf-dir")
    refuse_existing(args.out, args.overwrite)
    if args.dry_run:
        log(f"dry run: {_dry_run_hf(args.hf_dir, args.tp, args.pp, ep=args.ep)}; would write "
            f"{args.out}")
        return 0
    info, _ = preflight(args.hf_dir, args.tp, args.pp, args.ep)
    ranks = args.tp * args.pp * args.ep
    log(f"{args.hf_dir}: {info.architecture}, {info.num_layers} layers, vocab {info.vocab_size}; "
        f"{ranks} rank(s)")
    run_distributed(convert_hf_to_mcore, ranks, args.hf_dir, args.out, args.tp,
                    args.pp, args.dtype, args.overwrite, ep=args.ep)
    return 0


def _mcore_to_hf(args) -> int:
    from conversion.launch import run_distributed
    from conversion.mcore_to_hf import convert_mcore_to_hf
    from megatron_xdistill.storage import require_directory

    require_directory(args.load, "--load")
    if args.hf_template is not None:
        require_directory(args.hf_template, "--hf-template")
    if args.dry_run:
        from conversion.launch import log
        from megatron_xdistill.models.description import load_model_info
        from megatron_xdistill.storage import refuse_existing

        refuse_existing(args.out, args.overwrite)
        info = load_model_info(args.load)
        log(f"dry run: {args.load}: {info.architecture}, {info.num_layers} layers, vocab "
            f"{info.vocab_size}; would write {args.out}")
        return 0
    run_distributed(convert_mcore_to_hf, 1, args.load, args.out, args.hf_template, args.dtype,
                    args.max_shard_size_gb, args.overwrite)
    return 0


def _verify(args) -> int:
    from conversion.launch import log, run_distributed
    from conversion.verify import verify_conversion
    from megatron_xdistill.storage import require_directory

    require_directory(args.hf_dir, "--hf-dir")
    require_directory(args.load, "--load")
    if args.dry_run:
        from megatron_xdistill.models.description import load_model_info

        info = load_model_info(args.load)
        log(f"dry run: {_dry_run_hf(args.hf_dir, args.tp, args.pp, args.cp, args.ep)}; --load "
            f"{args.load}: {info.architecture}, vocab {info.vocab_size}")
        return 0
    ranks = args.tp * args.pp * math.lcm(args.cp, args.ep)
    metrics = run_distributed(verify_conversion, ranks, args.hf_dir,
                              args.load, args.tp, args.pp, args.batch, args.seq_length, args.seed,
                              not args.random_tokens, args.cp, ep=args.ep)
    ok = metrics["max_rel_diff"] <= args.max_rel_diff
    metrics["passed"] = ok
    ep = f" EP={args.ep}" if args.ep > 1 else ""
    log(f"TP={args.tp} CP={args.cp} PP={args.pp}{ep}, {args.batch}x{args.seq_length} tokens: "
        f"max abs diff {metrics['max_abs_diff']:.3e}, max rel diff {metrics['max_rel_diff']:.3e} "
        f"(max |logit| {metrics['max_abs_logit']:.2f}), mean abs diff "
        f"{metrics['mean_abs_diff']:.3e}, top-1 agreement {metrics['top1_agreement']:.4f} -> "
        f"{'PASS' if ok else 'FAIL'} (tolerance {args.max_rel_diff:g})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(metrics, fh, indent=2)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Conversion runs on the CPU with gloo, also on GPU machines (inherited by spawned ranks).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron_xdistill.models import CheckpointError

    start = time.time()
    command = {"hf-to-mcore": _hf_to_mcore, "mcore-to-hf": _mcore_to_hf, "verify": _verify}
    try:
        status = command[args.command](args)
    except (*_BAD_INPUT, CheckpointError) as exc:
        print(f"xdistill-convert {args.command}: error: {exc}", file=sys.stderr)
        return 2
    print(f"[xdistill-convert] {args.command} done in {time.time() - start:.1f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
