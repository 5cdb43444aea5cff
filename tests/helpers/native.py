"""Helpers shared by the native-engine tests (no tests here): tiny local models of three families."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.wire.params import Params
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import LoadedModel, load_model
from batchfleet.worker.engine.native.engine import NativeEngine
from batchfleet.worker.engine.tokenizer import BOS_ID, EOS_ID, PAD_ID, byte_level_tokenizer

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=320,
               max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
               tie_word_embeddings=False)
FAMILIES = {
    "llama": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0)),
    "qwen2": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0)),
    "mistral": (MistralConfig, dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
                                    rope_theta=50000.0)),
}


def build_model(family: str, root: Path, seed: int = 0, **overrides) -> LoadedModel:
    """Save a random tiny model of ``family`` (config ``overrides`` applied) under ``root`` and load it
    back (fp32, cpu)."""
    path = root / family
    if not (path / "config.json").exists():
        cls, extra = FAMILIES[family]
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cls(**{**_COMMON, **extra, **overrides}), dtype=torch.float32)
        with torch.no_grad():  # larger logits spread: fewer near-ties between greedy candidates
            model.lm_head.weight.mul_(4.0)
        model.save_pretrained(path)
        byte_level_tokenizer().save_pretrained(path)
    return load_model(path, "cpu", "float32")


def make_engine(loaded: LoadedModel, *, padding: str = "bucket", max_batch_size: int = 8,
                num_blocks: int | None = None, block_size: int = 16, mode: str = "continuous",
                buckets=(16, 32, 64, 128), max_seq_len: int = 256, prefill: str = "auto",
                decode: str = "auto", max_prefill_tokens: int | None = None,
                max_running: int | None = None) -> NativeEngine:
    batching = DynamicBatchingConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                     buckets=buckets, padding=padding)
    cfg = EngineConfig(engine="native", mode=mode, block_size=block_size, kv_cache_gb=0.01)
    return NativeEngine(loaded, batching, cfg, num_blocks=num_blocks, prefill=prefill, decode=decode,
                        max_prefill_tokens=max_prefill_tokens, max_running=max_running or max_batch_size)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS_ID] + torch.randint(4, 260, (n - 1,), generator=g).tolist()


def gen_request(id: str, prompt: list[int], bucket: int, priority: int = 0, **params) -> GenRequest:
    """An engine request; ``params`` are common/wire/params.py's fields."""
    return GenRequest(id=id, prompt=prompt, bucket=bucket, params=Params(**params), priority=priority)


def request(i: int, toks: list[int], max_new: int, buckets=(16, 32, 64, 128), **kw) -> GenRequest:
    bucket = next(b for b in buckets if b >= len(toks))
    return gen_request(f"r{i}", toks, bucket, max_new_tokens=max_new, **kw)


def run_all(engine: NativeEngine, groups: list[list[GenRequest]], join_every: int = 0) -> dict:
    """Add ``groups`` one bucket at a time: all before stepping (join_every=0), or one group every
    ``join_every`` steps while others run (continuous). Returns {id: Completion}."""
    done: dict = {}
    pending = list(groups)
    steps = 0
    if not join_every:
        while pending:
            engine.add(pending.pop(0))
            while engine.has_work():
                for c in engine.step():
                    done[c.id] = c
    else:
        engine.add(pending.pop(0))
        while engine.has_work() or pending:
            if pending and steps % join_every == 0:
                engine.add(pending.pop(0))
            for c in engine.step():
                done[c.id] = c
            steps += 1
    return done


def hf_greedy(loaded: LoadedModel, toks: list[int], max_new: int) -> list[int]:
    """Reference: transformers generate, one request at a time."""
    ids = torch.tensor([toks])
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new, pad_token_id=PAD_ID)
    return out[0, len(toks):].tolist()
