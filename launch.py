"""Train a DFlash drafter: ``python launch.py --topology 2-2``.

``python launch.py status RUN_DIR [--watch]`` shows how a run is doing, from another
terminal (``statusview``): exit 0 healthy, 1 stuck or stopping, 3 not running.

Several machines: one ``launch.py`` on each, with ``--nnodes K --node-rank R --master
ADDR:PORT``, or under ``torchrun --nproc-per-node 1`` or ``srun --ntasks-per-node 1``
(``cluster``). Node R > 0 keeps its status and logs in ``RUN_DIR/node-R``.

Thin on purpose: parse arguments, build and check the config, hand over to the
pipeline. Bad input exits with status 2 and one line, before any actor starts and
without writing to the run directory; so does a run directory that another job holds.
``--resume RUN_DIR`` builds on the run's own ``config.yaml``: only what changes needs
saying again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dflash_actors.config import DEFAULT_CONFIG, add_config_args, config_from_args


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="and: launch.py status RUN_DIR [--watch [SECONDS]] (how a run is doing)")
    add_config_args(ap)
    ap.add_argument("--run-dir", help="where status.json, events.log and checkpoints go")
    ap.add_argument("--resume", metavar="RUN_DIR",
                    help="continue RUN_DIR from its newest checkpoint that verifies, on its saved config.yaml "
                         "(a --config given now replaces it; --topology and --set given now apply on top)")
    ap.add_argument("--plan-only", action="store_true",
                    help="validate config, data and target, print the first epoch's plan, and exit")
    ap.add_argument("--devices", type=int, metavar="K",
                    help="with --topology auto: devices to split (default: the GPUs here, or 2 without any)")
    ap.add_argument("--chaos", type=int, metavar="SEED",
                    help="inject random faults (kills, exits, exceptions, segfaults, hangs, slow work) into "
                         "every actor, seeded; the run must still end as a clean one would (runtime.faults)")
    ap.add_argument("--chaos-faults", type=int, default=10, metavar="N", help="with --chaos: how many (default 10)")
    nodes = ap.add_argument_group("several machines (or read from torchrun's or SLURM's environment)")
    nodes.add_argument("--nnodes", type=int, metavar="K", help="machines in the run, one launch.py on each")
    nodes.add_argument("--node-rank", type=int, metavar="R", help="this machine's rank, 0..K-1")
    nodes.add_argument("--master", metavar="ADDR:PORT", help="node 0's address and a free port (its rendezvous)")
    # --config left out reads as None (the help still shows the default), so that a
    # resume can tell "not given" from "given the default".
    return ap.parse_args(argv, argparse.Namespace(config=None))


def auto_topology(args: argparse.Namespace, overrides: list[str]) -> str:
    """``--topology auto``: measure the stage costs, pick N-M, say why in one line."""
    from dflash_actors.tools.advice import choose, device_count
    from dflash_actors.job.preflight import preflight
    args.topology = None
    cfg = config_from_args(args, *overrides)
    devices = args.devices if args.devices is not None else device_count()
    if devices < 2:
        raise ValueError(f"--devices: a topology needs at least 2 devices (got {devices})")
    topology, why = choose(cfg, preflight(cfg, progress=False), devices)
    print(why, file=sys.stderr)
    return topology


def keep_batches_per_step(args: argparse.Namespace, cfg, run_dir: list[str]):
    """A resume on another number of drafters keeps the run's batches per step by
    adapting ``train.grad_accum``, unless ``--set train.grad_accum`` says otherwise."""
    import yaml

    from dflash_actors.train.checkpoint import adapt_grad_accum
    from dflash_actors.job.rundir import SAVED_CONFIG
    saved = Path(args.resume) / SAVED_CONFIG
    if not saved.is_file() or any(o.partition("=")[0].strip() == "train.grad_accum" for o in args.overrides):
        return cfg
    accum = adapt_grad_accum(yaml.safe_load(saved.read_text()), cfg.topology.num_drafters * cfg.topology.nodes)
    if accum is None or accum == cfg.train.grad_accum:
        return cfg
    return config_from_args(args, *run_dir, f"train.grad_accum={accum}")


def with_chaos(args: argparse.Namespace, cfg, run_dir: list[str]):
    """``--chaos SEED``: ``--chaos-faults`` random faults over the run's batches."""
    from dflash_actors.tools.chaos import chaos_faults, faults_override
    from dflash_actors.job.preflight import preflight
    from dflash_actors.train.schedule import Schedule
    if args.chaos_faults < 1:
        raise ValueError(f"--chaos-faults: must be >= 1 (got {args.chaos_faults})")
    total = Schedule.from_config(cfg, preflight(cfg, progress=False).dataset.lengths).total_batches
    faults = chaos_faults(cfg, args.chaos, args.chaos_faults, total)
    print(f"--chaos {args.chaos}: {len(faults)} faults: "
          + ", ".join(f"{f['actor']} {f['kind']} at {f['at']} of batch {f['at_batch']}" for f in faults),
          file=sys.stderr)
    return config_from_args(args, *run_dir, faults_override(faults))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"]:
        from dflash_actors.observe.statusview import main as status_main
        return status_main(argv[1:])
    args = parse_args(argv)
    # The job reports progress itself (status.json, the summary); model-loading bars from
    # transformers would only interleave with it.
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if args.run_dir is not None and args.resume is not None and args.run_dir != args.resume:
        print("error: --run-dir and --resume name different directories", file=sys.stderr)
        return 2
    given = args.resume if args.resume is not None else args.run_dir
    # c10d logs every broken connection with a C++ backtrace; a lost node is reported
    # in one line instead (read when torch loads, which the next import does).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        from dflash_actors.cluster.link import launcher_restart, node_spec
        from dflash_actors.job.rundir import SAVED_CONFIG
        node = node_spec(args.nnodes, args.node_rank, args.master)
        if any(o.partition("=")[0].strip() == "topology.nodes" for o in args.overrides):
            raise ValueError("topology.nodes: set by --nnodes or the torchrun/SLURM environment, not --set")
        if node.rank and given:     # node k keeps its own files in a folder of the run's
            given = str(Path(given) / f"node-{node.rank}")
            args.resume = given if args.resume is not None else None
        # Relaunched by torchrun --max-restarts or a SLURM requeue with the first command
        # line: continue the run it started rather than refuse its checkpoints.
        if args.resume is None and given and launcher_restart() and (Path(given) / SAVED_CONFIG).is_file():
            print(f"relaunch {launcher_restart()} of this job: resuming {given}", file=sys.stderr)
            args.resume, args.run_dir = given, None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # An empty --run-dir/--resume goes to the config check, which refuses it by name.
    run_dir = [f"runtime.run_dir='{given.replace(chr(39), chr(39) * 2)}'"] if given is not None else []
    run_dir.append(f"topology.nodes={node.nodes}")
    try:
        if args.resume == "":
            raise ValueError("--resume: needs the run directory to continue (got an empty path)")
        if args.resume is not None:
            from dflash_actors.job.rundir import resume_config
            args.config = resume_config(args.resume, args.config)
        args.config = args.config or str(DEFAULT_CONFIG)
        if args.topology == "auto":
            args.topology = auto_topology(args, run_dir)
        elif args.devices is not None:
            raise ValueError("--devices: only with --topology auto")
        cfg = config_from_args(args, *run_dir)
        if node.rank and given is None:
            run_dir[:0] = [f"runtime.run_dir={Path(cfg.runtime.run_dir) / f'node-{node.rank}'}"]
            cfg = config_from_args(args, *run_dir)
        if args.resume is not None:
            cfg = keep_batches_per_step(args, cfg, run_dir)
        if args.chaos is not None:
            cfg = with_chaos(args, cfg, run_dir)
        if args.plan_only:
            from dflash_actors.models.head import target_info
            from dflash_actors.job.preflight import preflight
            pre = preflight(cfg)
            # The target too: its layers and vocabulary against the data, as a run would.
            pre.dataset.check_values(target_info(cfg, "cpu").vocab_size)
            print(json.dumps({"dataset": str(pre.train_path), "samples": len(pre.dataset),
                              "tokens": pre.dataset.num_tokens, "truncated": pre.dataset.n_truncated,
                              "dropped": pre.dataset.n_dropped, "targets": pre.devices.targets,
                              "drafters": pre.devices.drafters,
                              "epoch0": pre.plan0.stats(pre.dataset.lengths, cfg.batching.token_budget)}))
            return 0
        from dflash_actors import console
        from dflash_actors.job.job import Job
        console.setup(cfg.monitor.console, cfg.monitor.log_every_s)
        job = Job(cfg, resume=args.resume is not None, node=node)
    except (ValueError, OSError) as e:   # ConfigError, DatasetError, ResumeError are ValueErrors
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return job.run().exit_code


if __name__ == "__main__":
    sys.exit(main())
