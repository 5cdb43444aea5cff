"""Weights of a Llama-family decoder (Llama, Mistral, Qwen2) and the engine's own forward pass.

The weights stay those of the transformers module (q/k/v and gate/up are fused once and the module's
parameters re-pointed at views of the fused tensors, so nothing is stored twice). The forward never
touches transformers' cache: attention is a callback given by the runner, which owns the KV pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from batchfleet.common.startup import PHASES
from batchfleet.worker.engine.native import triton_support
from batchfleet.worker.engine.native.linear import Linear, LinearFactory

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")  # same block structure; others differ (qk-norm, ...)

# attn(layer_idx, q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, D]) -> [B, S, H * D]
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# rope_attn(layer_idx, qkv [B, S, (H + 2 Hkv) * D] before RoPE) -> [B, S, H * D]: RoPE, the KV write and
# attention in one, where the runner has them fused (CPU decode: small_ops.RopeKV + the C kernel)
RopeAttnFn = Callable[[int, torch.Tensor], torch.Tensor]
# norm(x [..., hidden], weight [hidden]) -> [..., hidden]: RMSNorm (default: NativeModel.rms_norm)
NormFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# act_mul(gate_up [..., 2 * inter]) -> act(gate) * up [..., inter] (default: NativeModel.act_mul)
ActMulFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    in_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) * D] (Qwen2)
    o: torch.Tensor  # [hidden, H * D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * inter, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, inter]
    down_bias: torch.Tensor | None
    # the same weights on the kernel chosen at load (linear.py): what the forward calls
    qkv_l: Linear
    o_l: Linear
    gate_up_l: Linear
    down_l: Linear


def _fuse(mods: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears sharing an input; re-point them at views."""
    with torch.no_grad():
        w = torch.cat([m.weight for m in mods], 0).contiguous()
        b = None
        if any(m.bias is not None for m in mods):
            parts = [m.bias if m.bias is not None else w.new_zeros(m.out_features) for m in mods]
            b = torch.cat(parts)
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = w[off : off + n]
            if b is not None and m.bias is not None:
                m.bias.data = b[off : off + n]
            off += n
    return w, b


