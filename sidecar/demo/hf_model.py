"""Builds the tiny Llama that a real vLLM serves in the real-engine tests and in
``timwatch demo --engine vllm``: nothing comes from a model hub.

Run it with the vLLM venv's python (which has ``transformers`` and ``tokenizers``; timwatch's own
environment needs neither): ``VLLM_PY sidecar/demo/hf_model.py OUT_DIR [--seed N]``. It writes a
Hugging Face model directory — ``config.json``, ``model.safetensors`` (fp32), and a byte-level
BPE tokenizer trained here on text of the Python standard library, saved as
``PreTrainedTokenizerFast`` — and prints a JSON line with the vocabulary and parameter count.

The model: Llama, 2 layers, hidden 128, 2 heads of 64, SwiGLU 256, vocabulary 1024, untied
output layer, about 0.6 M parameters, random init with ``initializer_range`` 0.2 so that
next-token distributions are far from flat (entropies from confident to uncertain). The same
weights are what `timwatch.sidecar.demo.llama` recomputes in plain torch fp32 (the trainer).
This file imports nothing of timwatch, so it runs where timwatch is not installed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

__all__ = ["EOS", "VOCAB", "build"]

VOCAB = 1024
EOS = "<|endoftext|>"
_CORPUS_MODULES = (
    "argparse", "collections", "functools", "itertools", "json", "pathlib", "random", "re",
    "string", "textwrap", "typing", "dataclasses", "inspect", "statistics", "fractions",
)  # fmt: skip


def _corpus() -> list[str]:
    """Docstrings of a few standard-library modules and their members: English and code."""
    import importlib

    texts: list[str] = []
    for name in _CORPUS_MODULES:
        mod = importlib.import_module(name)
        for obj in [mod, *vars(mod).values()]:
            doc = inspect.getdoc(obj) if callable(obj) or obj is mod else None
            if doc:
                texts.append(doc)
    return texts


def build(out: Path, seed: int = 0) -> dict[str, int]:
    """Writes the model directory at ``out``; returns ``{"vocab": V, "parameters": N}``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
    )
    eos = tok.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return {"vocab": config.vocab_size, "parameters": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(build(args.out, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
