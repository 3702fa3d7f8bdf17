"""The sections of a run's config that say where and how it runs: the data, its batches,
the target, the topology (and the simulated devices), the runtime, the evaluation and the
monitor. What the drafter is and how it learns are ``learning``'s sections; the tree and
its loading are the package's (``dflash_actors.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from ..runtime.config import (
    ConfigError,
    RuntimeConfig,
    above,
    at_least,
    checked,
    nonempty,
    optional,
)


@dataclass(frozen=True)
class SyntheticDataConfig:
    """The embedded default dataset: prompts then completions drawn from a sparse
    random first-order Markov chain, so that the next token is learnable (``branching``
    likely successors per word) rather than uniform noise."""

    num_samples: int = checked(1024, at_least(1))
    heldout_samples: int = checked(32, at_least(0))
    vocab_size: int = checked(256, at_least(8))
    prompt_len: tuple[int, int] = (8, 32)
    completion_len: tuple[int, int] = (48, 160)
    branching: int = checked(3, at_least(1))
    seed: int = 1234

    def __post_init__(self):
        for name in ("prompt_len", "completion_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"{name}: must be [min, max] with 1 <= min <= max (got {[lo, hi]})")


@dataclass(frozen=True)
class DataConfig:
    path: Optional[str] = checked(None, optional(nonempty))
    """HF ``save_to_disk`` directory, ``.arrow`` or ``.parquet``; None = synthetic."""
    max_seq_len: int = checked(4096, at_least(2))
    overlong: Literal["truncate", "drop"] = "truncate"
    cache_dir: str = ".cache"
    """Where the synthetic dataset and target are generated (keyed by their config)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass(frozen=True)
class BatchingConfig:
    token_budget: int = checked(65536, at_least(1))
    """Padded tokens per batch: n_samples * longest_sample <= token_budget."""
    max_samples: int = checked(512, at_least(1))
    sort_pool: int = checked(64, at_least(1))
    """Length grouping sorts pools of about this many batches' worth of samples."""


