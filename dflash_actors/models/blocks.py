"""The block layout of DFlash training and evaluation: which positions anchor a block
(seeded, so any process draws the same), what each block position sees, the drafter's
forward over a batch's blocks (right-padded per sequence; a dense mask for sdpa on CPU, a
flex ``BlockMask`` on CUDA, ``attention_as`` for a trace), and each slot's label.

The visibility rule, keyed by anchor position: block j sees context positions ``< a_j``
of its own sequence and its own block in both directions; never another block, another
sequence, or anything ``>= a_j``. In a ``sliding_attention`` layer of window W, the slot
at position ``a_j + k`` sees only the context positions c with ``a_j + k - c < W``
(``drafter.sliding_window``; its whole block still, as W >= the block size). The
objective over these blocks is ``loss``'s; the evaluation (``eval.tau``) walks the same
blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import numpy as np
import torch

from .drafter import sdpa_dense


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions a with ``m[a] = m[a+1] = 1`` (so slot 1 is always supervised)."""
    m = np.asarray(loss_mask).astype(bool)
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator) -> np.ndarray:
    cand = anchor_candidates(loss_mask)
    if len(cand) > num_anchors:
        cand = np.sort(rng.choice(cand, num_anchors, replace=False))
    return cand


def batch_anchors(batch, num_anchors: int, seed: int, epoch: int, batch_id: int) -> list[np.ndarray]:
    """Anchors of every sample row of a batch, seeded by ``(seed, epoch, batch_id, row)``."""
    mask = batch.loss_mask.cpu().numpy()
    return [sample_anchors(mask[s:e], num_anchors, np.random.default_rng([seed, epoch, batch_id, r]))
            for r, (s, e) in enumerate(batch.sequences())]


def all_anchors(batch) -> list[np.ndarray]:
    """Every candidate anchor of every row (held-out evaluation)."""
    mask = batch.loss_mask.cpu().numpy()
    return [anchor_candidates(mask[s:e]) for s, e in batch.sequences()]


