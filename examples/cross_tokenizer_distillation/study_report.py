"""The study's report: mean +- std over seeds per held-out set, paired differences to CE-only
(called real only beyond twice the seed spread, the rule fixed before the runs) and the paired
training curves, written as ``REPORT-<experiment>.md`` from the study's ``results.json``.

Kept apart from ``study.py`` (which runs things) so that a report can be rebuilt from a results
file alone: ``python study_report.py results/real.json OUT_DIR``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path


def _variants(results: dict) -> list[str]:
    """Variants with runs in ``results``, in the config's order."""
    done = {run["variant"] for run in results["runs"].values()}
    return [v for v in results["config"]["variants"] if v in done]


def _seeds(results: dict) -> list[int]:
    return sorted({run["seed"] for run in results["runs"].values()})


def summarize(results: dict) -> dict:
    """Per held-out set and variant: bpb per seed, mean, std; paired difference to CE."""
    heldouts = sorted({k.split("/")[1] for k in results["evals"]})
    out: dict = {}
    for name in heldouts:
        table = {}
        for variant in _variants(results):
            values = {s: results["evals"][f"{variant}-s{s}/{name}"]["bits_per_byte"]
                      for s in _seeds(results) if f"{variant}-s{s}/{name}" in results["evals"]}
            if values:
                table[variant] = values
        before = [results["evals"][f"before-s{s}/{name}"]["bits_per_byte"]
                  for s in _seeds(results) if f"before-s{s}/{name}" in results["evals"]]
        others = {key.split("/")[0].removeprefix("teacher-"): value["bits_per_byte"]
                  for key, value in results["evals"].items()
                  if key.startswith("teacher-") and key.endswith(f"/{name}")}
        out[name] = {"variants": table, "before": before, "other_teachers": others,
                     "teacher": results["evals"][f"teacher/{name}"]["bits_per_byte"]}
    return out


def _num(value: float, spec: str) -> str:
    """A number, or "-" where one seed leaves it undefined (a spread, a t statistic)."""
    return "-" if math.isnan(value) else format(value, spec)


def _pm(mean: float, std: float, sign: bool = False) -> str:
    """``mean +- std``; the mean alone with one seed."""
    text = format(mean, "+.4f" if sign else ".4f")
    return text if math.isnan(std) else f"{text} +- {std:.4f}"


def _mean_std(values) -> tuple[float, float]:
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def paired_difference(ours: Sequence[float], base: Sequence[float]) -> dict:
    """``ours`` - ``base`` paired by seed (the same seed at the same index) with the study's rule,
    fixed before the runs: a difference is real when |mean| exceeds twice the larger of the two
    seed spreads (the standard deviations over seeds), which needs at least two seeds. Keys
    ``seeds``, ``diff`` (mean), ``diff_std``, ``spread`` and ``real``; the spreads are NaN with
    one seed."""
    if len(ours) != len(base) or not ours:
        raise ValueError(f"paired_difference: {len(ours)} and {len(base)} values; "
                         "expected the same number (one per seed), at least one")
    mean, std = _mean_std(a - b for a, b in zip(ours, base))
    spread = max(_mean_std(ours)[1], _mean_std(base)[1])
    return {"seeds": len(ours), "diff": mean, "diff_std": std, "spread": spread,
            "real": len(ours) > 1 and abs(mean) > 2 * spread}


def baseline_of(variants: dict, variant: str) -> str | None:
    """The CE-only variant (KD weight 0) that ``variant`` is compared with: the one trained on
    the same plan (``samples_per_epoch``: one pass over new text, or the same small set for as
    many epochs). None: the study has none."""
    plan = variants[variant].get("samples_per_epoch")
    return next((name for name, v in variants.items()
                 if v.get("kd_weight", 1.0) == 0 and v.get("samples_per_epoch") == plan), None)


def verdicts(results: dict, against: str | None = None) -> list[dict]:
    """Each distillation variant against its CE-only baseline (:func:`baseline_of`), or against
    the variant ``against`` (a compact payload against the full one, say), on each held-out set
    (paired by seed): a difference is real when |mean| exceeds twice the larger of the two seed
    spreads."""
    variants = results["config"]["variants"]
    if against is not None and against not in variants:
        raise ValueError(f"against={against!r}: not a variant of this study "
                         f"(one of {sorted(variants)})")
    rows = []
    for name, summary in summarize(results).items():
        table = summary["variants"]
        for variant, values in table.items():
            baseline = baseline_of(variants, variant) if against is None else against
            if (variants[variant].get("kd_weight", 1.0) == 0 or baseline not in table
                    or variant == baseline):
                continue
            ce = table[baseline]
            seeds = sorted(set(values) & set(ce))
            if not seeds:
                continue
            d = paired_difference([values[s] for s in seeds], [ce[s] for s in seeds])
            mean, std = d["diff"], d["diff_std"]
            gap = statistics.fmean(ce[s] for s in seeds) - summary["teacher"]
            paired_t = (mean / (std / math.sqrt(len(seeds)))
                        if len(seeds) > 1 and std > 1e-12 else math.nan)  # not float noise
            rows.append({"heldout": name, "variant": variant, "baseline": baseline, **d,
                         "seeds_better": sum(values[s] < ce[s] for s in seeds),
                         "paired_t": paired_t,
                         "gap_closed": -mean / gap if gap > 0 else math.nan})
    return rows


