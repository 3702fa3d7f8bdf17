"""Which node this is: the machine's rank in a run over several machines.

``node_spec`` reads it from ``--nnodes/--node-rank/--master``, else torchrun's
environment, else SLURM's, else it is the only node; anything inconsistent is a
ValueError (exit 2). ``launcher_restart`` says whether torchrun or SLURM relaunched
the job (a relaunch resumes the run its first command line started).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeSpec:
    nodes: int = 1
    rank: int = 0
    addr: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    agent_store: bool = False
    """torchrun's agent already hosts the store at addr:port (node 0 joins it as a client)."""
    prefix: str = "dflash/0/"
    """Store keys of this launch (torchrun restarts reuse the agent's store)."""

    @property
    def single(self) -> bool:
        return self.nodes == 1

    def describe(self) -> str:
        return f"node {self.rank} of {self.nodes} (rendezvous {self.addr}:{self.port})"


def node_spec(nnodes: Optional[int] = None, node_rank: Optional[int] = None, master: Optional[str] = None,
              env=None) -> NodeSpec:
    """The node from ``--nnodes/--node-rank/--master``, else from torchrun's environment
    (``WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``/``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), else from
    SLURM's (``SLURM_NTASKS``, ``SLURM_PROCID``, first host of ``SLURM_JOB_NODELIST``),
    else one node. ValueError (exit 2) for anything inconsistent."""
    env = os.environ if env is None else env
    flags = (nnodes, node_rank, master)
    if any(f is not None for f in flags):
        if nnodes is None:
            raise ValueError("--nnodes: needed with --node-rank/--master")
        if nnodes > 1 and (node_rank is None or master is None):
            raise ValueError("--nnodes > 1 needs --node-rank and --master ADDR:PORT")
        addr, port = _addr_port(master or f"127.0.0.1:{DEFAULT_PORT}", "--master")
        return _checked(nnodes, node_rank or 0, addr, port, "--node-rank")
    if "WORLD_SIZE" in env and ("MASTER_ADDR" in env or "TORCHELASTIC_RUN_ID" in env):
        if int(env.get("LOCAL_WORLD_SIZE", "1")) != 1:
            raise ValueError("torchrun: run one launch.py per machine (--nproc-per-node 1); it starts "
                             "its own actors on that machine's GPUs")
        nodes = int(env["WORLD_SIZE"])
        rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", env.get("RANK", "0"))))
        port = int(env.get("MASTER_PORT", DEFAULT_PORT))
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        spec = _checked(nodes, rank, env.get("MASTER_ADDR", "127.0.0.1"), port, "GROUP_RANK")
        return NodeSpec(spec.nodes, spec.rank, spec.addr, spec.port,
                        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", prefix=f"dflash/{restart}/")
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        nodes, rank = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
        if int(env.get("SLURM_NNODES", nodes)) != nodes:
            raise ValueError(f"SLURM: run one task per node (--ntasks-per-node 1); got {nodes} tasks on "
                             f"{env.get('SLURM_NNODES')} nodes")
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        port = int(env.get("MASTER_PORT", DEFAULT_PORT))
        return _checked(nodes, rank, addr, port, "SLURM_PROCID")
    return NodeSpec()


def launcher_restart(env=None) -> int:
    """How many times torchrun (``--max-restarts``) or SLURM (a requeue) has relaunched
    this job: 0 on its first launch."""
    env = os.environ if env is None else env
    return max(int(env.get("TORCHELASTIC_RESTART_COUNT") or 0), int(env.get("SLURM_RESTART_COUNT") or 0))


def _checked(nodes: int, rank: int, addr: str, port: int, rank_name: str) -> NodeSpec:
    if nodes < 1:
        raise ValueError(f"--nnodes: must be >= 1 (got {nodes})")
    if not 0 <= rank < nodes:
        raise ValueError(f"{rank_name}: must be in [0, {nodes - 1}] for {nodes} nodes (got {rank})")
    if not addr:
        raise ValueError("master address: empty (set MASTER_ADDR or --master ADDR:PORT)")
    if not 0 < port < 65536:
        raise ValueError(f"master port: must be in [1, 65535] (got {port})")
    return NodeSpec(nodes, rank, addr, port)


def _addr_port(text: str, name: str) -> tuple[str, int]:
    addr, sep, port = text.rpartition(":")
    if not sep or not addr or not port.isdigit():
        raise ValueError(f"{name}: expected ADDR:PORT such as 10.0.0.1:29500 (got {text!r})")
    return addr.strip("[]"), int(port)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"SLURM node list: cannot read {nodelist!r}; set MASTER_ADDR")
    return m.group(1) + (re.split(r"[-,]", m.group(2))[0] if m.group(2) else "")
