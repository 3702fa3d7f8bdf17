"""The target's weights read once into shared host memory, mapped by every target actor.

Without this, each target actor reads and parses the whole checkpoint itself, on every
start and restart: minutes of an idle GPU per kill at 27B, and one host copy per target
when two targets of one model share a machine. With ``target.share_weights`` on, the
job (in the supervisor's process, before anything spawns) loads the model once on the
CPU in the dtype the targets compute in, and packs every parameter and buffer,
non-persistent ones included (rotary frequencies), into one flat shared byte tensor:
one file descriptor to hand to each actor however many tensors the model has (a
message can carry at most 253). A target actor builds the model's skeleton on the meta
device from its config (no allocation, no initialisation) and then
  * on CPU uses views of the shared bytes as its parameters: zero copy, so every target
    of the host computes on the one copy;
  * on a GPU page-locks the shared bytes once and copies each tensor to its device.
Tied weights stay tied: names that shared a tensor in the loaded model share an offset.
The memory is the torch ``file_descriptor`` strategy's, unlinked at creation, so no
ending, clean or killed, leaves anything in ``/dev/shm``. The target's self-check runs
on the model the actor built, so a packing mistake stops the job before training. On
CPU every target computes on the very bytes the first one checked, with the code of
the same fork server: a restart there records nothing new by checking them again, so
it does not (``checked``); a GPU copy, like a read from disk, is checked each time.

A tensor-parallel gang (``topology.target_tp`` K > 1) uses the same unsplit copy: each
rank hands it to transformers' loader as the state dict (``tensor_parallel.load_shard``),
which slices out the rank's shard exactly as it would from the checkpoint's files, so
a restarted rank copies its shard from memory instead of reading and parsing the
checkpoint. One copy in all, however many ranks: per-rank shard buffers would add up
to the same bytes plus every replicated tensor K times.

Where the bytes live: torch's shared memory is a file in ``/dev/shm`` (unlinked at
once), so it is bounded by that mount's size, not by the host's RAM: 64 MB in a
default container. ``decide`` counts the smaller of the two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch
from torch import nn

ALIGN = 64
"""Byte alignment of each tensor in the flat buffer (a cache line; enough for any dtype)."""

PAGE = 4096
"""Bytes apart that one read per page touches (the smallest page size Linux uses)."""

SHARE_FRACTION = 0.5
"""``share_weights: auto`` shares when the weights take at most this much of the host's
available memory and of ``/dev/shm``'s free space (the rest stays for the rings, the
cache and the actors)."""

SHM = "/dev/shm"


@dataclass(frozen=True)
class SharedWeights:
    """One model's tensors in one shared byte buffer: ``entries`` are
    ``(name, dtype, shape, offset)``, several names at one offset where tensors are tied."""

    flat: torch.Tensor
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    checked: torch.Tensor
    """One shared flag: a target computing on ``flat`` in place passed its self-check."""
    state: frozenset[str] = frozenset()
    """The names the model's ``state_dict`` holds (not its non-persistent buffers):
    what a loader given ``tensors(state_only=True)`` expects."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def fault_in(self) -> None:
        """Touch every page of the buffer, so that a CPU target is ready to compute at
        full speed when it says so: a fresh mapping faults each page on its first use,
        which would otherwise fall on the first batch after a restart."""
        self.flat[::PAGE].sum()

    def tensors(self, state_only: bool = False) -> dict[str, torch.Tensor]:
        """Name -> a view of the shared bytes (tied names get the very same view);
        ``state_only``: the state dict's names alone."""
        views: dict[int, torch.Tensor] = {}
        out = {}
        for name, dtype, shape, offset in self.entries:
            if state_only and name not in self.state:
                continue
            if offset not in views:
                dt = getattr(torch, dtype)
                n = _numel(shape) * dt.itemsize
                views[offset] = self.flat[offset:offset + n].view(dt).view(shape)
            out[name] = views[offset]
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def pack(model: nn.Module, midway: Optional[Callable[[], None]] = None) -> SharedWeights:
    """Every parameter and buffer of ``model`` copied into one shared buffer; each source
    tensor is emptied once copied, so the peak stays near one model's size. ``midway()``
    runs once half the tensors are in (a fault point: ``runtime.faults``)."""
    named = _named_tensors(model)
    state = frozenset(model.state_dict())
    offsets: dict[int, int] = {}
    entries, total, order = [], 0, []
    for name, t in named:
        key = id(t)
        if key not in offsets:
            offsets[key] = total
            order.append((t, total))
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offsets[key]))
    flat = torch.empty(max(total, 1), dtype=torch.uint8).share_memory_()
    with torch.no_grad():
        for k, (t, off) in enumerate(order):
            if midway is not None and k == len(order) // 2:
                midway()
            n = t.numel() * t.element_size()
            flat[off:off + n].view(t.dtype).view(t.shape).copy_(t)
            t.data = torch.empty(0, dtype=t.dtype)
    return SharedWeights(flat, tuple(entries), torch.zeros(1, dtype=torch.int8).share_memory_(), state)


