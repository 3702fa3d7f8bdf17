"""How good a drafter is: greedy speculative decoding and its baselines (``decode``),
simulated and real tau (``tau``) with bootstrap intervals over prompts (``intervals``), the
parity report of ``launch.py evaluate`` (``parity``), and the periodic evaluator process
and its plateau stop (``evaluator``). The data it evaluates on is ``prepare/``'s.
"""
