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


REMOTE_CODE = '''"""A checkpoint's own code (a test fixture): a Qwen3.5 decoder that doubles its token embeddings."""
from pathlib import Path

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3_5TextModel

with open(MARKER, "a") as fh:  # proof that this code ran
    fh.write("imported\\n")


class MyGDNConfig(Qwen3_5TextConfig):
    model_type = MODEL_TYPE


class MyGDNModel(Qwen3_5TextModel):
    def forward(self, input_ids=None, inputs_embeds=None, **kw):
        if inputs_embeds is None:
            inputs_embeds = 2.0 * self.embed_tokens(input_ids)
        return super().forward(inputs_embeds=inputs_embeds, **kw)


class MyGDNForCausalLM(Qwen3_5ForCausalLM):
    config_class = MyGDNConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = MyGDNModel(config)
        self.post_init()
'''


def build_remote_code_checkpoint(root: str | os.PathLike, model_type: str = "my_gdn") -> tuple[Path, Path]:
    """(checkpoint folder, marker file): the tiny checkpoint's weights and tokenizer with its own code
    (``modeling_my_gdn.py``, named by config.json's ``auto_map``), a Qwen3.5 decoder that doubles its token
    embeddings. With ``model_type`` "my_gdn" only that code defines the model; with "qwen3_5_text" transformers'
    built-in class loads it unless remote code is trusted. Importing the code appends a line to the marker."""
    import shutil

    root = Path(root)
    src = build_checkpoint(root)
    out = root / f"remote-code-{model_type}"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    marker = root / f"remote-code-{model_type}.ran"
    marker.unlink(missing_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg["architectures"] = ["MyGDNForCausalLM"]
    cfg["auto_map"] = {"AutoConfig": "modeling_my_gdn.MyGDNConfig",
                       "AutoModelForCausalLM": "modeling_my_gdn.MyGDNForCausalLM"}
    if model_type != "my_gdn":
        del cfg["auto_map"]["AutoConfig"]  # the built-in config class; only the model is the checkpoint's own
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    code = REMOTE_CODE.replace("MARKER", repr(str(marker)), 1).replace("MODEL_TYPE", repr(model_type))
    (out / "modeling_my_gdn.py").write_text(code)
    return out, marker


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
