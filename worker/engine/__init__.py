"""Engines turn batches of token-id requests into completions. See base.py for the interface."""

from __future__ import annotations

from batchfleet.common.config import DynamicBatchingConfig, EngineConfig
from batchfleet.worker.engine.base import Completion, Engine, GenRequest
from batchfleet.worker.engine.models import LoadedModel

__all__ = ["Completion", "Engine", "GenRequest", "build_engine"]


def build_engine(cfg: EngineConfig, batching: DynamicBatchingConfig, loaded: LoadedModel) -> Engine:
    """Construct the configured engine around an already loaded model."""
    if cfg.engine == "hf":
        from batchfleet.worker.engine.hf import HFEngine

        return HFEngine(loaded, batching)
    from batchfleet.worker.engine.native.engine import NativeEngine

    return NativeEngine(loaded, batching, cfg)
