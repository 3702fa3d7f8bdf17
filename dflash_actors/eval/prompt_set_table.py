"""``launch.py evaluate --prompts humaneval,mtbench``: one row per prompt set, as DFlash model cards tabulate.

Each row is the trained drafter's figures from that set's ``evaluate`` report: real tau (mean
over prompts of the tokens per verify step, z-lab's count) with its 95% bootstrap interval, the
pooled tau, tokens per target call, how many prompts decoded losslessly, and, when the n-gram
baseline ran, the ratio to it with its paired interval.
"""
from __future__ import annotations


def _interval(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"


def format_set_table(reports: dict[str, dict]) -> str:
    """``reports``: set label -> the report ``evaluate_real`` returned for that set."""
    any_report = next(iter(reports.values()))
    lines = [f"drafter {any_report['drafter']}: {any_report['max_new_tokens']} new tokens, block size "
             f"{any_report['block_size']}, greedy; real tau per prompt then averaged (z-lab's count)",
             f"{'set':12} {'prompts':>7} {'real tau':>8} {'95% interval':>16} {'pooled':>7} {'tok/call':>8} "
             f"{'lossless':>9}  vs n-gram"]
    for name, report in reports.items():
        real = report["results"]["trained"]["real"]
        ngram = report["results"]["trained"].get("ratio_to", {}).get("ngram")
        vs = f"x{ngram['ratio']:.3f} {_interval(ngram['ci95'])}" if ngram else "-"
        lossless = f"{real['lossless_prompts']}/{real['prompts']}"
        lines.append(f"{name:12} {report['num_prompts']:7d} {real['tau']:8.3f} {_interval(real.get('tau_ci95')):>16} "
                     f"{real['tau_pooled']:7.3f} {real['tokens_per_target_call']:8.2f} {lossless:>9}  {vs}")
    return "\n".join(lines)
