"""The native engine: paged KV cache, batched prefill/decode and continuous batching.

Layout: ``sequence`` / ``block_manager`` / ``scheduler`` are pure Python (no torch); ``model`` holds
the weights and the forward; ``attention`` the attention over the block pool; ``runner`` owns every
tensor; ``engine`` glues them into the worker's Engine API.
"""