class NativeModel:
    """Shapes, weights and forward of one decoder-only model."""

    def __init__(self, hf_model: torch.nn.Module, max_positions: int, linear: str | LinearFactory = "auto") -> None:
        """linear: how each weight matmul runs (linear.py): "auto" (measured per shape at load),
        "default" (F.linear) or "onednn" (prepacked wherever possible), or a LinearFactory."""
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"the native engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not {cfg.model_type!r}: "
                "use --engine hf"
            )
        inner = hf_model.model
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.hidden_act = cfg.hidden_act
        self.act = ACT2FN[cfg.hidden_act]
        self.vocab_size = cfg.vocab_size
        attn0 = inner.layers[0].self_attn
        self.scale = float(getattr(attn0, "scaling", self.head_dim**-0.5))
        self.sliding_window = _sliding_window(cfg)
        if self.sliding_window is not None and max_positions > self.sliding_window:
            raise NotImplementedError(
                f"sliding-window attention ({self.sliding_window}) is not implemented; "
                f"use max_seq_len <= {self.sliding_window}"
            )
        p = next(hf_model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.embed = inner.embed_tokens.weight  # [V, hidden]
        self.final_norm = inner.norm.weight
        self.lm_head = hf_model.get_output_embeddings().weight  # [V, hidden]
        make = linear if isinstance(linear, LinearFactory) else LinearFactory(linear)
        with PHASES.phase("kernels", "choosing the weight matmul kernels of %d layers (--linear %s; each shape "
                          "probed once, or found cached for this CPU kind)", self.num_layers, make.choice):
            self.linears = make
            self.lm_head_l = make(self.lm_head)
            self.layers: list[LayerWeights] = []
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                qkv, qkv_b = _fuse([a.q_proj, a.k_proj, a.v_proj])
                gate_up, gu_b = _fuse([m.gate_proj, m.up_proj])
                o, o_b, down, down_b = a.o_proj.weight, a.o_proj.bias, m.down_proj.weight, m.down_proj.bias
                self.layers.append(LayerWeights(
                    in_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=qkv_b,
                    o=o, o_bias=o_b, post_norm=layer.post_attention_layernorm.weight,
                    gate_up=gate_up, gate_up_bias=gu_b, down=down, down_bias=down_b,
                    qkv_l=make(qkv, qkv_b), o_l=make(o, o_b), gate_up_l=make(gate_up, gu_b), down_l=make(down, down_b),
                ))
        self.cos, self.sin = _rope_tables(inner.rotary_emb, max_positions, self.device, self.dtype)
        # sin with rotate-half's sign folded in (first half negated): rope needs no separate negation, and
        # x2 * -sin == -x2 * sin exactly, so the result is bit-identical to transformers'
        half = self.head_dim // 2
        self.sin_rot = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1).contiguous()
        # the small ops as Triton kernels (triton_ops.py) where they run (CUDA), the residual add fused into the
        # RMSNorm that follows it; elsewhere the torch ops below
        self.fused: ModuleType | None = None
        if triton_support.runs_on(self.device):
            from batchfleet.worker.engine.native import triton_ops  # imports triton: only where it runs

            self.fused = triton_ops

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm, op for op (fp32 statistics, weight applied in model dtype)."""
        if self.fused is not None:
            return self.fused.rms_norm(x, w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's act(gate) * up of the fused gate/up projection [..., 2 * inter] -> [..., inter]."""
        if self.fused is not None and self.hidden_act == "silu":
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.hidden_act == "silu" and gate.dtype == torch.float32:
            # torch's fp32 SiLU computes the tail of each thread's range with another exp than its vector body
            # (4% of values an ulp apart, measured), so a row cut by a thread boundary would change with the
            # row count; torch's exp is the same bits in both (10M values), so SiLU composed of it is not
            return gate / (1 + torch.exp(-gate)) * up
        return self.act(gate) * up

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, rms_norm(h)) with h = residual + x, in one Triton kernel (only where ``self.fused`` is set)."""
        assert self.fused is not None
        return self.fused.add_rms_norm(x, residual, w, self.eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
        """x: [B, S, heads, D]; cos/sin_rot: [B, S, 1, D] (rotate-half convention; sin_rot: rows of
        ``self.sin_rot``, the sign of rotate-half folded in)."""
        if self.fused is not None:
            return self.fused.rope(x, cos, sin_rot)
        half = x.shape[-1] // 2
        rot = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin_rot

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
                last_idx: torch.Tensor | None = None, rope_attn: RopeAttnFn | None = None,
                norm: NormFn | None = None, act_mul: ActMulFn | None = None, hidden: bool = False) -> torch.Tensor:
        """tokens, positions: [B, S] -> logits [R, V] of the rows ``last_idx`` of the flattened [B * S]
        tokens (default: the last position of each row, R = B). Attention: ``rope_attn`` where given (it
        applies RoPE itself), else RoPE here and ``attn``. ``norm``: the RMSNorm to use (default: the
        torch ops of ``rms_norm``; the runner passes the C one for CPU decode steps), ``act_mul`` likewise.
        ``hidden``: instead, the final-norm hidden state of every token, [B * S, hidden] (embed requests)."""
        B, S = tokens.shape
        norm, act_mul = norm or self.rms_norm, act_mul or self.act_mul
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if rope_attn is None:
            cos = self.cos[positions].unsqueeze(2)  # [B, S, 1, D]
            sin = self.sin_rot[positions].unsqueeze(2)
        # fused: each residual add in one kernel with the RMSNorm after it (the down projection's output waits
        # in ``delta`` for the next layer's input norm); else the add in the matmul (add_to), the norm apart
        add_norm = self._add_norm if self.fused is not None and norm == self.rms_norm else None
        delta = None  # [B, S, hidden] not yet added to h
        h = F.embedding(tokens, self.embed)  # [B, S, hidden]
        for i, lw in enumerate(self.layers):
            if delta is not None and add_norm is not None:
                h, x = add_norm(delta, h, lw.in_norm)
            else:
                x = norm(h, lw.in_norm)
            if rope_attn is not None:
                o = rope_attn(i, lw.qkv_l(x))  # [B, S, H * D]
            else:
                qkv = lw.qkv_l(x).view(B, S, H + 2 * Hkv, D)
                qk = self.rope(qkv[:, :, : H + Hkv], cos, sin)  # [B, S, H + Hkv, D]
                o = attn(i, qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv :])  # [B, S, H * D]
            if add_norm is not None:
                h, x = add_norm(lw.o_l(o), h, lw.post_norm)
                delta = lw.down_l(act_mul(lw.gate_up_l(x)))
            else:
                h = lw.o_l.add_to(o, h)
                x = norm(h, lw.post_norm)
                h = lw.down_l.add_to(act_mul(lw.gate_up_l(x)), h)
        if delta is not None:
            h = h + delta
        if hidden:
            return norm(h.reshape(B * S, -1), self.final_norm)  # [B * S, hidden]
        h = h[:, -1] if last_idx is None else h.reshape(B * S, -1)[last_idx]  # [R, hidden]
        return self.lm_head_l(norm(h, self.final_norm))  # [R, V]


def _sliding_window(cfg) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)


def _rope_tables(rotary: torch.nn.Module, n: int, device: torch.device, dtype: torch.dtype):
    """cos/sin [n, D] for positions 0..n-1 from the model's own rotary module (every scaling type
    transformers implements, incl. attention_scaling), cast to the model dtype like transformers."""
    with torch.no_grad():
        pos = torch.arange(n, device=device)[None]
        probe = torch.zeros(1, device=device, dtype=torch.float32)
        cos, sin = rotary(probe, pos)
    return cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()
