"""Prompts written by the target itself: ``prepare --self-prompts N``, for a user who has a
model and no prompt set.

An instruction-tuned model given its chat template's text up to where a user's message
would begin (the system turn, if the template adds one, and the user turn's header)
continues it with something a user might ask, and ends that turn with its end-of-turn
token. Sampling that header many times gives a prompt set in the model's own
distribution of requests; ``prepare`` then regenerates the responses as it does for any
prompt file. This is the pre-query technique of the Magpie paper (Xu et al., 2024), and
Magpie-made sets are a common ingredient of public drafter training data.

What is kept: a sample that ended its turn within ``max_tokens`` (a cut-off one is a
fragment), at least ``min_chars`` long once stripped, holding none of the tokenizer's
special tokens (a model that wrote a whole conversation into the user turn), and not a
copy of one already kept (compared lower-cased, whitespace collapsed). Samples are drawn
in shards seeded by their number until ``count`` are kept or ``MAX_SAMPLES_PER_PROMPT``
times that many were drawn; each shard's samples are saved as it finishes, so a killed
run resumes where it stopped and ends with the same prompts an unbroken one would.

A template with no user turn (one that drops or refuses a user message) is refused with
one line: there is no header to continue.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ..runtime.files import write_atomically
from .generate import InProcessEngine, SamplingSettings

SENTINEL = "\u2063dflash-user-message\u2063"
"""Stands for the user's message while the template is rendered; the header is what comes before it."""
MAX_SAMPLES_PER_PROMPT = 4
"""Samples drawn per prompt asked for before giving up on reaching the count."""


class SelfPromptError(ValueError):
    """Bad input: one line for the user (``prepare`` exits 2)."""


@dataclass(frozen=True)
class SelfPromptSettings:
    count: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    """A sample that has not ended its turn after this many tokens is dropped."""
    min_chars: int = 8
    seed: int = 0
    dtype: str = "auto"

    def check(self) -> None:
        if self.count < 1 or self.max_tokens < 1 or self.min_chars < 0:
            raise SelfPromptError(f"--self-prompts must be >= 1 and --prompt-max-tokens >= 1 "
                                  f"(got {self.count}, {self.max_tokens})")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise SelfPromptError(f"--prompt-temperature must be > 0 (greedy would write one prompt) and "
                                  f"--top-p in (0, 1] (got {self.temperature}, {self.top_p})")


