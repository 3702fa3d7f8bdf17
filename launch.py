"""Train a DFlash drafter: ``python launch.py --topology 2-2``. The one door.

Without a command it trains; ``COMMANDS`` are the other things a user does
(``python launch.py COMMAND --help`` for each).

Training is one straight path, each thing resolved once and handed on: the node (from
the flags, torchrun or SLURM) and the run directory; one validated config (the YAML
file, then ``--topology`` and ``--set`` as data); one preflight (``job.preflight``: the
data opened and planned, devices, target, schedule); then ``--topology auto``, a
resume on another drafter count and ``--chaos`` derive their settings from those as
data, and the job or ``--plan-only`` takes ``(config, preflight)``. Bad input exits
with status 2 and one line, before any actor starts and without writing to the run
directory; so does a run directory that another job holds. ``--resume RUN_DIR`` builds
on the run's own ``config.yaml``: only what changes needs saying again.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

from dflash_actors.config import DEFAULT_CONFIG, Config, add_config_args, load_config, parse_override
from dflash_actors.console import first_line

COMMANDS = {
    "status": ("dflash_actors.observe.statusview", "how a run is doing, from another terminal (exit 0 healthy)"),
    "prepare": ("dflash_actors.prepare.regenerate", "prompts in, dataset out: the target regenerates every response"),
    "evaluate": ("dflash_actors.eval.parity", "simulated against real acceptance of a drafter, with baselines"),
    "serve-check": ("dflash_actors.eval.serve", "the run's drafter served by a real vLLM, against evaluate"),
    "plot": ("dflash_actors.observe.plot", "one picture of a run (needs matplotlib)"),
    "taps": ("dflash_actors.tools.taps", "rank which target layers feed the drafter, by short runs on your data"),
    "chaos": ("dflash_actors.tools.chaos", "a run under random kill -9s from outside, judged at the end"),
    "reference": ("dflash_actors.job.reference",
                  "the single-process trainer the pipeline matches bit for bit (--job RUN_DIR: against a run)"),
}
"""command -> (module whose ``main(argv)`` runs it, what it is for)."""


def parse_args(argv=None) -> argparse.Namespace:
    epilog = "commands (launch.py COMMAND --help):\n" + "\n".join(f"  {c:<11} {h}" for c, (_, h) in COMMANDS.items())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter,
                                 epilog=epilog)
    add_config_args(ap)
    ap.add_argument("--run-dir", help="where status.json, events.log and checkpoints go")
    ap.add_argument("--resume", metavar="RUN_DIR",
                    help="continue RUN_DIR from its newest checkpoint that verifies, on its saved config.yaml\n"
                         "(a --config given now replaces it; --topology and --set given now apply on top)")
    ap.add_argument("--plan-only", action="store_true",
                    help="validate config, data and target, print the first epoch's plan and every device's\n"
                         "memory plan, and exit (2 when a device does not fit)")
    ap.add_argument("--json", action="store_true", help="with --plan-only: one JSON line instead of the table")
    ap.add_argument("--gpu-memory", type=float, metavar="GIB",
                    help="with --plan-only: plan for GPUs of GIB GiB each (the topology's cuda:N), on a machine\n"
                         "that need not have them; nothing is started")
    ap.add_argument("--devices", type=int, metavar="K",
                    help="with --topology auto: devices to split (default: the GPUs here, or 2 without any)")
    ap.add_argument("--chaos", type=int, metavar="SEED",
                    help="inject random faults (kills, exits, exceptions, segfaults, hangs, slow work) into\n"
                         "every actor, seeded; the run must still end as a clean one would (runtime.faults)")
    ap.add_argument("--chaos-faults", type=int, default=10, metavar="N", help="with --chaos: how many (default 10)")
    nodes = ap.add_argument_group("several machines (or read from torchrun's or SLURM's environment)")
    nodes.add_argument("--nnodes", type=int, metavar="K", help="machines in the run, one launch.py on each")
    nodes.add_argument("--node-rank", type=int, metavar="R", help="this machine's rank, 0..K-1")
    nodes.add_argument("--master", metavar="ADDR:PORT", help="node 0's address and a free port (its rendezvous)")
    # --config left out reads as None (the help still shows the default), so that a
    # resume can tell "not given" from "given the default".
    return ap.parse_args(argv, argparse.Namespace(config=None))


def run_dir_of(args: argparse.Namespace, node) -> tuple[Optional[str], bool]:
    """(the run directory the command line names, whether to resume it). Node R > 0
    keeps its files in ``RUN_DIR/node-R``. A relaunch by torchrun ``--max-restarts``
    or a SLURM requeue, with the first command line, resumes the run it started."""
    from dflash_actors.cluster.node import launcher_restart
    from dflash_actors.job.rundir import SAVED_CONFIG
    if args.run_dir is not None and args.resume is not None and args.run_dir != args.resume:
        raise ValueError("--run-dir and --resume name different directories")
    if args.resume == "":
        raise ValueError("--resume: needs the run directory to continue (got an empty path)")
    given, resume = (args.resume, True) if args.resume is not None else (args.run_dir, False)
    if node.rank and given:
        given = str(Path(given) / f"node-{node.rank}")
    if not resume and given and launcher_restart() and (Path(given) / SAVED_CONFIG).is_file():
        print(f"relaunch {launcher_restart()} of this job: resuming {given}", file=sys.stderr)
        resume = True
    return given, resume


def settle(args: argparse.Namespace, early=None):
    """``(node, resume, config, preflight)``, each made once (module docstring).
    ``early`` (``job.forkserver.EarlyForkServer``) starts once the config is read, before
    torch is imported and the data checked, so that its imports overlap theirs."""
    from dflash_actors import console
    from dflash_actors.cluster.node import node_spec
    node = node_spec(args.nnodes, args.node_rank, args.master)
    run_dir, resume = run_dir_of(args, node)
    sets = [parse_override(text) for text in args.overrides]
    cfg = config_of(args, sets, node, run_dir, resume)
    if early is not None:
        early.start(cfg)
    # The job reports progress itself (status.json, the summary); model-loading bars from
    # transformers would only interleave with it.
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    from dflash_actors.job.preflight import check_data, preflight, resolved
    devices = auto_devices(args.devices) if args.topology == "auto" else None     # before the data: it fails fast
    console.setup(cfg.monitor.console, cfg.monitor.log_every_s)
    data = check_data(cfg, elsewhere=args.gpu_memory is not None, plan_only=args.plan_only)
    if data.dataset is None and devices is not None:
        raise ValueError(f"--topology auto: measures the stages on the data, and {cfg.data.path} does not exist")
    derived = {}
    if devices is not None:
        derived |= auto_topology(cfg, data, devices)
    if resume and not any(key == "train.grad_accum" for key, _ in sets):
        derived |= keep_batches_per_step(cfg, run_dir, derived.get("topology.num_drafters"))
    if derived:
        cfg = cfg.updated(derived)
    pre = preflight(cfg, node.rank, data=data, gpu_memory=args.gpu_memory, plan_only=args.plan_only)
    cfg = resolved(cfg, pre)
    if args.chaos is not None:
        if pre.schedule is None:
            raise ValueError(f"--chaos: plans faults over the run's batches, and {cfg.data.path} does not exist")
        cfg = cfg.updated({"runtime.faults": chaos(cfg, args, pre.schedule.total_batches)})
    return node, resume, cfg, pre


def config_of(args: argparse.Namespace, sets: list, node, run_dir: Optional[str], resume: bool) -> Config:
    """The one config the command line describes: the YAML file (the run's own
    ``config.yaml`` on a resume), ``--topology``, ``sets`` (``--set``, parsed) and the
    node, as data."""
    from dflash_actors.job.rundir import resume_config
    if any(key == "topology.nodes" for key, _ in sets):
        raise ValueError("topology.nodes: set by --nnodes or the torchrun/SLURM environment, not --set")
    if args.devices is not None and args.topology != "auto":
        raise ValueError("--devices: only with --topology auto")
    if args.gpu_memory is not None and not args.plan_only:
        raise ValueError("--gpu-memory: only with --plan-only (a run plans for the GPUs it has)")
    if args.gpu_memory is not None and not args.gpu_memory > 0:
        raise ValueError(f"--gpu-memory: must be > 0 GiB (got {args.gpu_memory})")
    if args.gpu_memory is not None and args.topology == "auto":
        raise ValueError("--gpu-memory: not with --topology auto, which measures the devices it runs on")
    if args.json and not args.plan_only:
        raise ValueError("--json: only with --plan-only")
    path = resume_config(run_dir, args.config) if resume else args.config
    where = [("runtime.run_dir", run_dir)] if run_dir is not None else []
    cfg = load_config(path or DEFAULT_CONFIG, [*sets, *where, ("topology.nodes", node.nodes)],
                      topology=None if args.topology == "auto" else args.topology)
    if node.rank and run_dir is None:       # the config's own run directory, node R's folder of it
        cfg = cfg.updated({"runtime.run_dir": str(Path(cfg.runtime.run_dir) / f"node-{node.rank}")})
    return cfg


def auto_devices(given: Optional[int]) -> int:
    """The devices ``--topology auto`` splits: ``--devices``, else the GPUs here."""
    from dflash_actors.tools.advice import device_count
    devices = given if given is not None else device_count()
    if devices < 2:
        raise ValueError(f"--devices: a topology needs at least 2 devices (got {devices})")
    return devices


def auto_topology(cfg: Config, data, devices: int) -> dict:
    """``--topology auto``: measure the stage costs, pick N-M of ``devices``, say why in one line."""
    from dflash_actors.tools.advice import choose
    n, m, why = choose(cfg, data, devices)
    print(why, file=sys.stderr)
    return {"topology.num_targets": n, "topology.num_drafters": m}


def keep_batches_per_step(cfg: Config, run_dir: str, drafters: Optional[int]) -> dict:
    """A resume on another number of drafters keeps the run's batches per step by
    adapting ``train.grad_accum`` (unless ``--set train.grad_accum`` says otherwise)."""
    import yaml

    from dflash_actors.job.rundir import SAVED_CONFIG
    from dflash_actors.train.checkpoint import adapt_grad_accum
    saved = Path(run_dir) / SAVED_CONFIG
    if not saved.is_file():
        return {}
    accum = adapt_grad_accum(yaml.safe_load(saved.read_text()),
                             (drafters or cfg.topology.num_drafters) * cfg.topology.nodes)
    return {} if accum is None or accum == cfg.train.grad_accum else {"train.grad_accum": accum}


def chaos(cfg: Config, args: argparse.Namespace, total_batches: int) -> list[dict]:
    """``--chaos SEED``: ``--chaos-faults`` random faults over the run's batches."""
    from dflash_actors.tools.chaos import chaos_faults
    if args.chaos_faults < 1:
        raise ValueError(f"--chaos-faults: must be >= 1 (got {args.chaos_faults})")
    faults = chaos_faults(cfg, args.chaos, args.chaos_faults, total_batches)
    print(f"--chaos {args.chaos}: {len(faults)} faults: "
          + ", ".join(f"{f['actor']} {f['kind']} at {f['at']} of batch {f['at_batch']}" for f in faults),
          file=sys.stderr)
    return faults


