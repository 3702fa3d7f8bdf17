"""Train a DFlash drafter: ``python launch.py --topology 2-2``.

Thin on purpose: parse arguments, build and check the config, hand over to the
pipeline. Bad input exits with status 2 and one line, before any actor starts and
without writing to the run directory; so does a run directory that another job holds.
``--resume RUN_DIR`` builds on the run's own ``config.yaml``: only what changes needs
saying again.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash_actors.config import DEFAULT_CONFIG, add_config_args, config_from_args


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(ap)
    ap.add_argument("--run-dir", help="where status.json, events.log and checkpoints go")
    ap.add_argument("--resume", metavar="RUN_DIR",
                    help="continue RUN_DIR from its newest checkpoint that verifies, on its saved config.yaml "
                         "(a --config given now replaces it; --topology and --set given now apply on top)")
    ap.add_argument("--plan-only", action="store_true",
                    help="validate config and data, print the first epoch's plan, and exit")
    ap.add_argument("--devices", type=int, metavar="K",
                    help="with --topology auto: devices to split (default: the GPUs here, or 2 without any)")
    # --config left out reads as None (the help still shows the default), so that a
    # resume can tell "not given" from "given the default".
    return ap.parse_args(argv, argparse.Namespace(config=None))


def auto_topology(args: argparse.Namespace, overrides: list[str]) -> str:
    """``--topology auto``: measure the stage costs, pick N-M, say why in one line."""
    from dflash_actors.advice import choose, device_count
    from dflash_actors.preflight import preflight
    args.topology = None
    cfg = config_from_args(args, *overrides)
    devices = args.devices if args.devices is not None else device_count()
    if devices < 2:
        raise ValueError(f"--devices: a topology needs at least 2 devices (got {devices})")
    topology, why = choose(cfg, preflight(cfg, progress=False), devices)
    print(why, file=sys.stderr)
    return topology


def main(argv=None) -> int:
    args = parse_args(argv)
    # The job reports progress itself (status.json, the summary); model-loading bars from
    # transformers would only interleave with it.
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if args.run_dir and args.resume and args.run_dir != args.resume:
        print("error: --run-dir and --resume name different directories", file=sys.stderr)
        return 2
    run_dir = [f"runtime.run_dir={args.resume or args.run_dir}"] if args.run_dir or args.resume else []
    try:
        if args.resume:
            from dflash_actors.rundir import resume_config
            args.config = resume_config(args.resume, args.config)
        args.config = args.config or str(DEFAULT_CONFIG)
        if args.topology == "auto":
            args.topology = auto_topology(args, run_dir)
        elif args.devices is not None:
            raise ValueError("--devices: only with --topology auto")
        cfg = config_from_args(args, *run_dir)
        if args.plan_only:
            from dflash_actors.preflight import preflight
            pre = preflight(cfg)
            print(json.dumps({"dataset": str(pre.train_path), "samples": len(pre.dataset),
                              "tokens": pre.dataset.num_tokens, "truncated": pre.dataset.n_truncated,
                              "dropped": pre.dataset.n_dropped, "targets": pre.devices.targets,
                              "drafters": pre.devices.drafters,
                              "epoch0": pre.plan0.stats(pre.dataset.lengths, cfg.batching.token_budget)}))
            return 0
        from dflash_actors.pipeline import Job
        job = Job(cfg, resume=args.resume is not None)
    except (ValueError, OSError) as e:   # ConfigError, DatasetError, ResumeError are ValueErrors
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return job.run().exit_code


if __name__ == "__main__":
    sys.exit(main())