def _verdict(row: dict) -> str:
    if not row["real"]:
        return "within seed noise"
    return "better than CE-only" if row["diff"] < 0 else "worse than CE-only"


def _plot(results: dict, out: Path) -> str | None:
    """Paired training curves: in-training held-out bits/byte per variant (mean over seeds,
    band = min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for variant in _variants(results):
        curves = {}
        train = {}
        for run in results["runs"].values():
            if run["variant"] != variant:
                continue
            for r in run["metrics"]:
                if "eval_bpb" in r:
                    curves.setdefault(r["iteration"], []).append(r["eval_bpb"])
                if "ce" in r and "eval_bpb" not in r:
                    train.setdefault(r["iteration"], []).append(r["ce"])
        label = cfg["variants"][variant]["label"]
        for ax, data in ((axes[0], curves), (axes[1], train)):
            if not data:
                continue
            steps = sorted(data)
            mean = [statistics.fmean(data[s]) for s in steps]
            ax.plot(steps, mean, label=label)
            ax.fill_between(steps, [min(data[s]) for s in steps], [max(data[s]) for s in steps],
                            alpha=0.2)
    axes[0].set(title="held-out bits/byte during training", xlabel="step", ylabel="bits/byte")
    axes[1].set(title="training CE (nats/token)", xlabel="step", ylabel="CE")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out / f"study-{cfg['experiment']}-curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write_report(results: dict, out: Path) -> Path:
    cfg = results["config"]
    exp = cfg[cfg["experiment"]]
    lines = [f"# Study ({cfg['experiment']}): does cross-tokenizer distillation beat CE-only?", ""]
    if cfg["experiment"] == "signal":
        s = exp["student"]
        lines += [f"Student: Llama shape from random init (hidden {s['hidden_size']}, "
                  f"{s['num_layers']} layers, tokenizer {exp['student_tokenizer']}); teacher: "
                  f"{exp['teacher']} (pretrained). Seeds: student initialisation."]
    else:
        lines += [f"Student {exp['student']} (pretrained), teacher {exp['teacher']}. Seeds: "
                  f"data order."]
    tokens = exp["steps"] * exp["global_batch_size"] * exp["seq_length"]
    lines += [f"{exp['steps']} steps x {exp['global_batch_size']} x {exp['seq_length']} = "
              f"{tokens:,} student tokens per run; seeds {_seeds(results)}; payload chunk "
              f"top-{cfg['kd']['topk']} + tail, T = {cfg['kd']['temperature']}. Machine: "
              f"{results['machine']['cpu_count']} CPUs, torch {results['machine']['torch']}, "
              f"{results['machine']['date']}.", ""]
    for name, summary in summarize(results).items():
        lines += [f"## Held-out: {name} (bits per byte, mean +- std over seeds)", "",
                  "| model | seeds | bits/byte |", "|---|---|---|"]
        if summary["before"]:
            m, sd = _mean_std(summary["before"])
            lines.append(f"| student before training | {len(summary['before'])} | "
                         f"{_pm(m, sd)} |")
        for variant, values in summary["variants"].items():
            m, sd = _mean_std(values.values())
            lines.append(f"| {cfg['variants'][variant]['label']} | {len(values)} | "
                         f"{_pm(m, sd)} |")
        lines.append(f"| teacher ({exp['teacher']}) | - | {summary['teacher']:.4f} |")
        lines += [f"| teacher ({other}) | - | {value:.4f} |"
                  for other, value in summary["other_teachers"].items()]
        lines.append("")
    lines += ["## Against CE-only (paired by seed)", "",
              "Each variant against the CE-only run of the same data (the same plan: one pass, "
              "or the same small set for as many epochs). A difference is called real when "
              "|mean| > 2 x the larger seed std of the two (the rule fixed before the runs). "
              "Beside it, the paired view: on how many seeds the variant beat CE-only, and the "
              "paired t statistic (mean / (std / sqrt(n)) of the per-seed differences).", "",
              "| held-out | variant | against | seeds | bpb - CE (mean +- std) | 2 x spread | "
              "verdict | seeds better | paired t | gap to teacher closed |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for v in verdicts(results):
        lines.append(f"| {v['heldout']} | {cfg['variants'][v['variant']]['label']} | "
                     f"{cfg['variants'][v['baseline']]['label']} | {v['seeds']} | "
                     f"{_pm(v['diff'], v['diff_std'], sign=True)} | "
                     f"{_num(2 * v['spread'], '.4f')} | {_verdict(v)} | "
                     f"{v['seeds_better']}/{v['seeds']} | {_num(v['paired_t'], '.1f')} | "
                     f"{100 * v['gap_closed']:.1f}% |")
    plot = _plot(results, out)
    if plot:
        lines += ["", f"![curves]({plot})"]
    path = out / f"REPORT-{cfg['experiment']}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"[example] wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: study_report.py RESULTS_JSON OUT_DIR")
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_report(json.loads(Path(sys.argv[1]).read_text()), out_dir)