@dataclass(frozen=True)
class TinyTargetConfig:
    """Shape of the synthetic Qwen3 target built from config (random init, then a short
    fit to the synthetic data so that its greedy text is not degenerate). Heads of 32:
    the smallest a serving engine has kernels for (vLLM's CPU attention refuses 16), so
    that the demo's drafter can be served (``launch.py serve-check``)."""

    hidden_size: int = checked(128, at_least(8))
    num_layers: int = checked(4, at_least(1))
    num_heads: int = checked(4, at_least(1))
    num_kv_heads: int = checked(2, at_least(1))
    intermediate_size: int = checked(256, at_least(1))
    pretrain_steps: int = checked(300, at_least(0))
    pretrain_batch: int = checked(8, at_least(1))
    """Sequences per pretraining step (the fit is kept short: seconds on one thread)."""

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size: must be divisible by num_heads={self.num_heads} (got {self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads: must be divisible by num_kv_heads={self.num_kv_heads} (got {self.num_heads})")


@dataclass(frozen=True)
class TargetConfig:
    path: Optional[str] = checked(None, optional(nonempty))
    """Local HF causal-LM directory (or GGUF package dir with ``gguf_file``); None = tiny."""
    gguf_file: Optional[str] = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bfloat16 on CUDA, float32 on CPU."""
    self_check: bool = True
    """Each target actor checks at start that its packed-batch features equal the
    model's plain forward (``output_hidden_states``) at the configured layers, and
    stops the job before training if they differ. With shared weights on CPU, once per
    job: a restart computes on the very bytes the first start checked."""
    feature_cache: Literal["off", "memory", "disk"] = "off"
    """Offline mode for repeated epochs: a sample's features are computed once, in the
    first batch that holds it, and reused by later epochs instead of running the target
    again. ``memory``: kept in shared host memory for the job's life; ``disk``: kept in
    ``<run_dir>/feature-cache`` and reused by a resumed job (checked against the data
    and the target, discarded when they differ)."""
    feature_cache_gb: float = checked(4.0, above(0))
    """Size budget of the feature cache; samples past it are computed every epoch."""
    share_weights: Literal["auto", "on", "off"] = "auto"
    """``on``: the job reads the target's weights once into shared host memory before
    the targets start, and every target actor, first start or restart, maps them (on
    CPU it computes on them in place; on a GPU it copies them to its device) instead of
    reading the checkpoint (``models.shared_weights``). ``off``: each target actor reads
    the checkpoint itself. auto = on when the weights take at most half of the host's
    available memory; the job says which in one line."""
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@dataclass(frozen=True)
class TopologyConfig:
    num_targets: int = checked(1, at_least(1))
    num_drafters: int = checked(1, at_least(1))
    nodes: int = checked(1, at_least(1))
    """Machines, each running this N-M topology with its own supervisor (``cluster``);
    ``launch.py`` sets it from ``--nnodes`` or the torchrun/SLURM environment."""
    target_tp: int = checked(1, at_least(1))
    """Devices (processes) per target actor: above 1 the target runs tensor parallel
    over a gang of that many ranks (``runtime.supervisor``: one actor, restarted as
    one; ``docs/tensor-parallel.md``). ``--topology NxK-M`` sets it to K."""
    target_devices: Optional[tuple[str, ...]] = None
    """None = cuda:0..N*K-1 when enough GPUs exist (a gang's ranks adjacent), else cpu
    (``wiring.resolve_devices``; cpu too when only ``drafter_devices`` is given);
    given: one device per rank, target by target (N*K entries). A gang's K entries are
    all cpu or K distinct GPUs; separate actors may share a GPU."""
    drafter_devices: Optional[tuple[str, ...]] = None
    """None = cuda:N*K..N*K+M-1 when enough GPUs exist, else cpu (cpu too when only
    ``target_devices`` is given)."""

    def __post_init__(self):
        for name, n in (("target_devices", self.num_targets * self.target_tp),
                        ("drafter_devices", self.num_drafters)):
            devs = getattr(self, name)
            if devs is not None and len(devs) != n:
                raise ConfigError(f"{name}: needs {n} entries to match the topology (got {list(devs)})")
            for d in devs or ():
                if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
                    raise ConfigError(f"{name}: devices are 'cpu' or 'cuda:N' (got {d!r})")
        k = self.target_tp
        if self.target_devices is None or k == 1:
            return
        for i in range(self.num_targets):
            gang = list(self.target_devices[i * k:(i + 1) * k])
            # Each rank picks its backend from its own device (gloo on cpu, NCCL on cuda),
            # so a mixed gang's ranks would never meet in one process group.
            if "cpu" in gang and len(set(gang)) > 1:
                raise ConfigError(f"target_devices: target {i}'s gang {gang} mixes cpu and cuda; a gang's "
                                  "ranks are all cpu (gloo) or all on GPUs (NCCL)")
            if "cpu" not in gang and len(set(gang)) < k:
                raise ConfigError(f"target_devices: target {i}'s gang {gang} repeats a GPU; NCCL needs "
                                  f"{k} distinct GPUs for its {k} ranks")


@dataclass(frozen=True)
class SimulateConfig:
    """Simulated compute (``runtime.simulate``): target and drafter actors replace their
    model with a wait of this cost, which leaves the CPU free as a GPU kernel would.
    Everything else stays real: batches, feature slots of the real width, gradient
    sums, weights, the optimizer step, every message. ``make bench`` measures the
    pipeline's own cost this way."""

    enabled: bool = False
    target_us_per_token: float = checked(0.0, at_least(0))
    target_ms_per_batch: float = checked(0.0, at_least(0))
    drafter_us_per_token: float = checked(0.0, at_least(0))
    drafter_ms_per_batch: float = checked(0.0, at_least(0))
    model: Optional[str] = checked(None, optional(nonempty))
    """A ``costmodel.SHAPES`` name (e.g. qwen3-8b): per-token costs derived from that
    target shape, a 5-layer drafter and ``tflops``, added to the costs above (the name
    is checked by the preflight, ``simulate.check``)."""
    tflops: float = checked(400.0, above(0))
    """Sustained TFLOP/s assumed for ``model``."""
    feature_width: Optional[int] = checked(None, optional(at_least(1)))
    """Feature floats per token in the slots; None = what the target would produce."""


@dataclass(frozen=True)
class JobRuntimeConfig(RuntimeConfig):
    """The runtime's section plus the training job's own runtime choices."""

    schedule: Literal["pipelined", "lockstep"] = "pipelined"
    """lockstep: the old loop, for comparison: each step loads, then runs the targets,
    then the drafters, then the optimizer, with no overlap (same math, same bytes)."""
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    grad_durability: Literal["batch", "step"] = "step"
    """Where a drafter keeps its running gradient sum between the batches of a step
    (it matters only with ``train.grad_accum`` > 1). ``step``: on its device, stored in
    shared memory once, with the step's last batch; a drafter that dies has its
    batches of the step made again, from the loader on. ``batch``: stored in shared
    memory after every batch, so a dying drafter loses nothing, at the price of
    copying the whole sum from and back to the device for every batch. The math is
    the same, bit for bit. ``benchmarks/bench_durability.py`` measures both."""
    optimizer_device: str = "auto"
    """Where the optimizer keeps the drafter's weights, both AdamW moments and the step's
    gradient sum (about 6 x 4 bytes a parameter at its peak): ``cpu``, ``cuda:N``, or
    auto: the memory plan's choice, a GPU where it leaves the drafters the most room
    (targets' GPUs first), else the host (``--plan-only`` shows it)."""
    feature_transport: Literal["auto", "host", "cuda"] = "auto"
    """Where the feature ring (the target's hidden states for the drafters) lives.
    ``host``: shared host memory, page-locked by every GPU actor that copies it;
    ``cuda``: device memory of a drafter's GPU that every target and drafter reaches
    (peer to peer from other GPUs), written by the targets and read in place by the
    drafters through CUDA IPC; ``auto``: either, where the memory plan finds the most
    room (``--plan-only`` shows it)."""

    def __post_init__(self):
        d = self.optimizer_device
        if d not in ("auto", "cpu") and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise ConfigError(f"optimizer_device: 'auto', 'cpu' or 'cuda:N' (got {d!r})")


@dataclass(frozen=True)
class EvalConfig:
    """Periodic held-out evaluation during training (``evaluator``: its own process,
    reading published weights, so it never holds up the pipeline)."""

    every: int = checked(0, at_least(0))
    """Optimizer steps between evaluations (and the final weights); 0 = off."""
    data: Optional[str] = checked(None, optional(nonempty))
    """Held-out dataset of target text (``prepare`` on held-out prompts); None = the
    synthetic held-out split."""
    max_samples: int = checked(32, at_least(1))
    real_prompts: int = checked(0, at_least(0))
    """Also run real speculative decoding on this many held-out prompts."""
    max_new_tokens: int = checked(64, at_least(1))
    device: str = "auto"
    """Where the evaluator runs: ``cpu``, ``cuda:N``, or auto: the memory plan's choice, as
    for the optimizer: a GPU with room for a whole target beside what is there (it holds
    one while it computes the held-out features at its start), else the host."""
    plateau: int = checked(0, at_least(0))
    """Stop training (done, exit 0) once the held-out walk tau has not risen beyond its 95%
    interval over this many evaluations: the newest against the one that many before,
    paired over the held-out texts (``evaluator.plateau``); 0 = train every step."""

    def __post_init__(self):
        if self.device not in ("auto", "cpu") and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ConfigError(f"device: 'cpu' or 'cuda:N', or 'auto' (got {self.device!r})")
        if self.plateau and not self.every:
            raise ConfigError("eval.plateau: needs eval.every, the evaluations it compares")


@dataclass(frozen=True)
class MonitorConfig:
    """What a running job shows and records besides training itself (``monitor``)."""

    console: Literal["auto", "bar", "lines", "off"] = "auto"
    """auto: a live bar when stdout and stderr are terminals, else plain lines on stdout."""
    log_every_s: float = checked(30.0, above(0))
    """Seconds between the progress lines of the ``lines`` console."""
    resources_every_s: float = checked(5.0, above(0))
    """Seconds between resource samples (RSS, CPU, GPU memory, busy %) in ``metrics.jsonl``."""
    tensorboard: bool = True
    """Also write TensorBoard scalars to ``<run_dir>/tensorboard`` when ``tensorboard`` is installed."""
    peak_tflops: Optional[float] = checked(None, optional(above(0)))
    """The devices' peak TFLOP/s, for MFU in the summary; None: known CUDA devices' bf16 dense peak."""
