"""Pass rate of a model on held-out prompts: greedy responses scored by a reward function.

    python -m megatron_xdistill.evaluation.prompt_scores --load CKPT --data-path heldout.jsonl \\
        --reward-fn last_number [--max-new-tokens 32] [--json out.json]
    python -m megatron_xdistill.evaluation.prompt_scores --hf-dir DIR --data-path ...

Each prompt (a record of :mod:`megatron_xdistill.onpolicy.prompts`, the tokenizer's own chat
template applied) gets a greedy response of at most ``--max-new-tokens`` tokens, ended by EOS;
the reward function (``exact_match``, ``last_number``, ``unit_tests`` or ``module:function``)
scores it; the result is the mean reward (the pass rate for 0/1 rewards) and every response.
``--load`` decodes with the Megatron GPTModel in this process (``megatron_xdistill.generation``,
KV-cached), ``--hf-dir`` with ``transformers``' ``generate``: the same greedy decoding.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from megatron_xdistill.evaluation.bits_per_byte import (
    model_tokenizer_dir,
    single_process_model,
    single_process_world,
)

#: greedy responses (ids, ended on EOS) to a batch of prompt id lists
Decoder = Callable[[list[list[int]]], list[tuple[list[int], bool]]]


def megatron_decoder(load: str, max_new_tokens: int, eos: int) -> Decoder:
    """Greedy decoding with a Megatron checkpoint at TP = PP = 1 in this process."""
    from megatron_xdistill.generation import SamplingParams, generate

    model, groups, info = single_process_model(load)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    def decode(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        out = generate(model, groups, prompts, params, eos_token_ids=[eos],
                       vocab_size=info.vocab_size, device=torch.device("cpu"))
        return [(out.response(i), bool(out.finished[i])) for i in range(len(prompts))]

    return decode


def hf_decoder(hf_dir: str, max_new_tokens: int, eos: int) -> Decoder:
    """Greedy decoding with ``transformers`` (one prompt at a time: no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def decode(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        out = []
        for prompt in prompts:
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=eos, pad_token_id=eos,
                                     top_k=None, top_p=None, temperature=None)
            response = ids[0, len(prompt):].tolist()
            if eos in response:
                response = response[: response.index(eos) + 1]
            out.append((response, bool(response) and response[-1] == eos))
        return out

    return decode


def score_prompts(decode: Decoder, tokenizer, records, reward_fn, batch_size: int = 8,
                  chat_template: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Mean reward of greedy responses to ``records`` and the responses themselves."""
    from megatron_xdistill.align import ids_bytes
    from megatron_xdistill.onpolicy.prompts import prompt_ids
    from megatron_xdistill.onpolicy.rewards import call_reward

    start = time.perf_counter()
    rows = []
    for lo in range(0, len(records), batch_size):
        part = records[lo: lo + batch_size]
        outputs = decode([prompt_ids(tokenizer, r, chat_template) for r in part])
        for record, (ids, finished) in zip(part, outputs):
            text = ids_bytes(tokenizer, ids).decode("utf-8", errors="replace")
            rows.append({"prompt": record.index, "response": text, "finished": finished,
                         "reward": call_reward(reward_fn, record, text)})
        if log is not None:
            log(f"  {len(rows)}/{len(records)} prompts ({time.perf_counter() - start:.0f} s)")
    mean = sum(r["reward"] for r in rows) / max(len(rows), 1)
    return {"prompts": len(rows), "mean_reward": mean, "seconds": time.perf_counter() - start,
            "responses": rows}


def evaluate_prompts(data: str, reward: str, load: str | None = None, hf_dir: str | None = None,
                     tokenizer: str | None = None, max_new_tokens: int = 64,
                     batch_size: int = 8, chat_template: bool = True, max_prompts: int | None = None,
                     log: Callable[[str], None] | None = None) -> dict:
    """Mean reward of a Megatron checkpoint (``load``) or an HF folder (``hf_dir``)."""
    if (load is None) == (hf_dir is None):
        raise ValueError("give exactly one of --load and --hf-dir")
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.onpolicy.prompts import read_prompts
    from megatron_xdistill.onpolicy.rewards import load_reward_fn

    tok = load_tokenizer(model_tokenizer_dir(load, hf_dir, tokenizer))
    records = read_prompts(data)[:max_prompts]
    reward_fn = load_reward_fn(reward)
    created = load is not None and single_process_world()
    try:
        if log is not None:
            log(f"loading {load or hf_dir}; {len(records)} prompts, reward {reward}")
        maker = megatron_decoder if load is not None else hf_decoder
        decode = maker(load or hf_dir, max_new_tokens, int(tok.eos_token_id))
        result = score_prompts(decode, tok, records, reward_fn, batch_size, chat_template, log)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
    return {"model": os.path.abspath(load or hf_dir), "data": os.path.abspath(data),
            "reward_fn": reward, "max_new_tokens": max_new_tokens, **result}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_xdistill.evaluation.prompt_scores",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--load", help="Megatron checkpoint: converted model or training run")
    which.add_argument("--hf-dir", help="Hugging Face model folder")
    p.add_argument("--data-path", required=True, help="prompt records (.jsonl / .parquet)")
    p.add_argument("--reward-fn", required=True,
                   help="exact_match, last_number, unit_tests or package.module:function")
    p.add_argument("--tokenizer-model", default=None,
                   help="HF tokenizer directory (default: the checkpoint's hf_files/ or --hf-dir)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--max-prompts", type=int, default=None, help="only the first N prompts")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, help="also write the result (and responses) here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(f"[prompt-scores] {message}", file=sys.stderr, flush=True)

    try:
        result = evaluate_prompts(args.data_path, args.reward_fn, load=args.load,
                                  hf_dir=args.hf_dir, tokenizer=args.tokenizer_model,
                                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                  chat_template=not args.no_chat_template,
                                  max_prompts=args.max_prompts, log=log)
    except (ValueError, FileNotFoundError) as exc:
        print(f"prompt-scores: error: {exc}", file=sys.stderr)
        return 2
    print(f"prompts {result['prompts']}  mean reward {result['mean_reward']:.4f}  "
          f"({result['seconds']:.1f} s)")
    if args.json:
        from megatron_xdistill.storage.atomic import write_json_atomic

        write_json_atomic(args.json, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