def visible(row, q, kv, anchors: torch.Tensor, lengths: torch.Tensor, ctx_len, block_size: int,
            window: int | None = None):
    """Whether query ``q`` of row ``row`` sees key ``kv`` (broadcasting index tensors).

    Keys ``< ctx_len`` are the row's context, the rest its blocks of ``block_size``
    queries. Block j sees context ``< anchors[row, j]`` inside the row's real length, and
    its own block; with a ``window``, query slot k (at position ``a_j + k``) only the
    context within ``window`` of it. Both the dense mask and flex's ``mask_mod`` are this
    function.
    """
    j = q // block_size
    anchor = anchors[row, j]
    context = (kv < anchor) & (kv < lengths[row])
    if window is not None:
        context = context & (anchor + q % block_size - kv < window)
    own_block = (kv >= ctx_len) & ((kv - ctx_len) // block_size == j)
    return context | own_block


def block_mask_dense(anchors: torch.Tensor, lengths: torch.Tensor, ctx_len: int, block_size: int,
                     window: int | None = None) -> torch.Tensor:
    """Boolean ``[R, 1, N*B, C+N*B]`` for anchors ``[R, N]`` and row lengths ``[R]``."""
    R, n = anchors.shape
    dev = anchors.device
    row = torch.arange(R, device=dev)[:, None, None]
    q = torch.arange(n * block_size, device=dev)[None, :, None]
    kv = torch.arange(ctx_len + n * block_size, device=dev)[None, None, :]
    return visible(row, q, kv, anchors, lengths, ctx_len, block_size, window)[:, None]


def flex_block_mask(anchors: torch.Tensor, lengths: torch.Tensor, ctx_len: int, block_size: int,
                    window: int | None = None):
    """The same rule as a flex ``BlockMask`` (batch R, shared by every head)."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, n = anchors.shape

    def mask_mod(b, h, q, kv):
        return visible(b, q, kv, anchors, lengths, ctx_len, block_size, window)

    # Uncompiled, create_block_mask evaluates the rule on the whole [R, Q, KV] grid at
    # once: gigabytes at real sizes (30 rows of 8k queries by 10k keys). Compiled on
    # CUDA it works tile by tile. (On CPU, where only tests build one, eager is quicker.)
    return create_block_mask(mask_mod, B=R, H=None, Q_LEN=n * block_size, KV_LEN=ctx_len + n * block_size,
                             device=anchors.device, _compile=anchors.device.type == "cuda")


@functools.cache
def _compiled_flex():
    # Uncompiled flex_attention materialises the full score matrix; compiled it is block-sparse.
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=True)


def flex_attend(block_mask, flex):
    """An ``attend`` that calls ``flex`` (flex_attention, compiled or not) with ``block_mask``.

    Autocast does not cover flex_attention as it covers sdpa, and under it the drafter
    hands over mixed dtypes (the RMSNorms return fp32 queries and keys, the value
    projection bf16), which flex refuses: all three go to autocast's dtype, or to the
    queries' dtype without autocast."""
    def attend(q, k, v):
        dev = q.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
        q, k, v = (t.to(dtype) for t in (q, k, v))
        return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return attend


_ATTEND_AS = contextvars.ContextVar("attend_as", default=None)


@contextlib.contextmanager
def attention_as(factory):
    """Inside, ``make_attend`` is ``factory``: how the memory plan runs CUDA's attention
    on the CPU, where flex cannot run backward (``train.memtrace``)."""
    token = _ATTEND_AS.set(factory)
    try:
        yield
    finally:
        _ATTEND_AS.reset(token)


def make_attend(anchors: torch.Tensor, lengths: torch.Tensor, ctx_len: int, block_size: int,
                window: int | None = None):
    """flex_attention on CUDA (block-sparse, no dense mask), dense sdpa mask elsewhere."""
    factory = _ATTEND_AS.get()
    if factory is not None:
        return factory(anchors, lengths, ctx_len, block_size, window)
    if anchors.device.type == "cuda":
        return flex_attend(flex_block_mask(anchors, lengths, ctx_len, block_size, window), _compiled_flex())
    return sdpa_dense(block_mask_dense(anchors, lengths, ctx_len, block_size, window))


def make_attends(drafter, anchors: torch.Tensor, lengths: torch.Tensor, ctx_len: int, block_size: int) -> dict:
    """``make_attend`` for each window among the drafter's layers (None: full attention):
    one mask per distinct window, shared by the layers that have it."""
    return {w: make_attend(anchors, lengths, ctx_len, block_size, w) for w in sorted(drafter.windows, key=str)}


def autocast_for(device, compute_dtype: str = "auto"):
    """The drafter forward's autocast: bf16 on CUDA unless ``compute_dtype`` is "float32";
    on CPU fp32 unless ``compute_dtype`` is "bfloat16" (CPUs with bf16 instructions,
    AVX512-BF16 or AMX, run its matmuls about twice as fast). Either way every process
    runs the same kernels, so the pipeline still equals the reference bit for bit."""
    if compute_dtype not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"compute_dtype: {compute_dtype!r} is not one of auto, bfloat16, float32")
    kind = torch.device(device).type
    if (kind == "cuda" and compute_dtype != "float32") or (kind == "cpu" and compute_dtype == "bfloat16"):
        return torch.autocast(kind, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class PaddedBlocks:
    """The sequences of a packed batch that have anchors, right-padded: row r is sequence
    ``seq[r]``; ``N`` is the most anchors of a row, ``C`` the longest row."""

    seq: list[int]
    take: torch.Tensor       # [T'] packed positions of those rows' tokens
    row: torch.Tensor        # [T'] where each of them sits in [R, C] ...
    col: torch.Tensor        # [T'] ... and at which column
    lengths: torch.Tensor    # [R]
    anchors: torch.Tensor    # [R, N] (0 past a row's own anchors)
    real: torch.Tensor       # [R, N] bool: not padding
    tokens: torch.Tensor     # [R, C] (0 past a row's length)
    loss_mask: torch.Tensor  # [R, C] (0 past a row's length)


def pad_blocks(batch, anchors: list[np.ndarray], device) -> PaddedBlocks:
    """The padded layout of ``batch`` for its anchors per sequence (at least one somewhere)."""
    seq = [r for r, a in enumerate(anchors) if len(a)]
    spans = batch.sequences()
    lengths = [spans[r][1] - spans[r][0] for r in seq]
    R, n, C = len(seq), max(len(anchors[r]) for r in seq), max(lengths)
    a_pad, real = np.zeros((R, n), np.int64), np.zeros((R, n), bool)
    for i, r in enumerate(seq):
        a_pad[i, :len(anchors[r])] = anchors[r]
        real[i, :len(anchors[r])] = True
    seq_row, col = batch.pad_index()
    row_of = torch.full((batch.n_samples,), -1, dtype=torch.long, device=seq_row.device)
    row_of[seq] = torch.arange(R, device=seq_row.device)
    row = row_of[seq_row]
    take = (row >= 0).nonzero().squeeze(1)
    take, row, col = take.to(device), row[take].to(device), col[take].to(device)
    tokens = torch.zeros((R, C), dtype=torch.long, device=device)
    tokens[row, col] = batch.input_ids.to(device)[take]
    loss_mask = torch.zeros((R, C), dtype=batch.loss_mask.dtype, device=device)
    loss_mask[row, col] = batch.loss_mask.to(device)[take]
    return PaddedBlocks(seq, take, row, col, torch.tensor(lengths, device=device),
                        torch.from_numpy(a_pad).to(device), torch.from_numpy(real).to(device), tokens, loss_mask)


def blocks_hidden(drafter, embed_tokens, ctx: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                  anchor_ids: torch.Tensor, checkpoint_layers: bool = False) -> torch.Tensor:
    """Drafter hidden states ``[R, N, B, H]`` of blocks right-padded per row: one forward.

    ``ctx`` ``[R, C, H]`` is each row's drafter context (positions past ``lengths`` are
    never seen), ``anchors`` ``[R, N]`` and ``anchor_ids`` the token at each anchor. A padding
    block, whatever its anchor, sees only itself, so its (unused) output stays finite.
    """
    B, (R, n), C = drafter.block_size, anchors.shape, ctx.shape[1]
    dev = anchors.device
    noise_ids = torch.full((R, n, B), drafter.mask_token_id, dtype=torch.long, device=dev)
    noise_ids[..., 0] = anchor_ids
    noise = embed_tokens(noise_ids).reshape(R, n * B, -1).to(ctx.dtype)
    block_pos = (anchors[..., None] + torch.arange(B, device=dev)).reshape(R, n * B)
    positions = torch.cat([torch.arange(C, device=dev).expand(R, C), block_pos], dim=1)
    out = drafter(noise, ctx, positions, make_attends(drafter, anchors, lengths, C, B), checkpoint_layers)
    return out.reshape(R, n, B, -1)


def padded_hidden(drafter, embed_tokens, features: torch.Tensor, p: PaddedBlocks,
                  checkpoint_layers: bool = False) -> torch.Tensor:
    """Drafter hidden states ``[R, N, B, H]`` of the layout ``p`` of a packed batch whose
    target features are ``features`` ``[T, k*H]``."""
    rows = features[p.take]
    if not torch.is_autocast_enabled(rows.device.type):
        # Under autocast fc casts to its compute dtype itself: bf16 features then go
        # in as they are, never through an fp32 copy of [T, k*H].
        rows = rows.to(drafter.fc.weight.dtype)
    ctx_rows = drafter.context(rows)
    ctx = ctx_rows.new_zeros((len(p.seq), p.tokens.shape[1], ctx_rows.shape[-1])).index_put((p.row, p.col), ctx_rows)
    return blocks_hidden(drafter, embed_tokens, ctx, p.lengths, p.anchors, p.tokens.gather(1, p.anchors),
                         checkpoint_layers)


def batch_hidden(drafter, embed_tokens, features: torch.Tensor, batch,
                 anchors: list[np.ndarray]) -> tuple[torch.Tensor, PaddedBlocks]:
    """``(hidden [R, N, B, H], layout)`` for the anchors of a packed batch (at least one
    somewhere); ``features`` are its packed target features ``[T, k*H]``."""
    p = pad_blocks(batch, anchors, features.device)
    return padded_hidden(drafter, embed_tokens, features, p), p


def block_hidden(drafter, embed_tokens, ctx: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Drafter hidden states ``[N, B, H]`` for the blocks at ``anchors`` of one sequence.

    ``ctx`` is the sequence's drafter context ``[L, H]`` (``drafter.context`` of its
    target features) and ``tokens`` its ids ``[L]``.
    """
    lengths = torch.tensor([len(tokens)], device=tokens.device)
    return blocks_hidden(drafter, embed_tokens, ctx[None], lengths, anchors[None], tokens[anchors][None])[0]


def teacher_rows(features: torch.Tensor, p: PaddedBlocks, rows, hidden_size: int, shift: int = 0) -> torch.Tensor:
    """The target's last-layer state ``[n, H]`` one position before each labelled block
    slot ``rows`` (indices into ``[R, N, B]``): what its logits for that slot's token come
    from. ``features`` ``[T, (k+1)*H]`` end with that state (``TargetModel(teacher=True)``).
    ``shift``: the drafter's ``label_shift`` (slot k labels ``a + k + shift``)."""
    last = features[p.take, -hidden_size:]
    padded = last.new_zeros((len(p.seq), p.tokens.shape[1], hidden_size)).index_put((p.row, p.col), last)
    r, j, k = rows
    return padded[r, p.anchors[r, j] + k - 1 + shift]   # a labelled slot's: at or after the anchor


def block_labels(tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, valid)`` ``[..., N, B]`` for tokens ``[..., L]`` and anchors ``[..., N]``:
    ``tok[a+k]``, valid where ``a+k < L`` and ``m[a+k] = 1``, slot 0 never. Right-padded
    rows must carry ``loss_mask`` 0 in their padding.

    ``shift`` 1 (a DSpark's): ``tok[a+k+1]`` from slot 0 on, valid while every slot
    before is too (the first slot outside the sequence or the mask ends the block, as
    DeepSpec supervises it)."""
    L = tokens.shape[-1]
    pos = anchors[..., None] + torch.arange(block_size, device=tokens.device) + shift
    flat = pos.clamp(max=L - 1).flatten(-2)
    valid = (pos < L) & loss_mask.gather(-1, flat).view(pos.shape).bool()
    if shift:
        valid = valid.long().cumprod(dim=-1).bool()
    else:
        valid[..., 0] = False
    return tokens.gather(-1, flat).view(pos.shape), valid
