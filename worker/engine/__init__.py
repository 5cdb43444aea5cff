"""Engines turn batches of token-id requests into completions. See base.py for the interface."""

from __future__ import annotations

from common.config import DynamicBatchingConfig, EngineConfig
from worker.engine.base import Completion, Engine, GenRequest
from worker.models import LoadedModel

__all__ = ["Completion", "Engine", "GenRequest", "build_engine"]


def build_engine(cfg: EngineConfig, batching: DynamicBatchingConfig, loaded: LoadedModel) -> Engine:
    """Construct the configured engine around an already loaded model."""
    if cfg.engine == "hf":
        from worker.engine.hf import HFEngine

        return HFEngine(loaded, batching)
    from worker.native.engine import NativeEngine

    return NativeEngine(loaded, batching, cfg)
