"""XPress's addition to the DFlash drafter: a causal refiner head that biases each slot's
logits from the token before it, its Jacobi decoding, and its objective
(``drafter.arch: xpress``).

What is computed (XPress, arXiv 2608.02438; speculators 0.9.0's ``models/xpress`` is the
reference for each fact, the file named beside it):

* **Backbone and labels**: DFlash's, unchanged (``label_shift`` 0): block ``[tok[a],
  MASK x (B-1)]``, slot k >= 1 predicts ``tok[a+k]``, slot 0 proposes nothing
  (``config.py``: ``sample_from_anchor`` False is the released checkpoints' layout).
* **Refiner** (``model_definitions.py`` ``XPressRefinerHead``), all in a rank-r space:
  per block, the pass-invariant ``[down_h(h_k) ; down_g(g)]`` with ``g`` the mean of the
  block's B drafter states; per pass ``x = in_proj([down_h(h_k) ; down_g(g) ;
  token_embed(prev_k)])`` (3r -> r), the learned lower-triangular mixer ``x_k += sum_{j<=k}
  mix_l[:, k, j] * x_j`` (``mix_l`` ``[r, B, B]``, zero at the start, so the head starts
  mixing nothing), a residual SwiGLU ``r -> ratio*r -> r``, and ``readout`` r -> V, added
  to the frozen head's logits. Linears and the token table start at N(0, 0.02).
* **Previous tokens** (``core.py`` ``forward``): slot k's is ``tok[a+k-1]``; slot 0's is
  ``tok[a-1]`` (the anchor itself at a sequence's first position). Teacher-forced, they
  are the data's; in a free-running (Jacobi) round, slot 1's is the anchor and slot k's
  (k >= 2) the previous round's argmax at slot k-1, the first round seeded by the
  backbone's own argmax. Rounds see each other only through argmax (stop-gradient).
* **Objective** (``metrics.py`` ``compute_metrics``, ``losses/utils.py`` and ``eager.py``):
  ``T(teacher-forced) + consistency_weight * mean_j T(round j) + base_anchor_weight *
  T(backbone logits)``, each ``T = ce_alpha * CE + tv_alpha * TV`` per slot, weighed by
  ``exp(-(k-1)/gamma)`` (slot 0 nothing). CE is against the target's argmax (or the data's
  token, ``xpress_ce_labels: data``, speculators' ``ce_from_data``); ``TV = 1 - sum_v
  min(p_draft, p_target)`` in fp32. ``p_target`` comes from the target's last-layer state
  that ``train.loss: distill`` puts into the features. speculators divides by the count of
  supervised slots, this project by the sum of their weights (as every other arch here):
  the numerator is the same, and ``benchmarks/parity_xpress.py`` compares it so.
* **Decoding** (``config.py`` ``num_jacobi_passes``, 6): the backbone's argmax, then K
  free-running rounds as above; the last round's argmax is the block's draft. Training's
  tau counts the teacher-forced pass's leading correct slots: while every earlier draft is
  right its previous tokens are the drafts', so that is the left-to-right walk's tau, which
  K >= B-1 rounds reach (``metrics.py`` scores the same pass's argmax).

The module's names are speculators' (``refiner_head.token_embed``, ``down_h``, ``down_g``,
``in_proj``, ``mix_l``, ``mlp_gate``, ``mlp_up``, ``mlp_down``, ``readout``) and its config
keys ``XPressSpeculatorConfig``'s (``XPRESS_KEYS``). The export writes what vLLM 0.33's
``qwen3_xpress.Qwen3XPressForCausalLM`` loads (``ENGINE_NAMES``, ``engine_fields``): the
refiner under ``xpress_head.`` with its own names (``w1``, ``mix.L``, ``mlp.gate_proj``, ...,
``w2``) and ``xpress_mlp_hidden``, ``xpress_num_passes``, ``xpress_block_size``,
``xpress_topc`` beside speculators' keys; either naming loads back.

Slot 0's previous token when decoding is the anchor itself, not ``tok[a-1]``: vLLM 0.33's
``XPressSpeculator`` has no id buffer holding the token before the anchor and passes the
anchor in its place. Slot 0 is never scored, but its state reaches the draft slots through
the mixer's column 0, so decoding here does the same, and tau counts what that engine
drafts. Training keeps speculators' ``tok[a-1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .marks import keep_off_muon

XPRESS_KEYS = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")
"""Config keys of an XPress drafter (speculators' ``XPressSpeculatorConfig`` fields)."""

XPRESS_DEFAULTS = {"xpress_mlp_ratio": 2, "num_jacobi_passes": 6}
"""What speculators' config assumes when a key is absent (``xpress_rank`` marks an XPress)."""

XPRESS_ARCH = "Qwen3XPressModel"
"""The architecture vLLM 0.33 registers for a Qwen3-backbone XPress drafter."""

ENGINE_PREFIX = "xpress_head."
ENGINE_NAMES = {"token_embed.weight": "w1.weight", "down_h.weight": "down_h.weight",
                "down_g.weight": "down_g.weight", "in_proj.weight": "in_proj.weight", "mix_l": "mix.L",
                "mlp_gate.weight": "mlp.gate_proj.weight", "mlp_up.weight": "mlp.up_proj.weight",
                "mlp_down.weight": "mlp.down_proj.weight", "readout.weight": "w2.weight"}
"""``refiner_head.<ours>`` -> ``xpress_head.<vLLM 0.33's>``: the names its ``load_weights``
maps (``XPressRefinerHead.HYBRID_KEY_MAP``). ``mix.L`` is the raw mixer, as trained (vLLM
folds ``L * tril + I`` itself after loading)."""

ENGINE_TOPC = 0
"""Exported as ``xpress_topc``. vLLM 0.33 scores each Jacobi pass on the backbone's top 512
tokens by default, which can draft otherwise than the exact rule trained and measured here;
0 keeps its exact full-vocabulary scoring (512 is faster on large vocabularies)."""

DEFAULT_GAMMA = 4.0
"""speculators' ``dflash_decay_gamma`` default for XPress, whatever the block."""

ROWS_PER_CHUNK = 1024
"""Rows whose ``[rows, vocab]`` logits (every pass's, and the teacher's) exist at once."""


def is_xpress(config) -> bool:
    return getattr(config, "xpress_rank", None) is not None


def xpress_sizes(config) -> dict:
    """The ``XPRESS_KEYS`` of an XPress config: speculators' keys, else vLLM 0.33's
    (``xpress_mlp_hidden`` over the rank, ``xpress_num_passes``), else speculators'
    defaults. ValueError where the two namings disagree."""
    got = {k: getattr(config, k, None) for k in XPRESS_KEYS}
    r, hidden, passes = got["xpress_rank"], getattr(config, "xpress_mlp_hidden", None), \
        getattr(config, "xpress_num_passes", None)
    engine = {"xpress_mlp_ratio": None if hidden is None or r is None else int(hidden) / int(r),
              "num_jacobi_passes": passes}
    for k, v in engine.items():
        if v is not None and got[k] is not None and float(got[k]) != float(v):
            raise ValueError(f"config.json: {k} {got[k]} and vLLM's "
                             f"{'xpress_mlp_hidden / xpress_rank' if k == 'xpress_mlp_ratio' else 'xpress_num_passes'}"
                             f" {v:g} disagree")
        if v is not None and got[k] is None:
            if v != int(v) or v < 1:
                raise ValueError(f"config.json: xpress_mlp_hidden {hidden} is not a multiple of xpress_rank {r}")
            got[k] = int(v)
    block = getattr(config, "xpress_block_size", None)
    if block is not None and int(block) != int(getattr(config, "block_size", block)):
        raise ValueError(f"config.json: xpress_block_size {block} and block_size {config.block_size} disagree")
    return {k: int(XPRESS_DEFAULTS[k] if v is None else v) for k, v in got.items()}


def engine_fields(sizes: dict, block_size: int) -> dict:
    """What vLLM 0.33's ``Qwen3XPressModel`` and ``XPressSpeculator`` read from config.json,
    besides ``xpress_rank`` (their defaults are 512, 6, ``num_speculative_tokens + 1`` and 512)."""
    return {"xpress_mlp_hidden": sizes["xpress_rank"] * sizes["xpress_mlp_ratio"],
            "xpress_num_passes": sizes["num_jacobi_passes"], "xpress_block_size": int(block_size),
            "xpress_topc": ENGINE_TOPC}


ENGINE_KEYS = ("xpress_mlp_hidden", "xpress_num_passes", "xpress_block_size", "xpress_topc")


def settle_engine_keys(config) -> None:
    """A read config's sizes as speculators' keys only (``xpress_sizes``: refused where vLLM's
    disagree), vLLM's dropped: the drafter keeps one naming, the export writes both."""
    sizes = xpress_sizes(config)
    for k, v in sizes.items():
        setattr(config, k, v)
    for k in ENGINE_KEYS:
        if hasattr(config, k):
            delattr(config, k)


def to_engine_names(state: dict) -> dict:
    """A drafter's state dict with the refiner under vLLM 0.33's names."""
    mine = "refiner_head."
    return {(ENGINE_PREFIX + ENGINE_NAMES[k[len(mine):]] if k.startswith(mine) else k): v for k, v in state.items()}


def from_engine_names(state: dict) -> dict:
    """``to_engine_names`` undone; speculators' names (``refiner_head.*``) pass unchanged."""
    back = {v: k for k, v in ENGINE_NAMES.items()}
    return {("refiner_head." + back.get(k[len(ENGINE_PREFIX):], k[len(ENGINE_PREFIX):])
             if k.startswith(ENGINE_PREFIX) else k): v for k, v in state.items()}


def xpress_fields(drafter_cfg) -> dict | None:
    """The config additions of ``drafter.arch: xpress`` (None otherwise)."""
    if drafter_cfg.arch != "xpress":
        return None
    return {"xpress_rank": int(drafter_cfg.xpress_rank), "xpress_mlp_ratio": int(drafter_cfg.xpress_mlp_ratio),
            "num_jacobi_passes": int(drafter_cfg.xpress_jacobi_passes)}


class RefinerHead(nn.Module):
    """The refiner, split as its passes use it: ``hidden_cache`` once per block, ``state``
    once per pass (cheap, rank r), ``bias`` where a pass's logits are needed."""

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, rank: int, mlp_ratio: int):
        super().__init__()
        if rank < 1 or mlp_ratio < 1:
            raise ValueError(f"drafter.xpress_rank and xpress_mlp_ratio: must be >= 1 (got {rank}, {mlp_ratio})")
        r = rank
        self.token_embed = nn.Embedding(vocab_size, r)
        self.down_h = nn.Linear(hidden_size, r, bias=False)
        self.down_g = nn.Linear(hidden_size, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, block_size, block_size))
        self.mlp_gate = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(r * mlp_ratio, r, bias=False)
        self.readout = nn.Linear(r, vocab_size, bias=False)
        self._mark()

    def _mark(self) -> None:
        # A token table and a vocabulary output: AdamW's, as the frozen head's and the
        # embeddings are (speculators' name rule would give both to Muon; ours reads tables).
        keep_off_muon(self.token_embed.weight, self.readout.weight)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)      # to_empty from meta makes new parameters
        self._mark()
        return out

    def hidden_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., B, 2r]``: ``[down_h(h_k) ; down_g(mean of the block)]`` of drafter states ``[..., B, H]``."""
        hidden = hidden.to(self.down_h.weight.dtype)
        g = hidden.mean(dim=-2, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(g)], dim=-1)

    def state(self, prev: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """``[..., B, r]``: the refined state of every slot from its previous token ``prev``
        ``[..., B]`` and ``hidden_cache``. Slot k reads slots ``<= k`` only (the mixer is
        lower-triangular), so a later slot's garbage never reaches an earlier one."""
        x = self.in_proj(torch.cat([cache, self.token_embed(prev.long()).to(cache.dtype)], dim=-1))
        # speculators multiplies by a 0/1 buffer; ``tril`` gives the same values and gradients
        # with no buffer, which a drafter built on the meta device (``drafter_shell``) would
        # have to recompute, as it does the rotary frequencies.
        mix = torch.tril(self.mix_l)
        x = x + torch.einsum("ckj,...jc->...kc", mix, x)
        return x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))

    def bias(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[..., V]`` added to the frozen head's logits."""
        return self.readout(x).float()


def build_refiner(config) -> RefinerHead:
    sizes = xpress_sizes(config)
    return RefinerHead(int(config.vocab_size), int(config.hidden_size), int(config.block_size),
                       sizes["xpress_rank"], sizes["xpress_mlp_ratio"])


def tf_prev(before: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced previous tokens ``[..., B]``: ``before`` ``[...]`` (``tok[a-1]``, or the
    anchor at position 0) for slot 0, then the block's own tokens ``tokens`` ``[..., B]``
    (``tok[a+k]``) shifted by one."""
    return torch.cat([before[..., None], tokens[..., :-1]], dim=-1)


def round_prev(before: torch.Tensor, anchor: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """A free-running round's previous tokens ``[..., B]`` from the last round's argmax
    ``pred`` ``[..., B]`` (its slot 0 unused): slot 1 follows the anchor, slot k the guess at k-1."""
    return torch.cat([before[..., None], anchor[..., None], pred[..., 1:-1]], dim=-1)


def _head_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(h.to(weight.dtype), weight).float()


@torch.no_grad()
def block_argmax(hidden: torch.Tensor, weight: torch.Tensor, refiner: RefinerHead,
                 x: torch.Tensor | None) -> torch.Tensor:
    """``[..., B]`` argmax of the frozen head's logits plus (with ``x``) the refiner's bias,
    at every slot of blocks ``hidden`` ``[..., B, H]``, ``ROWS_PER_CHUNK`` rows at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    xs = None if x is None else x.reshape(-1, x.shape[-1])
    out = []
    for s in range(0, len(flat), ROWS_PER_CHUNK):
        logits = _head_logits(flat[s:s + ROWS_PER_CHUNK], weight)
        if xs is not None:
            logits = logits + refiner.bias(xs[s:s + ROWS_PER_CHUNK])
        out.append(logits.argmax(-1))
    return torch.cat(out).view(hidden.shape[:-1]) if out else hidden.new_zeros(hidden.shape[:-1], dtype=torch.long)


@torch.no_grad()
def jacobi(refiner: RefinerHead, hidden: torch.Tensor, base: torch.Tensor, before: torch.Tensor,
           anchor: torch.Tensor, passes: int) -> torch.Tensor:
    """Greedy drafts ``[N, B-1]`` of ``N`` blocks: drafter states ``hidden`` ``[N, B, H]``,
    the frozen head's logits ``base`` ``[N, B-1, V]`` of slots 1..B-1, ``before`` and
    ``anchor`` ``[N]``; the backbone's argmax refined by ``passes`` free-running rounds."""
    cache = refiner.hidden_cache(hidden)
    pred = base.argmax(-1)
    for _ in range(passes):
        full = torch.cat([anchor[:, None], pred], dim=1)
        x = refiner.state(round_prev(before, anchor, full), cache)
        pred = (base.float() + refiner.bias(x[:, 1:])).argmax(-1)
    return pred


# ---------------------------------------------------------------------------
# the objective


@dataclass(frozen=True)
class XPressObjective:
    """speculators' XPress defaults: ``{"ce": 0.1, "tv": 0.9}``, 3 rounds at 0.3, anchor 0.6."""

    ce_alpha: float = 0.1
    tv_alpha: float = 0.9
    consistency_weight: float = 0.3
    consistency_passes: int = 3
    base_anchor_weight: float = 0.6
    ce_labels: str = "target"

    @property
    def needs_teacher(self) -> bool:
        return self.tv_alpha > 0 or (self.ce_alpha > 0 and self.ce_labels == "target")

    @property
    def rounds(self) -> int:
        return self.consistency_passes if self.consistency_weight > 0 else 0

    @classmethod
    def from_config(cls, cfg) -> "XPressObjective | None":
        d = cfg.drafter
        if d.arch != "xpress":
            return None
        return cls(d.xpress_ce_alpha, d.xpress_tv_alpha, d.xpress_consistency_weight, d.xpress_consistency_passes,
                   d.xpress_base_anchor_weight, d.xpress_ce_labels)


def _terms(logits, labels, target_p, o: XPressObjective):
    """``ce_alpha * CE + tv_alpha * TV`` per row (fp32)."""
    out = o.ce_alpha * F.cross_entropy(logits, labels, reduction="none") if o.ce_alpha else 0.0
    if o.tv_alpha:
        p = logits.softmax(-1)
        out = out + o.tv_alpha * (1.0 - torch.minimum(p, target_p).sum(-1))
    return out


def _chunk(h, xs, weight, readout, data, teacher, o: XPressObjective):
    base = _head_logits(h, weight)
    target_p, labels = None, data
    if teacher is not None:
        with torch.no_grad():
            t = _head_logits(teacher, weight)
            target_p = t.softmax(-1)
            if o.ce_labels == "target":
                labels = t.argmax(-1)
    tf = base + F.linear(xs[0], readout).float()
    total = _terms(tf, labels, target_p, o)
    for x in xs[1:]:
        total = total + (o.consistency_weight / (len(xs) - 1)) * _terms(base + F.linear(x, readout).float(),
                                                                        labels, target_p, o)
    if o.base_anchor_weight:
        total = total + o.base_anchor_weight * _terms(base, labels, target_p, o)
    hard = F.cross_entropy(tf.detach(), data, reduction="none")
    return total, hard, tf.detach().argmax(-1)


@dataclass
class XPressRows:
    numerator: torch.Tensor   # sum over supervised slots of w * (T(tf) + cw * mean T(rounds) + baw * T(base))
    hard: torch.Tensor        # [n] teacher-forced refined CE against the data's token, detached
    pred: torch.Tensor        # [n] teacher-forced refined argmax


def xpress_rows(refiner: RefinerHead, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                before: torch.Tensor, rows, teacher: torch.Tensor | None, w: torch.Tensor,
                objective: XPressObjective | None) -> XPressRows:
    """XPress's objective over blocks ``hidden`` ``[..., B, H]`` (drafter states of every
    slot) whose tokens are ``tokens`` ``[..., B]`` (``tok[a+k]``; past a sequence's end,
    anything) and ``before`` ``[...]`` (``tok[a-1]``), supervised at ``rows`` (index tuple
    into ``[..., B]``, slot 0 never) with weights ``w``; ``teacher``: the target's
    last-layer states ``[n, H]`` of those rows (None: no target distribution). Every
    pass's refined state is computed for whole blocks (the mixer and the block mean need
    them); logits only ``ROWS_PER_CHUNK`` supervised rows at a time, recomputed in the
    backward, besides the no-grad argmax over whole blocks that seeds each round."""
    o = objective or XPressObjective()
    if o.needs_teacher and teacher is None:
        raise ValueError("drafter.arch: xpress's TV term and target-argmax CE need the target's distribution "
                         "(train.loss: distill), or set drafter.xpress_tv_alpha 0 and xpress_ce_labels data")
    cache = refiner.hidden_cache(hidden)
    anchor = tokens[..., 0]
    xs = [refiner.state(tf_prev(before, tokens), cache)]
    if o.rounds:
        pred = block_argmax(hidden, weight, refiner, None)
        for j in range(o.rounds):
            xs.append(refiner.state(round_prev(before, anchor, pred), cache))
            if j + 1 < o.rounds:
                pred = block_argmax(hidden, weight, refiner, xs[-1].detach())
    h_rows = hidden[rows]
    x_rows = [x[rows] for x in xs]
    data = tokens[rows]
    readout = refiner.readout.weight
    parts = []
    for s in range(0, len(h_rows), ROWS_PER_CHUNK):
        sl = slice(s, s + ROWS_PER_CHUNK)
        args = (h_rows[sl], [x[sl] for x in x_rows], weight, readout, data[sl],
                None if teacher is None else teacher[sl], o)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args))
    if parts:
        total, hard, pred_tf = (torch.cat(x) for x in zip(*parts))
    else:
        total = hard = h_rows.new_zeros(0, dtype=torch.float32)
        pred_tf = data.new_zeros(0)
    numerator = (total * w).sum()
    if torch.is_grad_enabled():
        # Every parameter gets a gradient, a zero one if unused: every process reduces every one.
        numerator = numerator + sum(p.sum() for p in refiner.parameters()) * 0.0
    return XPressRows(numerator, hard.detach(), pred_tf)
