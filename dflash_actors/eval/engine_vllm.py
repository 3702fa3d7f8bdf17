"""Greedy decoding in vLLM, with or without a drafter: the engine side of ``serve-check``.

Runs as a script inside vLLM's own environment (``python engine_vllm.py JOB.json OUT.json``),
which pins its own torch and need not have this package: it imports the standard library
and vLLM only. ``serve.py`` writes the job and reads the result.

The job: ``target``, ``drafter`` (or null for plain decoding), ``k`` (speculative tokens
after the bonus token), ``prompts`` (lists of token ids), ``max_new_tokens``, ``stop_ids``,
``threads``. The result: each prompt's output ids and, with a drafter, its acceptance
counters (differences of vLLM's cumulative ``spec_decode`` counters around a one-prompt
``generate``); tokens/s one request at a time and all prompts batched; the batched
outputs, so that batching's own losslessness is checked too.

``--probe`` prints ``{"version", "device"}`` and exits: what an arch check needs, without
starting an engine.
"""

import json
import os
import sys
import time
from itertools import zip_longest

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters, summed over their label sets."""
    out = {name: 0 for name in COUNTERS.values()}
    out["per_position"] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            out["per_position"] = [a + int(b) for a, b in zip_longest(out["per_position"], m.values, fillvalue=0)]
    return out


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in COUNTERS.values()}
    d["per_position"] = [a - b for a, b in zip_longest(after["per_position"], before["per_position"], fillvalue=0)]
    return d


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=job["target"], dtype="float32", enforce_eager=True, disable_log_stats=False,
                  kv_cache_memory_bytes=int(job.get("kv_cache_bytes", 1 << 30)), seed=0,
                  skip_tokenizer_init=not job.get("tokenizer", True), max_model_len=int(job["max_model_len"]))
    if job.get("drafter"):
        kwargs["speculative_config"] = {"method": "dflash", "model": job["drafter"],
                                        "num_speculative_tokens": int(job["k"])}
    t = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t
    # Greedy, stopped as the project stops: at max_new_tokens or after a stop id.
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_new_tokens"]), ignore_eos=True,
                            stop_token_ids=list(job["stop_ids"]), detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)       # warm-up: first-call costs out of the timings

    per_prompt, outputs, one_s, tokens = [], [], 0.0, 0
    for p in prompts:
        before = spec_counters(llm)
        t = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        one_s += time.perf_counter() - t
        ids = list(out.token_ids)
        outputs.append(ids)
        tokens += len(ids)
        per_prompt.append(delta(spec_counters(llm), before))
    t = time.perf_counter()
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    batch_s = time.perf_counter() - t
    return {"engine": "vllm", "load_s": round(load_s, 1), "outputs": outputs, "per_prompt": per_prompt,
            "one_at_a_time": {"tokens": tokens, "s": round(one_s, 3), "tokens_per_s": round(tokens / one_s, 2)},
            "batched": {"tokens": sum(map(len, batched)), "s": round(batch_s, 3),
                        "tokens_per_s": round(sum(map(len, batched)) / batch_s, 2)},
            "batched_outputs": batched}


def probe() -> dict:
    import vllm
    from vllm.platforms import current_platform
    return {"version": vllm.__version__, "device": str(current_platform.device_type)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        print(json.dumps(probe()))
        return 0
    job = json.loads(open(argv[0]).read())
    threads = str(job.get("threads", 1))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if threads != "1" else "1")
    result = run(job)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":      # the engine core starts by spawn: it re-imports this file
    sys.exit(main(sys.argv[1:]))
