"""The comparison's report (``run.py``): the held-out table, the verdict of each variant against
CE-only, the plots and REPORT.md, all from the comparison's ``results.json``."""

from __future__ import annotations

from pathlib import Path

BEFORE, TEACHER = "student-before", "teacher"


def rows(results: dict) -> list[dict]:
    """One row per scored model: label, bpb, CE/token, change vs student-before."""
    cfg, evals = results["config"], results["evals"]
    base = evals[BEFORE]["bits_per_byte"]
    out = []
    order = [BEFORE, *[n for n in cfg["variants_to_run"] if n in evals], TEACHER]
    for key in order:
        if key not in evals:
            continue
        e = evals[key]
        if key == BEFORE:
            label = f"{cfg['student']} before training"
        elif key == TEACHER:
            label = f"{cfg['teacher']} (teacher)"
        else:
            label = f"after {cfg['steps']} steps: {cfg['variants'][key]['label']}"
        out.append({"key": key, "label": label, "bpb": e["bits_per_byte"],
                    "ce": e["ce_per_token"], "tokens": e["tokens"],
                    "delta": e["bits_per_byte"] - base,
                    "rel": (e["bits_per_byte"] - base) / base})
    return out


def summary_table(results: dict) -> str:
    lines = [f"{'model':58s} {'bits/byte':>9s} {'CE/token':>9s} {'tokens':>7s} {'vs before':>10s}"]
    for r in rows(results):
        lines.append(f"{r['label'][:58]:58s} {r['bpb']:9.4f} {r['ce']:9.4f} {r['tokens']:7d} "
                     f"{r['delta']:+10.4f}")
    return "\n".join(lines)


def _plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cfg = results["config"]
    runs = results["runs"]
    names = [n for n in cfg["variants_to_run"] if n in runs]
    files = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name in names:
        steps = [r for r in runs[name]["metrics"] if "ce" in r and "eval_bpb" not in r]
        label = cfg["variants"][name]["label"]
        axes[0].plot([r["iteration"] for r in steps], [r["ce"] for r in steps], marker=".",
                     label=label)
        if cfg["variants"][name]["kd_weight"] > 0:
            axes[1].plot([r["iteration"] for r in steps], [r["kd"] for r in steps], marker=".",
                         label=f"{name} ({cfg['variants'][name]['kd_loss']})")
    axes[0].set(title="student CE on the training batch (same batches for every variant)",
                xlabel="step", ylabel="nats / token")
    axes[1].set(title="KD loss of the distillation variants", xlabel="step",
                ylabel="KD loss (per chunk)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    files.append("loss_curves.png")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in names:
        evals = [r for r in runs[name]["metrics"] if "eval_bpb" in r]
        ax.plot([r["iteration"] for r in evals], [r["eval_bpb"] for r in evals], marker="o",
                label=cfg["variants"][name]["label"])
    ax.set(title="held-out bits per byte during training (--eval-interval)", xlabel="step",
           ylabel="bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "heldout_bpb_curves.png", dpi=110)
    plt.close(fig)
    files.append("heldout_bpb_curves.png")

    table = rows(results)
    colors = {BEFORE: "#888888", TEACHER: "#2a7ab0", "ce": "#6a9a3a"}
    trained = [r for r in table if r["key"] not in (BEFORE, TEACHER)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.55 * len(table) + 1.6),
                             gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    bars = ax.barh([r["label"] for r in table][::-1], [r["bpb"] for r in table][::-1],
                   color=[colors.get(r["key"], "#d9822b") for r in table][::-1])
    for bar, r in zip(bars, table[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['bpb']:.4f}",
                va="center", fontsize=8)
    ax.set_xlim(min(r["bpb"] for r in table) * 0.9, max(r["bpb"] for r in table) * 1.05)
    ax.set(title="held-out bits per byte (lower is better; axis not from 0)",
           xlabel="bits per byte")
    ax.tick_params(axis="y", labelsize=8)
    ax = axes[1]
    if trained:
        bars = ax.barh([r["key"] for r in trained][::-1], [r["delta"] for r in trained][::-1],
                       color=[colors.get(r["key"], "#d9822b") for r in trained][::-1])
        for bar, r in zip(bars, trained[::-1]):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['delta']:+.4f}",
                    va="center", ha="right" if r["delta"] < 0 else "left", fontsize=8)
        ax.axvline(0, color="black", lw=0.8)
        low = min(0.0, *(r["delta"] for r in trained))
        ax.set_xlim(low * 1.35 if low < 0 else -0.001, max(0.0, *(r["delta"] for r in trained))
                    * 1.35 + 1e-4)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
    ax.set(title="change vs the student before training", xlabel="bits per byte")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out / "bpb_bars.png", dpi=110)
    plt.close(fig)
    files.append("bpb_bars.png")
    return files


