"""How good a drafter is: greedy speculative decoding and its baselines (``decode``),
simulated and real tau (``tau``) with bootstrap intervals over prompts (``intervals``), the
parity report of ``launch.py evaluate`` (``parity``), the periodic evaluator process and its
plateau stop (``evaluator``); and the target's own text for training: ``launch.py
prepare`` (``prepare``) with its in-process and serving engines (``generate``, ``serving``)
and the prompts a target writes itself (``self_prompts``).
"""
