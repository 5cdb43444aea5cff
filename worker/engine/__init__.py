"""Engines turn batches of token-id requests into completions.

``base`` declares the interface; ``hf`` (transformers ``generate``, the baseline) and ``native`` (own
forward over a paged KV cache) implement it; ``sampling`` and ``models`` serve both. Imports run one
way: implementations import ``base``/``sampling``/``models``, never the other way round. The worker's
composition root (worker/compose.py) picks the implementation.
"""
