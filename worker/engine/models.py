"""Model and tokenizer loading, and the built-in models made locally from a config.

Built-in presets are saved once to a cache dir and then loaded through the same ``from_pretrained``
path as any real checkpoint, so the default demo exercises real loading code without a hub.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from batchfleet.common.startup import PHASES
from batchfleet.worker.engine.tokenizer import BOS_ID, EOS_ID, PAD_ID, byte_level_tokenizer

log = logging.getLogger(__name__)

PRESET_VERSION = 2  # 2: the tokenizer carries a chat template
PRESETS: dict[str, dict] = {
    # Small enough for tests on 2 cores; still a real Llama (RoPE, RMSNorm, SwiGLU, GQA off).
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=320),
    # ~130M parameters, Llama-shaped: the benchmark model.
    "bench": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=32000),
    # ~1.1B parameters, TinyLlama-1.1B's shape (GQA 32/4, 22 layers): a model of real size for the tables.
    "llama1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                    num_key_value_heads=4, vocab_size=32000),
}


def make_preset(preset: str, cache_dir: str | Path, seed: int = 0, max_seq_len: int = 4096) -> Path:
    """Create (once) and return the directory of a built-in Llama preset with random weights."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    target = Path(cache_dir).expanduser() / f"{preset}-v{PRESET_VERSION}-seed{seed}"
    if (target / "config.json").exists():
        return target
    with PHASES.phase("preset", "building the built-in preset %s (random weights; once, into %s)", preset,
                      target.parent):
        return _build_preset(preset, target, seed, max_seq_len)


def _build_preset(preset: str, target: Path, seed: int, max_seq_len: int) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**PRESETS[preset], max_position_embeddings=max(max_seq_len, 4096), rms_norm_eps=1e-5,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Written to a temp dir and renamed, so concurrent workers never load a half-written model.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{preset}-"))
    try:
        model.save_pretrained(tmp)
        byte_level_tokenizer().save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("created built-in model preset %s at %s", preset, target)
    return target


def default_dtype(device: str) -> torch.dtype:
    """bf16 where we measured it to win: CUDA, NPU, and CPUs where bf16 matmuls run at full width (AMX, or
    AVX512-BF16 on AMD Zen 4/5: bf16 1.7-1.9x fp32 for both engines, docs/BENCHMARKS_HISTORY.md 7 and 13c). Intel CPUs
    with AVX512-BF16 but no AMX get fp32: there fp32 was faster for the fleet and for vLLM alike (issue 34:
    129 vs 120 and 90 vs 78 tok/s). Everything else gets fp32: on AVX2-only CPUs bf16's matmuls run in fp32
    (linear.WidenedLinear; torch's own bf16 kernel there is ~5x slower), so bf16 saves only K/V bytes, and the fleet ran
    as fast in both (EPYC Zen 3: 171 vs 161 tok/s on the bench preset, 16.1 vs 16.2 on the 1.1B shape,
    docs/BENCHMARKS_HISTORY.md 13l) while rounding every activation to bf16."""
    if device == "cpu":
        return torch.bfloat16 if cpu_prefers_bf16(_cpuinfo()) else torch.float32
    return torch.bfloat16


def cpu_prefers_bf16(cpuinfo: str) -> bool:
    """From /proc/cpuinfo's text: AMX, or AVX512-BF16 on an AMD CPU (see ``default_dtype``)."""
    if "amx_bf16" in cpuinfo:
        return True
    return "avx512_bf16" in cpuinfo and "AuthenticAMD" in cpuinfo


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def prepare_device(device: str) -> torch.device:
    """Import torch_npu lazily for NPUs, with an actionable message if it is missing."""
    if device.startswith("npu"):
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "device npu needs torch_npu: pip install 'batchfleet[npu]' (matching your CANN version)"
            ) from exc
    return torch.device(device)


def eos_ids_of(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    """EOS ids as transformers' generate sees them: the generation config's, else the model config's,
    else the tokenizer's. The one place they are computed (engines, fleet description)."""
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
    return frozenset([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    path: Path
    device: torch.device
    dtype: torch.dtype
    eos_ids: frozenset[int] = frozenset()


def load_model(path: str | Path, device: str = "cpu", dtype: str | None = None) -> LoadedModel:
    """Load a local HF checkpoint dir (Llama, Mistral, Qwen2...); never touches a hub."""
    path = Path(path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a local Hugging Face checkpoint (no config.json)")
    dev = prepare_device(device)
    dt = resolve_dtype(dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise RuntimeError(f"{path}: a fast tokenizer (tokenizer.json) is required so producers can use it")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dt)
    model.to(dev).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, device=dev, dtype=dt,
                       eos_ids=eos_ids_of(model, tokenizer))
