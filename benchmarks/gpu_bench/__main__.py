"""What ``benchmarks/gpu_check.sh`` measures on a lent GPU, one subcommand per section
(``benchmarks.gpu_bench``'s docstring).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .collect import collect, report_lines
from .common import emit, setup
from .drafter import bench_drafter
from .env import bench_env
from .nodes import bench_nodes
from .pipeline import bench_pipeline, prepare
from .serving import bench_serving
from .target import bench_target
from .tiny import bench_tiny


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("env", "prepare", "tiny", "nodes", "target", "drafter", "pipeline", "serving",
                                     "collect"))
    ap.add_argument("dir", nargs="?", help="collect: the folder of the section files ($WORK)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: exercise the code, measure nothing")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--limit", type=float, default=float(os.environ.get("SECTION_S", 300)) - 10,
                    help="seconds for the launches (default: $SECTION_S - 10)")
    ap.add_argument("--work", default=os.environ.get("WORK", "/tmp/gpu_check_work"),
                    help="where launch logs and plans go")
    ap.add_argument("--started", type=float, help="collect: the check's start (unix time)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.what == "collect":
        result = collect(Path(args.dir or work), args.started)
        for line in report_lines(result):      # for a person; stdout holds the record only
            print(line, file=sys.stderr, flush=True)
        emit(result, args.out)
        return 0
    if args.what == "env":
        bench_env(args.out)
        return 0
    if args.what == "prepare":
        return 1 if "error" in prepare(work, args.smoke, args.out) else 0
    if args.what in ("target", "drafter"):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if args.what == "target":
            device, sizes = setup(args.smoke)
            r = bench_target(sizes, device, args.out)
        else:
            plan = prepare(work, args.smoke)   # before this process touches the GPU
            device, sizes = setup(args.smoke)
            r = bench_drafter(sizes, device, plan, args.out)
    elif args.what == "pipeline":
        r = bench_pipeline(Path("/tmp/gpu-pipe"), work, args.limit, args.smoke, args.out)
    elif args.what == "tiny":
        r = bench_tiny(work, args.limit, args.smoke, args.out)
    elif args.what == "serving":
        r = bench_serving(work, args.limit, args.out)
    else:
        r = bench_nodes(work, args.limit, args.smoke, args.out)
    return 1 if r.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
