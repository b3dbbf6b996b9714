"""A tiny real checkpoint directory (Qwen3.5 config, random weights, a small byte-level BPE tokenizer) for the app,
worker and browser tests; built once per test session (``build_checkpoint(dir)``)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def build_checkpoint(root: str | os.PathLike, *, many_heads: bool = False) -> Path:
    """``root/tiny-qwen3_5``: config.json + model.safetensors + tokenizer files; returns the folder. With
    ``many_heads``, ``root/many-heads-qwen3_5``: 32 layers (24 GDN layers × 12 value heads = 288 heads, d_k = d_v =
    128, every 4th layer full attention), untrained: the size of a real model's head grid, for UI timings."""
    import torch

    import tiny_models
    import tokenizers_for_tests

    root = Path(root)
    out = root / ("many-heads-qwen3_5" if many_heads else "tiny-qwen3_5")
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    plain, _chat = tokenizers_for_tests.build(root / "tok", vocab_size=1200)
    tok = tokenizers_for_tests.load(_chat)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    kw = {}
    if many_heads:
        kw = dict(layers=(("linear_attention",) * 3 + ("full_attention",)) * 8, k_heads=6, v_heads=12, dk=128,
                  dv=128)
    m = tiny_models.qwen3_5(vocab=len(tok) + 16, **kw)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_not_gdn(root: str | os.PathLike) -> Path:
    """A checkpoint folder whose config declares no Gated DeltaNet layers (a plain Qwen3 config)."""
    out = Path(root) / "plain-qwen3"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 97}))
    (out / "model.safetensors").write_bytes(b"")
    return out


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A loadable tiny Qwen3.5 checkpoint folder with a tokenizer (built once per test session)."""
    return build_checkpoint(tmp_path_factory.getbasetemp() / "gdnviz_app_ckpt")


def short_text(n_words: int = 400, seed: int = 0) -> str:
    """A few hundred tokens of English (the start of a bundled sample, repeated if needed)."""
    from gdnviz.documents import sample_documents

    words = " ".join(d.text for d in sample_documents()).split()
    start = (seed * 997) % max(1, len(words) - n_words)
    return " ".join(words[start:start + n_words])


if __name__ == "__main__":
    print(build_checkpoint(sys.argv[1]))
