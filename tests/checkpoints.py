"""Loadable tiny checkpoints on disk (model + tokenizer) for loader, CLI, worker and app tests."""
from __future__ import annotations

from pathlib import Path


def tiny_qwen35_checkpoint(root, seed: int = 0) -> Path:
    """A tiny random Qwen3_5ForCausalLM (d_k = d_v = 16) with a local BPE tokenizer, saved under ``root/model``."""
    import tiny_models
    import tokenizers_for_tests

    root = Path(root)
    out = root / "model"
    if (out / "config.json").exists():
        return out
    plain, _ = tokenizers_for_tests.build(root / "tok")
    tok = tokenizers_for_tests.load(plain)
    model = tiny_models.qwen3_5(seed=seed, vocab=len(tok))
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
