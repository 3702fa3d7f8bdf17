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
    It picks the device type from the machine's accelerator, not from the process
    group: a rank placed on the CPU of a GPU host would bind to a GPU. During such a
    rank's load the accelerator reads as the CPU (``_placed_on``).
  * With the job's shared copy of the weights (``models.shared_weights``) the loader
    gets them as its state dict and slices this rank's shard out of them, as it would
    out of the checkpoint's files: same bytes, no disk.
  * The group's timeout bounds the rendezvous (one start's worth of waiting); a rank
    that hangs inside a collective is the supervisor's business (``hang_timeout_s``
    on every rank's heartbeat), well before that timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import re
from dataclasses import dataclass

import torch

from ..config import ConfigError
from .self_check import SELF_CHECK_TOLERANCE, SelfCheckError


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
    s = split_of(config, k)
    if s.whole > WHOLE_AT_MOST * s.total:
        group, n = max(s.whole_groups.items(), key=lambda kv: kv[1])
        raise ConfigError(
            f"{where}: transformers' tensor-parallel plan for {config.model_type} leaves {_named(group)} whole on "
            f"every rank ({s.whole / s.total:.0%} of its weights), so a gang of {k} would hold "
            f"{s.per_rank / s.total:.0%} of the target on each GPU; run it whole (target_tp 1) on GPUs that hold it")
    for name in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, name, None)
        if n is not None and n % k:
            raise ConfigError(f"{where} does not divide the target's {name} ({n}); use a divisor of it")


WHOLE_AT_MOST = 0.5
"""The largest share of a target's weights a gang may keep whole on every rank. Above
it a gang of K holds more than half the target on each GPU: for the MoE families of
transformers 5.25 (qwen3_moe, qwen3_next, qwen3_5_moe, gpt_oss, deepseek_v3, glm4_moe,
minimax_m2), whose plans split attention and dense MLPs but not the experts (90% and
more of the weights), the split would cost a gang's all-reduces and save almost nothing.
Dense targets keep under 1% whole (norms, the linear attention's convolutions). Checked
before the heads divide: a family the plan cannot split is refused for what it is.
(Newer transformers plans split experts, ``local_rowwise``: the share is read from the
installed plan, so such a target passes here when it can.)"""
SPLITTING = ("colwise", "rowwise", "packed_", "unit_", "embedding_", "moe_tp_experts")
"""transformers' parallel styles that shard a weight (``ALL_PARALLEL_STYLES``); the rest
(``replicate``, ``replicated_with_grad_allreduce``, ``sequence_parallel``, ``all_reduce``,
``mla_kv_a_proj``, ``local_params``) keep it whole, as does a weight no plan entry names."""
FAMILY_GROUPS = {"mlp.experts": "its MoE experts", "linear_attn": "its linear attention",
                 "self_attn": "its attention"}


