"""The bundled demo checkpoint (gdnviz/assets/demo): it ships, loads offline, is the architecture the model card
says, really answers held-out retrieval prompts on CPU through gdnviz's own generation path, and loses those
answers when its GDN heads are cut to rank 1 at every segment boundary (v2: the retrieval lives in the GDN states;
v1 answered through its attention layers and no truncation changed an answer, see MODEL_CARD.md)."""
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


@pytest.mark.parametrize("task", ["niah_single_1", "vt"])
def test_demo_answers_held_out_prompts_and_rank_1_breaks_them(demo, task):
    """niah_single_1 and vt at 1K tokens (4 boundaries of 256) on held-out seeds: untouched, the model answers
    every one; with every GDN head cut to r = 1 at every boundary most answers are lost; at r = 16 none is."""
    from gdnviz.truncation import TruncationSpec

    samples = [ruler.generate(task, demo.tokenizer, 1024, seed=2_000_000 + i) for i in range(3)]

    def score(r):
        spec = None if r is None else TruncationSpec.all_heads(demo.info, r)
        preds = [greedy_generate(demo, s.input_ids, s.tokens_to_generate, spec=spec).text for s in samples]
        return ruler.score_samples(samples, preds), preds

    untouched, preds = score(None)
    assert untouched == 100.0, (task, preds)
    cut, preds = score(1)
    assert cut <= 34.0, (task, cut, preds)  # measured: niah_single_1 0, vt 20 (of 100)
    kept, preds = score(16)
    assert kept == 100.0, (task, preds)
