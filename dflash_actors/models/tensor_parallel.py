"""A target split over a gang of processes (``topology.target_tp`` K > 1).

Each rank of a target actor's gang (``runtime.dispatch.Stage.gang``) joins the gang's
own process group (gloo on CPU, NCCL on GPU, at the rendezvous the supervisor picked
for this start) and loads its shard of the target with the model's own
tensor-parallel plan (transformers' ``base_model_tp_plan``: attention and MLP
projections split by heads and columns, an all-reduce after each block's output
projection). The residual stream, and so every layer's hidden states, is whole and
equal on every rank after those all-reduces; rank 0's copy becomes the features.

Why it is built this way:
  * transformers sizes the split from ``tp_size`` (or the ``WORLD_SIZE`` variable),
    not from the process group: without ``tp_size`` it loads every rank unsplit.
  * On a GPU it binds each rank to ``cuda:LOCAL_RANK``; the rank sets that variable to
    its placed device's index, so gangs land where ``wiring.resolve_devices`` put them.
  * The group's timeout bounds the rendezvous (one start's worth of waiting); a rank
    that hangs inside a collective is the supervisor's business (``hang_timeout_s``
    on every rank's heartbeat), well before that timeout.
"""

from __future__ import annotations

import datetime
import importlib.util
import os

import torch

from ..config import ConfigError


def check(cfg, config) -> None:
    """ConfigError (exit 2) unless ``cfg``'s target can split ``topology.target_tp`` ways."""
    k = cfg.topology.target_tp
    if k == 1 or cfg.runtime.simulate.enabled:
        return
    where = f"topology.target_tp: {k}"
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(f"{where} loads the target with transformers' tensor-parallel plan, which needs "
                          "accelerate (pip install accelerate)")
    if not getattr(config, "base_model_tp_plan", None):
        raise ConfigError(f"{where}, but this target ({type(config).__name__}) has no tensor-parallel plan in "
                          "transformers; run it whole (target_tp 1)")
    for name in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, name, None)
        if n is not None and n % k:
            raise ConfigError(f"{where} does not divide the target's {name} ({n}); use a divisor of it")


def join(rendezvous: str, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
    """Join the gang's process group from this rank (once per process)."""
    import torch.distributed as dist

    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=rendezvous, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def load_shard(path, dtype: torch.dtype, world: int):
    """This rank's shard of the target at ``path``, placed by transformers (see module)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                distributed_config=DistributedConfig(tp_plan="auto", tp_size=world))


def is_sharded(model) -> bool:
    """Whether any parameter of ``model`` is a DTensor (really split, not replicated whole)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