def plan_summary(cfg: Config, pre) -> dict:
    """What ``--plan-only`` shows: the data, the placement (``targets``: one device per
    rank, ``target_tp`` ranks per target), the first epoch's plan and the memory plan.
    Without data yet (``check_data``) its keys are null."""
    ds = pre.dataset
    data = {"samples": None, "tokens": None, "truncated": None, "dropped": None, "epoch0": None} if ds is None else \
        {"samples": len(ds), "tokens": ds.num_tokens, "truncated": ds.n_truncated, "dropped": ds.n_dropped,
         "epoch0": pre.plan0.stats(ds.lengths, cfg.batching.token_budget)}
    return {"dataset": str(pre.train_path), **data, "targets": pre.devices.targets,
            "target_tp": cfg.topology.target_tp, "drafters": pre.devices.drafters, **pre.plan.as_json()}


def show_plan(cfg: Config, pre, as_json: bool) -> int:
    """Print ``--plan-only``'s answer; 2 (with the plan's one line) when a device does not fit."""
    summary = plan_summary(cfg, pre)
    if as_json:
        print(json.dumps(summary))
    else:
        e0 = summary["epoch0"]
        if e0 is None:
            print(f"data: {summary['dataset']} does not exist yet: planned from batching.token_budget and "
                  "data.max_seq_len")
        else:
            print(f"data: {summary['dataset']}: {summary['samples']} samples, {summary['tokens']} tokens "
                  f"({summary['truncated']} truncated, {summary['dropped']} dropped); epoch 0: {e0['batches']} "
                  f"batches, padding efficiency {e0['padding_efficiency']}")
        print(f"placement: targets {list(pre.devices.targets)} (target_tp {cfg.topology.target_tp}), "
              f"drafters {list(pre.devices.drafters)}")
        print(pre.plan.table())
    if pre.plan.problem:
        print(f"error: {pre.plan.problem}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    args = parse_args(argv)
    # c10d logs every broken connection with a C++ backtrace; a lost node is reported
    # in one line instead (read when torch loads, in this process and the fork server).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from dflash_actors.job.forkserver import EarlyForkServer
    early = None if args.plan_only else EarlyForkServer()
    try:
        node, resume, cfg, pre = settle(args, early)
        if args.plan_only:
            return show_plan(cfg, pre, args.json)
        from dflash_actors.job.job import Job
        job = Job(cfg, resume=resume, node=node, pre=pre, forkserver=early.server)
    except (ValueError, OSError) as e:   # ConfigError, DatasetError, ResumeError are ValueErrors
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    else:
        return job.run().exit_code
    finally:
        if early is not None:
            early.stop()


if __name__ == "__main__":
    sys.exit(main())
