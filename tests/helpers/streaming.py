"""A real Llama checkpoint whose weights are set by hand so that greedy decoding cycles through a fixed
byte string (no test in this file).

Every layer's output projections are zero, so the residual stream is the token's embedding; cycle token i
embeds to one-hot(i), and the LM head maps one-hot(i) to the next byte of the cycle. With the built-in
byte-level tokenizer (one token per byte) the output is that text repeated: multi-byte UTF-8 characters
whose bytes are separate tokens, the case incremental detokenization must get right.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from batchfleet.worker.engine.tokenizer import BOS_ID, BYTE_OFFSET, EOS_ID, PAD_ID, byte_level_tokenizer

CYCLE_TEXT = " é日ж€"  # 11 bytes, all distinct, so each byte has one successor


def make_cycle_model(target: Path, text: str = CYCLE_TEXT) -> Path:
    """Save (once) a checkpoint under ``target`` whose greedy output after a prompt ending in ``text[0]``
    is ``text[1:] + text + text + ...``; returns ``target``."""
    if (target / "config.json").exists():
        return target
    ids = [BYTE_OFFSET + b for b in text.encode()]
    assert len(set(ids)) == len(ids), "each byte of the cycle must be distinct"
    hidden = 64
    config = LlamaConfig(hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        embed = model.get_input_embeddings().weight  # [V, H]
        head = model.get_output_embeddings().weight  # [V, H]
        for i, tok in enumerate(ids):
            embed[tok, i] = 10.0
            head[ids[(i + 1) % len(ids)], i] = 1.0
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    byte_level_tokenizer().save_pretrained(target)
    return target
