"""How good a drafter is: greedy speculative decoding and its baselines (``decode``),
simulated and real tau (``tau``) with bootstrap intervals over prompts (``intervals``), the
parity report of ``launch.py evaluate`` (``parity``) and its table over prompt sets
(``prompt_set_table``), the periodic evaluator process and its plateau stop (``evaluator``),
and ``launch.py serve-check`` (``serve``), which runs a real vLLM through ``engine_vllm``, a
script for vLLM's own environment. The data it evaluates on is ``prepare/``'s.
"""