@dataclass(frozen=True)
class Split:
    """A target's parameters under transformers' tensor-parallel plan for ``ranks`` ranks."""

    ranks: int
    total: int
    whole: int
    """Kept whole on every rank."""
    whole_groups: dict
    """Those by module (``layers.*.mlp.experts``): what the refusal names."""

    @property
    def per_rank(self) -> int:
        """What each rank holds: its share of the split weights, and every whole one."""
        return -(-(self.total - self.whole) // self.ranks) + self.whole


def split_of(config, ranks: int) -> Split:
    """How the model ``config`` describes splits over ``ranks`` ranks, from the plan its
    transformers class carries (``model._tp_plan``: the base model's, the head's and the
    embeddings'), built on the meta device: no memory, a second for a 1T-parameter model."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = {re.compile(re.escape(k).replace(r"\*", r"\d+") + r"(\.|$)"): v
            for k, v in (getattr(model, "_tp_plan", None) or {}).items()}
    total = whole = 0
    groups: dict[str, int] = {}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        total += n
        style = next((v for k, v in plan.items() if k.match(name)), None)
        if style is None or not style.startswith(SPLITTING):
            whole += n
            group = re.sub(r"\.\d+\.", ".*.", name).rsplit(".", 1)[0].removeprefix("model.")
            groups[group] = groups.get(group, 0) + n
    return Split(ranks, total, whole, groups)


def _named(group: str) -> str:
    """A module group as the refusal names it: the family's part, then its path."""
    label = next((v for k, v in FAMILY_GROUPS.items() if f".{k}" in f".{group}"), "its")
    return f"{label} ({group})" if label != "its" else f"its {group}"


def join(rendezvous: str, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
    """Join the gang's process group from this rank (once per process)."""
    import torch.distributed as dist

    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=rendezvous, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def load_shard(path, dtype: torch.dtype, world: int, device: torch.device, weights=None):
    """This rank's shard of the target at ``path``, placed by transformers (see module);
    ``weights``: the job's shared copy (``shared_weights.SharedWeights``) to slice it from."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from .target_dir import attention_for

    split = DistributedConfig(tp_plan="auto", tp_size=world)
    config = AutoConfig.from_pretrained(path)
    with _placed_on(device):
        if weights is None:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention_for(config),
                                                        distributed_config=split)
        # The concrete class: the auto class insists on a checkpoint name beside a state dict.
        cls = AutoModelForCausalLM._model_mapping[type(config)]
        return cls.from_pretrained(None, config=config, state_dict=weights.tensors(state_only=True), dtype=dtype,
                                   attn_implementation=attention_for(config), distributed_config=split)


@contextlib.contextmanager
def _placed_on(device: torch.device):
    """The machine's accelerator reads as ``device``'s type while transformers builds a
    CPU-placed rank's mesh (module docstring); nothing changes for a GPU rank."""
    real = torch._C._get_accelerator
    if device.type != "cpu" or real().type == "cpu":
        yield
        return
    torch._C._get_accelerator = lambda *args, **kwargs: torch.device("cpu")
    try:
        yield
    finally:
        torch._C._get_accelerator = real


def is_sharded(model) -> bool:
    """Whether any parameter of ``model`` is a DTensor (really split, not replicated whole)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_split(target, path, rank: int, length: int = 16, seed: int = 0) -> str:
    """Check a gang's split against the checkpoint itself, at any size; every rank calls
    it (the split forward is collective), rank 0 compares. Raises ``SelfCheckError``;
    returns what was compared against, in a phrase.

    The gang's own self-check (``models.self_check``) compares the wrapper with
    the split model's own forward, so a wrong split passes it. Here rank 0 rebuilds,
    unsplit and on its CPU, the first decoder layer and the deepest one the features use,
    from their tensors in the checkpoint's files (a layer of a 27B target is under 1 GB:
    affordable where the whole model is not), feeds each the very input the gang's
    layer got, and compares the outputs; and the embedding rows of the input tokens, when
    the embedding is a plain lookup. A head, row or column put on the wrong rank, or a
    missing all-reduce, changes those outputs."""
    from torch import nn


    decoder = target._decoder
    layers = sorted({0, max(target.feature_ids)})
    seen: dict[int, tuple] = {}
    hooks = []
    for i in layers:
        def before(_m, args, kwargs, i=i):
            seen[i] = (args, kwargs)

        def after(_m, _args, _kwargs, out, i=i):
            seen[i] = (*seen[i], out[0] if isinstance(out, tuple) else out)
        hooks += [decoder.layers[i].register_forward_pre_hook(before, with_kwargs=True),
                  decoder.layers[i].register_forward_hook(after, with_kwargs=True)]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, length), generator=g)
    try:
        with torch.no_grad():
            target.hidden(ids.to(target.device))
    finally:
        for h in hooks:
            h.remove()
    if rank != 0:
        return ""
    tol = SELF_CHECK_TOLERANCE.get(target.dtype, 3e-2)
    files = _checkpoint_files(path)
    prefix = next(name for name, m in target.model.named_modules() if m is decoder)
    prefix = f"{prefix}." if prefix else ""
    compared = []
    embed = decoder.embed_tokens
    if type(embed) is nn.Embedding:
        rows = _read_rows(files, f"{prefix}embed_tokens.weight", ids[0].tolist())
        got = seen[0][0][0] if seen[0][0] else seen[0][1]["hidden_states"]
        _close(got[0].float().cpu(), rows.float(), tol, "the embedding of the input tokens", target.dtype)
        compared.append("embedding rows")
    for i in layers:
        args, kwargs, out = seen[i]
        config = target.config
        layer = type(decoder.layers[i])(config, i).to(torch.float32)
        want = {k.removeprefix(f"{prefix}layers.{i}."): v for k, v in _read(files, f"{prefix}layers.{i}.").items()}
        missing = set(layer.state_dict()) - set(want)
        if missing:
            raise SelfCheckError(f"topology.target_tp: the checkpoint has no {sorted(missing)[0]!r} for layer {i} "
                                 "(its names differ from the model's): the split cannot be checked")
        layer.load_state_dict({k: want[k] for k in layer.state_dict()})
        ref = layer(*(_plain(a) for a in args), **{k: _plain(v) for k, v in kwargs.items()})
        ref = ref[0] if isinstance(ref, tuple) else ref
        _close(out.float().cpu(), ref.float(), tol, f"layer {i} rebuilt unsplit from the checkpoint", target.dtype)
        compared.append(f"layer {i}")
    return f"the checkpoint's unsplit {' and '.join(compared)}"


def _plain(x):
    """A captured layer input as a plain float32 CPU value (tuples too)."""
    if isinstance(x, torch.Tensor):
        from torch.distributed.tensor import DTensor
        x = x.full_tensor() if isinstance(x, DTensor) else x
        return x.float().cpu() if x.is_floating_point() else x.cpu()
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    return x


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str, dtype) -> None:

    err, scale = float((got - want).abs().max()), float(want.abs().max())
    if not err <= tol * max(scale, 1.0):
        raise SelfCheckError(f"topology.target_tp: the split model differs from {what}: max error {err:.3g}, "
                             f"activations up to {scale:.3g}, tolerance {tol:g} relative ({dtype}); "
                             "the tensor-parallel plan splits this target wrongly")


def _checkpoint_files(path) -> list:
    from pathlib import Path

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise SelfCheckError(f"topology.target_tp: {path} has no .safetensors files to check the split against")
    return files


def _read(files, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint whose name starts with ``prefix``, as float32."""
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.startswith(prefix):
                    out[k] = st.get_tensor(k).float()
    return out


def _read_rows(files, name: str, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of the checkpoint's tensor ``name``, read one by one (the whole
    embedding of a big vocabulary need not be)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                sl = st.get_slice(name)
                return torch.cat([sl[r:r + 1] for r in rows]).float()
    raise SelfCheckError(f"topology.target_tp: the checkpoint has no {name!r} to check the split against")