def final_train_evals(results: dict) -> dict[str, float]:
    """Last in-training held-out bits per byte (``--eval-interval``) of each variant."""
    out = {}
    for name, run in results["runs"].items():
        evals = [r for r in run["metrics"] if "eval_bpb" in r]
        if evals:
            out[name] = evals[-1]["eval_bpb"]
    return out


def verdict(results: dict) -> list[str]:
    """Sentences comparing each distillation variant with CE-only at equal steps: on the
    evaluation set (the headline) and on the training loop's own held-out samples."""
    evals, cfg = results["evals"], results["config"]
    if "ce" not in evals:
        return ["CE-only was not run, so there is no baseline to compare with."]
    ce = evals["ce"]["bits_per_byte"]
    before = evals[BEFORE]["bits_per_byte"]
    loop = final_train_evals(results)
    out = [f"CE-only fine-tuning moved held-out bits per byte from {before:.4f} to {ce:.4f} "
           f"({ce - before:+.4f}, {100 * (ce - before) / before:+.2f}%)."]
    for name in cfg["variants_to_run"]:
        if name == "ce" or name not in evals:
            continue
        bpb = evals[name]["bits_per_byte"]
        gain = ce - bpb
        word = "beat" if gain > 0 else "did not beat"
        share = (f", {100 * gain / (before - ce):.0f}% more improvement than CE-only's"
                 if before - ce > 0 and gain > 0 else "")
        text = (f"{cfg['variants'][name]['label']} {word} CE-only on the evaluation set: "
                f"{bpb:.4f} vs {ce:.4f} bits/byte ({-gain:+.4f}{share})")
        if name in loop and "ce" in loop:
            agree = (loop[name] < loop["ce"]) == (gain > 0)
            text += (f"; on the training loop's held-out samples {loop[name]:.4f} vs "
                     f"{loop['ce']:.4f} ({'same' if agree else 'opposite'} direction)")
        out.append(text + ".")
    return out


def conclusion(results: dict) -> str:
    """One paragraph: does distillation beat CE-only at equal steps in this run?"""
    evals, cfg = results["evals"], results["config"]
    if "ce" not in evals:
        return "No CE-only baseline was run."
    ce, before = evals["ce"]["bits_per_byte"], evals[BEFORE]["bits_per_byte"]
    loop = final_train_evals(results)
    kd = [n for n in cfg["variants_to_run"] if n != "ce" and n in evals]
    both = [n for n in kd if evals[n]["bits_per_byte"] < ce
            and (n not in loop or "ce" not in loop or loop[n] < loop["ce"])]
    one = [n for n in kd if n not in both and (evals[n]["bits_per_byte"] < ce or (
        n in loop and "ce" in loop and loop[n] < loop["ce"]))]
    spread = max(abs(evals[n]["bits_per_byte"] - ce) for n in kd) if kd else 0.0
    text = f"**In this run, after {cfg['steps']} steps, "
    if both:
        text += (f"{', '.join(both)} beat CE-only on both held-out measures.** ")
    elif one:
        text += ("no distillation variant beats CE-only consistently: "
                 f"{', '.join(one)} is ahead on one held-out measure and behind on the other, "
                 "the others are not ahead on either.** ")
    else:
        text += "CE-only fine-tuning is at least as good as every distillation variant.** "
    if kd:
        text += (f"The differences between the variants (at most {spread:.4f} bits/byte, "
                 f"{100 * spread / ce:.2f}%) are an order of magnitude smaller than what "
                 f"fine-tuning itself gained ({before - ce:.4f}) and far smaller than the "
                 f"teacher-student gap"
                 + (f" ({before - evals[TEACHER]['bits_per_byte']:.4f})"
                    if TEACHER in evals else "")
                 + "; with one seed and this few steps they are not a reliable ranking. The "
                 "teacher's extra knowledge is not transferred measurably in this budget. A "
                 "plausible reading (not tested here): the first steps of fine-tuning mostly "
                 "adapt the student to the text itself (raw source files rather than the chat "
                 "format it was tuned on), which the hard labels teach as well as the teacher's "
                 "distributions do. Whether distillation pulls "
                 "ahead takes more steps (`steps=...`) and several seeds (`seed=...`).")
    return text


