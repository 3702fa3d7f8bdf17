"""An XPress export read by vLLM 0.33's own XPress code: its weight-name map, its config
reading and its refiner head, and the drafts that head makes against ours.

    python -m benchmarks.engine_xpress [--wheel .cache/vllm-033/vllm-0.33.0-...whl] [--save NAME]

vLLM 0.33 is the first release with ``Qwen3XPressModel``; it is a CUDA wheel (336 MB, Triton
kernels) that does not import on this CPU machine, and the CPU build here (0.32) has no XPress.
So this check reads ONE file from the wheel, pinned by the wheel's sha256:
``vllm/model_executor/models/qwen3_xpress.py``, executed unmodified with the rest of ``vllm``
stubbed (``benchmarks.peers``' stub modules: a stubbed name is a class that accepts anything).
What runs of vLLM's own code:

- ``Qwen3XPressModel.__init__``: the head built from the export's config.json as vLLM reads it
  (``xpress_block_size``, ``xpress_rank``, ``xpress_mlp_hidden``, ``xpress_topc``).
- ``Qwen3XPressForCausalLM.load_weights`` over the export's tensors: its name map
  (``xpress_head.*`` -> ``model.xpress_head.*``, ``HYBRID_KEY_MAP``), the raw mixer folded by
  ``fold_from_raw_``, ``build_fused_buffers``. vLLM's ``AutoWeightsLoader`` (stubbed) is
  replaced by a strict one for the head: a name it cannot place is an error, as vLLM's is.
- ``XPressRefinerHead.hidden_cache`` and ``refine_bias`` (the unfused path), driven by the
  Jacobi loop that ``jacobi_refine_greedy``'s kernels fuse (``kernels.py``' docstring: slot b
  reads ``blk[b-1]``, slot 0 the anchor's stand-in, base + bias, argmax into ``blk[1:]``), with
  ``XPressSpeculator``'s inputs: the anchor as slot 0's previous token, ``xpress_num_passes``.

Checked: every head parameter written from the export (NaN-filled before), none left over;
the refine bias equal to ours (``models.xpress``) to float rounding; the drafts equal
``eval.decode``'s (``models.xpress.jacobi``) on every block. Controls that must fail: the same
weights under speculators' names are refused by vLLM's ``load_weights`` (no ``mix.L``), and our drafts with slot 0 after
another token than the anchor differ from vLLM's. Not checked: vLLM's Triton kernels
and backbone on a GPU (the backbone is DFlash's, loaded by vLLM 0.32 in ``engine_load``).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from benchmarks import harness
from benchmarks.peers import _StubFinder

WHEEL = harness.ROOT / ".cache" / "vllm-033" / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
SOURCE = "vllm/model_executor/models/qwen3_xpress.py"
FETCH = "pip download --no-deps vllm==0.33.0 -d .cache/vllm-033"


class Unavailable(Exception):
    """The pinned wheel is not here (the check skips and says how to get it)."""


def vllm_xpress(wheel: Path = WHEEL) -> types.ModuleType:
    """``qwen3_xpress`` from the pinned wheel, executed with ``vllm``'s other modules stubbed."""
    if not wheel.is_file():
        raise Unavailable(f"{wheel.name} is not in {wheel.parent} ({FETCH})")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name}: sha256 {digest}, pinned {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        source = z.read(SOURCE).decode()
    name = "vllm.model_executor.models.qwen3_xpress"
    finder = _StubFinder({"vllm"})
    sys.meta_path.insert(0, finder)
    try:
        module = types.ModuleType(name)
        module.__file__, module.__package__ = f"{wheel.name}/{SOURCE}", "vllm.model_executor.models"
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        sys.meta_path.remove(finder)
        for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[m]
    return module


class StrictHeadLoader:
    """Stands in for vLLM's ``AutoWeightsLoader`` on the names ``load_weights`` hands it:
    ``model.xpress_head.*`` goes to the head's parameter of that name (an unknown one is
    recorded, as vLLM's loader would raise on it); the backbone's names are counted only."""

    def __init__(self, root):
        self.root = root

    def load_weights(self, items):
        head = dict(self.root.model.xpress_head.named_parameters())
        for name, t in items:
            if not name.startswith("model.xpress_head."):
                self.root.backbone.append(name)
                continue
            key = name.removeprefix("model.xpress_head.")
            if key not in head or head[key].shape != t.shape:
                self.root.unplaced.append(name)
                continue
            with torch.no_grad():
                head[key].copy_(t)
            self.root.written.add(key)


def engine_head(module, export: Path):
    """vLLM's head for ``export``, built and loaded by vLLM's own code (``StrictHeadLoader``
    for the loader). Returns the head and what the load did."""
    config = SimpleNamespace(**json.loads((export / "config.json").read_text()), xpress_compile_head=False)
    # torch.compile of refine_bias is a serving speed-up vLLM turns on by default: off here,
    # the same computation eagerly.
    model = module.Qwen3XPressModel.__new__(module.Qwen3XPressModel)
    model.config = config
    module.Qwen3XPressModel.__init__(model, vllm_config=SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=8)), prefix="model")
    head = model.xpress_head
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(float("nan"))
    model._build_fused_kv_buffers = lambda: None
    causal_lm = SimpleNamespace(model=model, backbone=[], unplaced=[], written=set())
    module.AutoWeightsLoader = StrictHeadLoader
    module.process_eagle_weight = lambda *a, **k: None
    tensors = load_file(str(export / "model.safetensors"))
    module.Qwen3XPressForCausalLM.load_weights(causal_lm, iter(tensors.items()))
    # mix_L is not loaded but folded from the raw mixer (``fold_from_raw_``).
    params = {n for n, _ in head.named_parameters()} - {"mix_L"}
    load = {"tensors": len(tensors), "head_written": sorted(causal_lm.written), "unplaced": causal_lm.unplaced,
            "head_unwritten": sorted(params - causal_lm.written), "backbone_tensors": len(causal_lm.backbone),
            "nan_left": [n for n, p in head.named_parameters() if torch.isnan(p).any()]}
    return head, config, load


