"""The final ``{"check": "gpu_check", ...}`` line from the sections' files, and its printout.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from benchmarks.harness import STAMP

from .common import read_json
from .launches import last_error

PYTEST_OUTCOMES = ("passed", "failed", "errors", "error", "skipped", "xfailed", "xpassed", "deselected")


def pytest_counts(log: Path) -> dict:
    """``{"passed": 3, "skipped": 1, ..., "tests": {name: outcome}, "finished": bool}`` from
    a ``pytest -v`` log: the counts of its summary line, or, where it was killed before
    printing one, of its per-test lines, and then the test it was in (``killed_in``)."""
    if not log.is_file():
        return {}
    lines = log.read_text(errors="replace").splitlines()
    tests, running = {}, None
    for line in lines:
        m = re.match(r"^(\S+::\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)?", line)
        if m:
            name = m.group(1).rsplit("::", 1)[1]
            if m.group(2):
                tests[name] = m.group(2)
                running = None
            else:
                running = name
    out: dict = {}
    for line in reversed(lines):
        if line.startswith("=") and " in " in line:
            found = re.findall(r"(\d+) (" + "|".join(PYTEST_OUTCOMES) + r")\b", line)
            if found:
                out = {("errors" if k == "error" else k): int(n) for n, k in found}
                break
    finished = bool(out)
    if not finished:
        for outcome in tests.values():
            key = {"ERROR": "errors", "XFAIL": "xfailed", "XPASS": "xpassed"}.get(outcome, outcome.lower())
            out[key] = out.get(key, 0) + 1
        if running:
            out["killed_in"] = running
    return {**out, "tests": tests, "finished": finished}


HEADLINE = ("passed", "failed", "errors", "killed_in", "match", "rel_diff", "target_save_s", "plan_s", "block_tokens",
            "micro_batches", "steps", "tokens_per_s", "tflops", "mfu", "skipped")
"""A section's keys shown in its line of the final printout, where it has them."""


def pruned(data):
    """``data`` without the None values of its dicts, at any depth: the final line is
    read from an output tail of 12,000 characters."""
    if isinstance(data, dict):
        return {k: pruned(v) for k, v in data.items() if v is not None}
    return data


def collect(work: Path, started: float | None = None) -> dict:
    """The final line from ``sections.tsv`` (name, exit code or ``skipped``, seconds) and
    each section's JSON (pruned, and without the plan ``prepare`` shows already);
    ``failed`` names every section that did not finish cleanly; ``plan_vs_measured``
    gathers the sections' rows (their nulls kept: a row has every column)."""
    result: dict = {"check": "gpu_check"}
    if started:
        result["wall_s"] = round(time.time() - started, 1)
    sections, failed, skipped, rows, prepared = {}, [], [], [], None
    tsv = work / "sections.tsv"
    for row in (tsv.read_text().splitlines() if tsv.is_file() else []):
        name, rc, secs = (row.split("\t") + ["", ""])[:3]
        sections[name] = {"rc": rc, "s": int(secs) if secs.isdigit() else None}
    result["sections"] = sections
    for name, st in sections.items():
        if st["rc"] == "skipped":
            skipped.append(name)
            continue
        data = pytest_counts(work / "cuda_tests.log") if name == "cuda_tests" else read_json(work / f"{name}.json")
        for key in ("section", *STAMP):     # the final line is stamped once
            data.pop(key, None)
        rows += [{"section": name, **r} for r in data.pop("plan_vs_measured", None) or []]
        if name == "cuda_tests" and "tests" in data:    # the tests that did not pass, by name
            data["tests"] = {k: v for k, v in data["tests"].items() if v != "PASSED"}
        if name == "prepare":
            prepared = data.get("plan")
        elif data.get("plan") and data["plan"] == prepared:
            del data["plan"]
        if data:
            result[name] = pruned(data)
        err = data.get("error") or (f"killed in {data['killed_in']}" if data.get("killed_in") else None)
        if st["rc"] != "0" or err:
            why = {"124": f"timed out after {st['s']} s", "137": f"killed after {st['s']} s"}.get(st["rc"], "")
            line = err or last_error(work / f"{name}.log") or f"exit {st['rc']}"
            failed.append({"section": name, "rc": st["rc"], "error": f"{why}: {line}" if why else line})
    result["plan_vs_measured"] = rows
    result["skipped"] = skipped
    result["failed"] = failed
    return result


def report_lines(result: dict) -> list[str]:
    """One short line per section and one per planned process, for the output's tail."""
    out = []
    for name, st in result.get("sections", {}).items():
        data = result.get(name) or {}
        shown = ", ".join(f"{k} {data[k]}" for k in HEADLINE if data.get(k) not in (None, ""))
        out.append(f"{name}: {st['rc']} in {st['s']} s" + (f"; {shown}" if shown else ""))
    for r in result.get("plan_vs_measured", []):
        out.append(f"plan {r['section']} {r['process']} {r['device']}: {r['planned_gib']} GiB planned "
                   f"({r['context_gib']} context); peak {r['measured_peak_gib']} allocated, "
                   f"{r['reserved_peak_gib']} reserved")
    return [x[:200] for x in out]