def write_report(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = results["config"]
    files = _plots(results, out)
    t, kd = cfg["train"], cfg["kd"]
    first = next(iter(results["evals"].values()))
    dp = cfg["nproc"] // (cfg["layout"]["student"]["tp"] * cfg["layout"]["student"]["pp"]
                          * cfg["layout"]["student"]["cp"])
    tokens_seen = cfg["steps"] * t["global_batch_size"] * t["seq_length"]
    m = results["machine"]
    lines = [
        "# Does cross-tokenizer distillation teach? CE-only vs P-KL / gold / H-KL at equal steps",
        "",
        f"Teacher **{cfg['teacher']}** (Qwen2 tokenizer, 152k vocabulary) teaches student "
        f"**{cfg['student']}** (49k vocabulary) on Python source: the CPython standard library, "
        "split by module into train and held-out (no held-out module is trained on). Every "
        "variant starts from the same student checkpoint and trains on the *same batches in the "
        "same order* with the same steps, learning rate, schedule and seed; only the loss "
        "weights differ. Held-out quality is bits per byte (`python -m megatron_xdistill."
        "evaluate`): total negative log-likelihood over the UTF-8 bytes of the text, a scale on "
        "which the teacher and the student compare although their tokenizers differ.",
        "",
        f"**Scale of this run: CPU only ({m['cpu_count']} cores, no GPU), {cfg['steps']} steps "
        f"per variant, {tokens_seen:,} student tokens seen per variant, one seed.** It shows "
        "the direction of the effect at a very small budget, not converged numbers.",
        "",
        "Reproduce: `python examples/cross_tokenizer_distillation/run.py` (settings in "
        f"`config.yaml`; overrides like `steps=100`; this run took "
        f"{results['timings']['total'] / 60:.0f} minutes), or `python benchmarks/"
        "bench_distill_quality.py` for a small rerun that prints the table.",
        "",
        "## Result",
        "",
        "| model | held-out bits/byte | CE (nats/token, own tokenizer) | vs student before |",
        "|---|---:|---:|---:|",
    ]
    for r in rows(results):
        rel = f"{r['delta']:+.4f} ({100 * r['rel']:+.2f}%)" if r["key"] != BEFORE else "-"
        lines.append(f"| {r['label']} | {r['bpb']:.4f} | {r['ce']:.4f} | {rel} |")
    lines += ["", *[f"- {s}" for s in verdict(results)], "", conclusion(results), "",
              f"Held-out text: the first {cfg['eval']['max_docs'] or 'all'} held-out modules, "
              f"each cut to {cfg['eval']['max_chars'] or 'all its'} characters: "
              f"{first['bytes']:,} bytes ({first['documents']} documents), windows of "
              f"{cfg['eval']['seq_length']} tokens. Student token count: "
              f"{results['evals'][BEFORE]['tokens']:,}"
              + (f"; teacher: {results['evals'][TEACHER]['tokens']:,}."
                 if TEACHER in results["evals"] else "."),
              "", f"![held-out bits per byte]({files[2]})", "",
              "## Curves", "",
              f"![training losses]({files[0]})", "",
              "Left: the student's next-token CE on each training batch, measured before that "
              "step's update. Every variant sees the same batch at the same step, so the curves "
              "are paired: vertical gaps are differences between the variants, the wiggles are "
              "batch difficulty. Right: the KD term of the distillation variants (P-KL, gold and "
              "H-KL are different quantities; compare each with itself).", "",
              f"![held-out bpb during training]({files[1]})", "",
              f"Held-out bits per byte measured by the training loop itself every "
              f"{t['eval_interval']} steps (`--eval-interval`, {t['eval_iters']} global "
              "batches of packed held-out samples: fewer bytes than the table "
              "above, which is the number to quote).", "",
              "## Settings", "",
              "| | |", "|---|---|",
              f"| teacher / student | {cfg['teacher']} / {cfg['student']} (GGUF from PyPI, "
              "dequantised; see `megatron_xdistill/assets.py`) |",
              f"| ranks, layouts | {cfg['nproc']} CPU ranks (gloo); student TP{cfg['layout']['student']['tp']}"
              f" PP{cfg['layout']['student']['pp']} CP{cfg['layout']['student']['cp']} DP{dp}, "
              f"teacher TP{cfg['layout']['teacher']['tp']} PP{cfg['layout']['teacher']['pp']} "
              f"CP{cfg['layout']['teacher']['cp']} |",
              f"| steps | {cfg['steps']} |",
              f"| batch | global {t['global_batch_size']} x {t['seq_length']} student tokens "
              f"(teacher {t['teacher_seq_length']}), micro-batch {t['micro_batch_size']} |",
              f"| optimizer | Adam, lr {t['lr']:g} ({t['lr_warmup_iters']} warm-up steps, "
              f"{t['lr_decay_style']} to {t['min_lr']:g}), weight decay {t['weight_decay']}, "
              f"clip {t['clip_grad']}, {'bf16' if t['bf16'] else 'fp32'} |",
              f"| distillation | teacher top-{kd['topk']} per chunk + tail bucket "
              f"({kd['topk_mode']}), temperature {kd['temperature']} |",
              f"| seed | {cfg['seed']} |",
              *([f"| note | {cfg['report_note']} |"] if cfg.get("report_note") else []),
              "", "| variant | loss |", "|---|---|"]
    for name in cfg["variants_to_run"]:
        v = cfg["variants"][name]
        loss = (f"{v['ce_weight']:g} x CE" if not v["kd_weight"] else
                f"{v['kd_weight']:g} x {v['kd_loss']} + {v['ce_weight']:g} x CE")
        secs = results["runs"].get(name, {}).get("seconds")
        took = f" (training run: {secs / 60:.1f} min)" if secs else ""
        lines.append(f"| {name} | {loss}{took} |")
    export = results.get("export")
    if export:
        lines += ["", "## Back to Hugging Face", "",
                  f"The `{export['variant']}` student was exported with `xdistill-convert "
                  f"mcore-to-hf` and loads with `transformers` "
                  f"({export['parameters'] / 1e6:.1f}M parameters)."]
        if "bits_per_byte" in export:
            lines.append(f"Scored with `python -m megatron_xdistill.evaluation --hf-dir` on the "
                         f"same held-out text it gives {export['bits_per_byte']:.6f} bits/byte; "
                         f"the Megatron checkpoint it came from gives "
                         f"{export['megatron_bits_per_byte']:.6f} ({export['dtype']} export).")
        lines += ["Greedy completion by the exported model (24 new tokens):", "", "```python",
                  export["sample"].rstrip(), "```"]
    lines += ["", "## Caveats", "",
              "- CPU, a few dozen steps, tiny batches, one seed: differences of a few "
              "thousandths of a bit per byte are within what another seed or another held-out "
              "subset could change. The table ranks the variants on one paired run.",
              "- Both models are dequantised 4-bit GGUF releases (instruct versions), not the "
              "original bf16 weights.",
              "- gold and H-KL differ only in which token pairs count as the common "
              "vocabulary; when their numbers coincide, the two choices select nearly the "
              "same pairs for this tokenizer pair.",
              "- Wall times are of one run on a CPU machine that other jobs shared; they are "
              "not speed measurements.",
              "- The CE-only baseline runs through the same distillation entry point with "
              "`--kd-weight 0`, which neither loads nor runs the teacher.",
              "", f"Machine: {m['platform']}, Python {m['python']}, torch {m['torch']}, "
              f"{m['date']}. Wall time: " + ", ".join(
                  f"{k} {v / 60:.1f} min" for k, v in results["timings"].items()) + ".", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path
