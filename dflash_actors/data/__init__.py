"""The training data: memory-mapped datasets (``dataset``), token-budget epoch plans and
packed batches (``batching``), and the embedded synthetic default (``synthetic``).
"""
