"""The trainer's side of the tiny Llama that vLLM serves: the same weights, recomputed in plain
torch (fp32 by default), read from and written to the Hugging Face model directory that
`timwatch.sidecar.demo.hf_model` builds (``config.json`` + ``model.safetensors``).

The module mirrors Hugging Face's Llama parameter names exactly (``model.layers.0.self_attn.
q_proj.weight``, …), so `save` writes a checkpoint vLLM reloads in place
(``collective_rpc reload_weights``) and `load` reads what vLLM serves. The forward is Llama's:
RMSNorm in fp32, rotary embeddings (rotate-half, ``rope_theta`` from the config), causal
attention, SwiGLU, untied output layer. No KV cache: it is the full-sequence prefill a trainer
runs. Imports torch and safetensors: demo-only code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLlama", "load", "response_logprobs", "save"]

WEIGHTS = "model.safetensors"


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _MLP(nn.Module):
    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        d, eps = c["hidden_size"], c["rms_norm_eps"]
        heads = c["num_attention_heads"]
        self.input_layernorm = _RMSNorm(d, eps)
        self.self_attn = _Attention(d, heads, c.get("num_key_value_heads") or heads, head_dim)
        self.post_attention_layernorm = _RMSNorm(d, eps)
        self.mlp = _MLP(d, c["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, c: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(_Layer(c, head_dim) for _ in range(c["num_hidden_layers"]))
        self.norm = _RMSNorm(c["hidden_size"], c["rms_norm_eps"])


def _rope_theta(c: dict[str, Any]) -> float:
    """``rope_theta`` at the top level (transformers 4) or in ``rope_parameters`` (5)."""
    params = c.get("rope_parameters") or {}
    return float(c.get("rope_theta") or params.get("rope_theta") or 10000.0)


class TinyLlama(nn.Module):
    """Llama from a Hugging Face ``config.json`` dict; ``forward(ids)`` → logits ``[B, T, V]``
    in the module's dtype (fp32 unless cast)."""

    inv_freq: torch.Tensor

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if config.get("tie_word_embeddings"):
            raise ValueError("TinyLlama expects an untied output layer (tie_word_embeddings)")
        self.config = config
        heads = config["num_attention_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // heads
        self.model = _Body(config, self.head_dim)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.register_buffer("inv_freq", 1.0 / (_rope_theta(config) ** exponents), persistent=False)

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        freqs = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        x = self.model.embed_tokens(ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def load(model_dir: Path | str) -> TinyLlama:
    """The model in ``model_dir`` (config.json + model.safetensors), fp32, every weight set."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    model = TinyLlama(config)
    state = {k: v.float() for k, v in load_file(str(model_dir / WEIGHTS)).items()}
    model.load_state_dict(state, strict=True)
    return model


def save(model: TinyLlama, model_dir: Path | str) -> None:
    """Writes ``model.safetensors`` (fp32) into ``model_dir`` atomically (a reader sees the old
    or the new file, never half of one); ``config.json`` and the tokenizer stay as built."""
    import os

    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    tmp = model_dir / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, model_dir / WEIGHTS)


def response_logprobs(
    model: TinyLlama, prompt: list[int], response: list[int], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """π and H of each ``response`` token after ``prompt``: one full-sequence forward,
    ``softmax(logits / temperature)`` (`logprobs_and_entropy_from_logits`); both ``[len(response)]``
    float32, differentiable with respect to the model's weights."""
    from ...monitor.trainer.logprobs import logprobs_and_entropy_from_logits

    ids = torch.tensor([prompt + response], dtype=torch.int64)
    logits = model(ids)[0, len(prompt) - 1 : -1]
    labels = torch.tensor(response, dtype=torch.int64)
    return logprobs_and_entropy_from_logits(logits, labels, temperature)