def engine_drafts(head, config, hidden: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``jacobi_refine_greedy``'s drafts ``[N, B-1]`` through the head's unfused methods, as
    ``XPressSpeculator._jacobi_refine`` calls it: ``tok_am1`` is the anchor, and
    ``xpress_num_passes`` rounds (default 6)."""
    passes = int(getattr(config, "xpress_num_passes", 6))
    hcache = head.hidden_cache(hidden)
    blk = torch.cat([anchor[:, None], base[:, 1:].argmax(-1)], dim=1)
    for _ in range(passes):
        prev = torch.cat([anchor[:, None], blk[:, :-1]], dim=1)
        bias = head.refine_bias(prev, hcache)
        blk = torch.cat([anchor[:, None], (base[:, 1:] + bias[:, 1:]).argmax(-1)], dim=1)
    return blk[:, 1:]


def check(export: Path, wheel: Path = WHEEL, blocks: int = 64, seed: int = 0) -> dict:
    """vLLM 0.33's head against the export's own drafter on ``blocks`` random blocks."""
    from dflash_actors.models.drafter import DFlashDrafter
    from dflash_actors.models.xpress import jacobi

    module = vllm_xpress(wheel)
    head, config, load = engine_head(module, export)
    ours = DFlashDrafter.from_pretrained(export).eval()
    g = torch.Generator().manual_seed(seed)
    B, H, V = ours.block_size, ours.config.hidden_size, ours.config.vocab_size
    hidden = torch.randn(blocks, B, H, generator=g)
    base = 3 * torch.randn(blocks, B, V, generator=g)          # the frozen head's logits, drawn
    anchor = torch.randint(0, V, (blocks,), generator=g)
    with torch.no_grad():
        prev = torch.cat([anchor[:, None], torch.randint(0, V, (blocks, B - 1), generator=g)], dim=1)
        theirs_bias = head.refine_bias(prev, head.hidden_cache(hidden))
        refiner = ours.refiner_head
        our_bias = refiner.bias(refiner.state(prev, refiner.hidden_cache(hidden)))
        theirs = engine_drafts(head, config, hidden, base, anchor)
        mine = jacobi(refiner, hidden, base[:, 1:], anchor, anchor, int(config.num_jacobi_passes))
        backbone_only = base[:, 1:].argmax(-1)
        # Controls, each must differ: slot 0 after another token than the anchor (what
        # training feeds it, tok[a-1]), and the export under speculators' names.
        other = (anchor + 1) % V
        before_differs = not torch.equal(jacobi(refiner, hidden, base[:, 1:], other, anchor,
                                                int(config.num_jacobi_passes)), theirs)
    rel = float((theirs_bias - our_bias).abs().max() / our_bias.abs().max())
    with tempfile.TemporaryDirectory(prefix="engine-xpress-names-") as tmp:     # never beside the user's export
        renamed = Path(tmp)
        (renamed / "config.json").write_bytes((export / "config.json").read_bytes())
        save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(renamed / "model.safetensors"))
        try:
            _, _, old = engine_head(module, renamed)
            refused = f"loaded, {len(old['head_unwritten'])} head parameters unwritten" if old["head_unwritten"] else ""
        except ValueError as e:     # vLLM's own load_weights refuses a checkpoint without xpress_head.mix.L
            refused = f"vLLM refused: {e}"
    controls = {"slot0_after_another_token_drafts_otherwise": before_differs,
                "speculators_names": refused or "loaded whole (the check cannot tell names apart)"}
    ok = (not load["unplaced"] and not load["head_unwritten"] and not load["nan_left"] and rel < 1e-5
          and torch.equal(theirs, mine) and before_differs and bool(refused))
    return {"bench": "engine_xpress", "engine": "vllm 0.33.0 qwen3_xpress.py (unmodified, rest of vllm stubbed)",
            "wheel_sha256": WHEEL_SHA256, "export": str(export), **load,
            "built": {"block_size": head.block_size, "rank": head.rank, "mlp_hidden": head.mlp_gate.out_features,
                      "topc": head.topc, "passes": int(getattr(config, "xpress_num_passes", 6))},
            "bias_max_rel_diff": rel, "blocks": blocks, "drafts_equal": bool(torch.equal(theirs, mine)),
            "drafts_moved_by_refiner": int((theirs != backbone_only).any(-1).sum()), "controls": controls,
            "ok": bool(ok)}


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("export", nargs="?", help="an XPress export (checkpoints/step-*); default: a tiny one drawn here")
    ap.add_argument("--wheel", default=str(WHEEL))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="engine-xpress-") as tmp:
        export = Path(args.export) if args.export else tiny_export(Path(tmp))
        try:
            out = check(export, Path(args.wheel))
        except Unavailable as e:
            harness.skipped("engine_xpress", str(e), args.save)
            return 0
        harness.emit(out, args.save)
    return 0 if out["ok"] else 1


def tiny_export(root: Path) -> Path:
    """A small XPress drafter with every weight drawn (the refiner at a scale that moves
    argmaxes, the mixer off zero), saved as training exports it."""
    from benchmarks.parity_inputs import draw_drafter
    from benchmarks.parity_xpress import tiny_config
    from dflash_actors.models.drafter import DFlashDrafter

    drafter = draw_drafter(DFlashDrafter(tiny_config()), torch.Generator().manual_seed(0), "refiner_head.", 0.3)
    return drafter.save_pretrained(root / "xpress")


if __name__ == "__main__":
    sys.exit(main())
