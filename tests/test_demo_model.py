"""The bundled demo checkpoint (gdnviz/assets/demo): it ships, loads offline, is the architecture the model card
says, and really answers held-out retrieval prompts on CPU through gdnviz's own generation path.

(v1 answers through its attention layers: cutting its GDN heads changes no answer, see MODEL_CARD.md. The
assertion that rank 1 breaks retrieval belongs here once v2 is trained.)"""
import json
from pathlib import Path

import pytest

from gdnviz.generate import greedy_generate
from gdnviz.models import load
from gdnviz.models.loader import DEMO_DIR
from gdnviz.probes import ruler


@pytest.fixture(scope="module")
def demo(one_thread):
    return load("demo", device="cpu", dtype="float32")


def test_demo_checkpoint_ships_within_budget():
    weights = DEMO_DIR / "model.safetensors"
    assert weights.exists() and weights.stat().st_size <= 25 * 2**20
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md", "metrics.json",
              "loss_curve.csv"):
        assert (DEMO_DIR / f).exists(), f
    assert "TODO" not in (DEMO_DIR / "MODEL_CARD.md").read_text()


def test_demo_architecture(demo):
    info = demo.info
    assert info.family == "qwen3_5" and info.d_k == 128 and info.d_v == 128
    assert list(info.attn_layers) == [3, 7] and list(info.gdn_layers) == [0, 1, 2, 4, 5, 6]
    cfg = json.loads(Path(DEMO_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]


def test_demo_answers_held_out_needles(demo):
    """niah_single_1 and niah_multikey_2 at 1K tokens on held-out seeds: the model answers every one."""
    for task in ("niah_single_1", "niah_multikey_2"):
        samples = [ruler.generate(task, demo.tokenizer, 1024, seed=2_000_000 + i) for i in range(3)]
        preds = [greedy_generate(demo, s.input_ids, s.tokens_to_generate).text for s in samples]
        assert ruler.score_samples(samples, preds) == 100.0, (task, preds)