def share_target(path: Path, dtype: torch.dtype, midway: Optional[Callable[[], None]] = None) -> SharedWeights:
    """Load the target at ``path`` once on the CPU in ``dtype`` and pack it (``pack``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .target_dir import attention_for

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation=attention_for(AutoConfig.from_pretrained(path)))
    return pack(model, midway)


def build_on(path: Path, weights: SharedWeights, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target at ``path`` with ``weights`` as its tensors: views of the shared memory
    on CPU, copies (from page-locked memory) on a GPU. Raises if the skeleton has a
    tensor the shared weights lack, or the other way round."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..runtime.channels import page_lock
    from .target_dir import attention_for

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_for(config))
    shared = weights.tensors()
    names = {name for name, _ in _named_tensors(model)}
    if names != set(shared):
        missing, extra = sorted(names - set(shared)), sorted(set(shared) - names)
        raise ValueError(f"target.share_weights: the shared weights do not fit the model built from {path} "
                         f"(missing {missing[:3]}, unexpected {extra[:3]})")
    if device.type == "cuda":
        page_lock([weights.flat], "target.share_weights")
        placed = {id(t): t.to(device, non_blocking=True) for t in shared.values()}
        torch.cuda.synchronize(device)
    else:
        weights.fault_in()
        placed = {id(t): t for t in shared.values()}
    params: dict[int, nn.Parameter] = {}
    for name, t in shared.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        local = placed[id(t)]
        if attr in module._parameters:
            module._parameters[attr] = params.setdefault(id(t), nn.Parameter(local, requires_grad=False))
        else:
            module._buffers[attr] = local
    return model.eval()


def weight_bytes(path: Path, dtype: torch.dtype) -> int:
    """The checkpoint's size once loaded in ``dtype``, from its safetensors headers."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                total += _numel(st.get_slice(k).get_shape()) * dtype.itemsize
    return total


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def shm_free() -> Optional[int]:
    """Bytes free in ``/dev/shm``, where torch's shared memory lives (None without one)."""
    try:
        st = os.statvfs(SHM)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def decide(setting: str, nbytes: int, targets: int, available: int | None = None,
           shm: int | None = None, ranks: int = 1) -> tuple[bool, str]:
    """Whether to share (``target.share_weights``) and the one line that says so.
    ``available``: host memory free for it, ``shm``: ``/dev/shm``'s free bytes (None:
    their figures now); ``ranks``: processes per target (``topology.target_tp``).
    ``on`` that cannot fit in ``/dev/shm`` is a ConfigError: the write would die of
    SIGBUS halfway."""
    free = psutil.virtual_memory().available if available is None else available
    shm = shm_free() if shm is None else shm
    size = _size(nbytes)
    each = f"each of the {ranks} ranks of each target reads its shard" if ranks > 1 else "each target reads them"
    if setting == "off":
        return False, f"target weights: {size}; {each} from disk, at every start (share_weights off)"
    room = f"{_size(free)} of host memory available, {_size(shm)} free in {SHM}" if shm is not None \
        else f"{_size(free)} of host memory available"
    if setting == "on" and shm is not None and nbytes > shm:
        from ..config import ConfigError
        raise ConfigError(f"target.share_weights: on needs {size} in {SHM}, which has {_size(shm)} free; use auto "
                          "or off, or give it room (docker run --shm-size)")
    if setting == "auto" and nbytes > SHARE_FRACTION * min(free, shm if shm is not None else free):
        return False, (f"target weights: {size}; {each} from disk, at every start (share_weights auto: more than "
                       f"{SHARE_FRACTION:.0%} of {room})")
    how = "share_weights on" if setting == "on" else f"share_weights auto: {room}"
    use = (f"whose {ranks} ranks each slice their shard from it" if ranks > 1 else "and their restarts")
    return True, f"target weights: {size} read once into shared memory for {targets} target(s) {use} ({how})"