def user_turn_header(tokenizer, system_prompt: str | None = None, enable_thinking: bool = False) -> str:
    """The chat template's text before a user's first message: what the model continues."""
    messages = [{"role": "user", "content": SENTINEL}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             enable_thinking=enable_thinking)
    except Exception as e:      # jinja's TemplateError, or a template's own raise_exception
        raise SelfPromptError(f"--self-prompts: the chat template refuses a user message "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if SENTINEL not in text:
        raise SelfPromptError("--self-prompts: the chat template has no user turn (a user's message leaves no "
                              "trace in its text); give --prompts instead")
    header = text[:text.index(SENTINEL)]
    if not header.strip():
        raise SelfPromptError("--self-prompts: the chat template puts nothing before a user's message, so "
                              "there is no turn header to continue; give --prompts instead")
    return header


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


class Kept:
    """The prompts kept so far, and why the others were not."""

    def __init__(self, count: int, min_chars: int, specials: list[str]):
        self.count, self.min_chars, self.specials = count, min_chars, [s for s in specials if s]
        self.prompts: list[str] = []
        self.seen: set[str] = set()
        self.dropped = {"unfinished": 0, "short": 0, "special_tokens": 0, "duplicate": 0}
        self.sampled = 0

    @property
    def full(self) -> bool:
        return len(self.prompts) >= self.count

    def offer(self, text: str | None) -> None:
        """One sample, kept or counted as dropped; none once ``full``."""
        if self.full:
            return
        self.sampled += 1
        if text is None:
            self.dropped["unfinished"] += 1
            return
        text = text.strip()
        if len(text) < self.min_chars:
            self.dropped["short"] += 1
        elif any(s in text for s in self.specials):
            self.dropped["special_tokens"] += 1
        elif normalized(text) in self.seen:
            self.dropped["duplicate"] += 1
        else:
            self.seen.add(normalized(text))
            self.prompts.append(text)


def write_self_prompts(target_dir: Path, tokenizer, out: Path, settings: SelfPromptSettings, *,
                       system_prompt: str | None = None, enable_thinking: bool = False, batch_size: int = 16,
                       shard_size: int = 64, device: str = "auto", bar=None) -> dict:
    """Sample ``settings.count`` distinct prompts from the target into ``out`` (JSONL, one
    user message per line); what was sampled and dropped, for ``prepare.json``. An
    ``out`` already written is read back, not sampled again."""
    settings.check()
    header = user_turn_header(tokenizer, system_prompt, enable_thinking)
    record = {"kind": "self", "header": header, **asdict(settings), "shard_size": shard_size,
              "target_dir": str(target_dir)}
    done = out.with_name(out.name + ".json")
    if out.is_file() and done.is_file() and _same(json.loads(done.read_text()), record):
        return json.loads(done.read_text())
    ids = tokenizer(header, add_special_tokens=False)["input_ids"]
    sampling = SamplingSettings(settings.temperature, settings.top_p, settings.max_tokens, settings.seed,
                                settings.dtype)
    partial = out.with_name(out.name + ".partial")
    _start(partial, record)
    specials = list(getattr(tokenizer, "all_special_tokens", []))
    kept, engine = Kept(settings.count, settings.min_chars, specials), None
    shards = math.ceil(settings.count * MAX_SAMPLES_PER_PROMPT / shard_size)
    for s in range(shards):
        path = partial / f"shard-{s:05d}.json"
        if not path.is_file():
            if engine is None:
                engine = InProcessEngine(target_dir, tokenizer, sampling, batch_size, device, None)
            _, seqs, masks = engine.shard([ids] * shard_size, range(shard_size), s)
            texts = [_finished_text(tokenizer, seq[mask == 1].tolist(), engine.stops) for seq, mask in zip(seqs, masks)]
            write_atomically(path, lambda p, texts=texts: p.write_text(json.dumps(texts)))
        for text in json.loads(path.read_text()):
            kept.offer(text)
        if bar is not None:
            bar.update(len(kept.prompts) - bar.n)
        if kept.full:
            break
    if not kept.prompts:
        raise SelfPromptError(f"--self-prompts: none of {kept.sampled} samples was kept ({kept.dropped}); "
                              f"is the target instruction-tuned?")
    lines = "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in kept.prompts)
    write_atomically(out, lambda p: p.write_text(lines, encoding="utf-8"))
    stats = {**record, "sampled": kept.sampled, "kept": len(kept.prompts), "dropped": kept.dropped,
             "prompts_sha": hashlib.sha256(lines.encode()).hexdigest()[:16]}
    write_atomically(done, lambda p: p.write_text(json.dumps(stats, indent=1)))
    shutil.rmtree(partial)
    return stats


def _finished_text(tokenizer, generated: list[int], stops: list[int]) -> str | None:
    """The user message a sample wrote, or None when it did not end its turn."""
    if not generated or generated[-1] not in stops:
        return None
    return tokenizer.decode(generated[:-1], skip_special_tokens=False)


def _same(stats: dict, record: dict) -> bool:
    return all(stats.get(k) == v for k, v in record.items())


def _start(partial: Path, record: dict) -> None:
    """``partial`` for these settings; refused if a run of other settings started it."""
    manifest = partial / "manifest.json"
    if manifest.is_file():
        old = json.loads(manifest.read_text())
        diff = next((k for k in record if old.get(k) != record[k]), None)
        if diff is not None:
            raise SelfPromptError(f"--self-prompts: {partial} was started with a different {diff} "
                                  f"({old.get(diff)!r} vs {record[diff]!r}); remove it or rerun with the same "
                                  f"settings")
    partial.mkdir(parents=True, exist_ok=True)
    if not manifest.is_file():
        write_atomically(manifest, lambda p: p.write_text(json.dumps(record, indent=1)))
