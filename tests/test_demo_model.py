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


def _train_script():
    """scripts/demo/train.py as a module (its top level imports only the standard library)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "demo" / "train.py"
    spec = importlib.util.spec_from_file_location("demo_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _count_by_formula(cfg) -> tuple[int, int]:
    """(parameters, vector parameters) of a Qwen3.5 text model with tied embeddings, from its config alone:
    GDN layer = in_proj_qkv + in_proj_z + in_proj_a/b + depthwise conv + dt_bias + A_log + gated norm + out_proj;
    attention layer = gated q_proj (2x) + k/v_proj + o_proj + q/k norms; each layer 2 RMSNorms + SwiGLU MLP."""
    h, ff, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    conv = 2 * hk * dk + hv * dv
    gdn_mat = h * conv + h * hv * dv + 2 * h * hv + conv * cfg.linear_conv_kernel_dim + hv * dv * h
    gdn_vec = 2 * hv + dv
    nh, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    att_mat, att_vec = h * nh * hd * 2 + 2 * h * kv * hd + nh * hd * h, 2 * hd
    n_gdn = cfg.layer_types.count("linear_attention")
    n_att = cfg.layer_types.count("full_attention")
    mats = n_gdn * (gdn_mat + 3 * h * ff) + n_att * (att_mat + 3 * h * ff) + V * h
    vecs = n_gdn * (gdn_vec + 2 * h) + n_att * (att_vec + 2 * h) + h
    return mats + vecs, vecs


def test_v3_preset_shape_on_meta_device():
    """The v3 preset (issue 33): >= 32 GDN heads of 128 x 128, 2-3 full-attention layers, <= 32 MB shipped (bf16
    matrices, fp32 vectors); train.model_size agrees with a count from the config's shapes."""
    train = _train_script()
    cfg = train.make_config("v3", 8192, {"bos": 1, "eos": 2, "pad": 0})
    size = train.model_size(cfg)
    assert cfg.linear_key_head_dim == cfg.linear_value_head_dim == 128
    assert size["gdn_heads"] >= 32 and 2 <= len(size["attn_layers"]) <= 3
    n, vecs = _count_by_formula(cfg)
    assert size["params"] == n
    assert size["ship_bytes"] == 2 * (n - vecs) + 4 * vecs <= 32 * 10**6
    v2 = train.make_config("full", 8192, {"bos": 1, "eos": 2, "pad": 0})
    assert train.model_size(v2)["params"] == _count_by_formula(v2)[0] == 9_336_088  # the shipped v2 (MODEL_CARD.md)


def test_v3_gate_init_spreads_horizons():
    """--gate-init spread: the 32 heads' horizons at a = 0 are log-spaced over [2, 4096] and head j of GDN layer l
    has the (j * 8 + l)-th shortest, so every layer has a head in each quarter of the range."""
    import numpy as np
    import torch
    from transformers import Qwen3_5ForCausalLM

    train = _train_script()
    cfg = train.make_config("v3", 512, {"bos": 1, "eos": 2, "pad": 0})
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    train.init_gdn_gates_spread(model, 2.0, 4096.0)
    got = np.array([[1.0 / (1.0 - np.exp(-np.exp(la.A_log.detach().double().numpy())
                                              * np.log1p(np.exp(la.dt_bias.detach().double().numpy()))))]
                    for la in (l.linear_attn for l in model.model.layers if hasattr(l, "linear_attn"))])[:, 0]
    want = np.geomspace(2.0, 4096.0, 32).reshape(4, 8).T  # [layer, head]
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_v3b_is_v3_with_attention_in_every_multikey_sample_and_a_longer_plan():
    """--preset v3b (prepared for the next GPU session, scripts/demo/README.md): v3's architecture; its parsed
    recipe differs from v3's only in the multi-key samples' attention-drop chance (0), the attention-keep phase
    (the first 35% of the plan) and the planned minutes (24); a command-line value still overrides the recipe."""
    train = _train_script()
    v3 = train.parse_args(["--out", "x", "--preset", "v3"])
    v3b = train.parse_args(["--out", "x", "--preset", "v3b"])
    assert train.PRESETS["v3b"] == train.PRESETS["v3"]
    diff = {k for k in train.RECIPE_DEFAULTS if getattr(v3, k) != getattr(v3b, k)}
    assert diff == {"attn_drop_by_task", "attn_keep_until", "plan_minutes"}
    assert v3.plan_minutes is None and v3b.plan_minutes == 24.0
    changed = {t for t in v3.attn_drop_by_task if v3.attn_drop_by_task[t] != v3b.attn_drop_by_task[t]}
    assert changed == {"niah_multikey_2", "niah_multikey_3"}
    assert v3b.attn_drop_by_task["niah_multikey_2"] == v3b.attn_drop_by_task["niah_multikey_3"] == 0.0
    assert train.parse_args(["--out", "x", "--preset", "v3b", "--plan-minutes", "10"]).plan_minutes == 10.0


def test_v3b_keeps_attention_in_the_first_part_of_the_plan_and_draws_the_same_drops_after_it(tmp_path):
    """--attn-keep-until (v3b: 0.35 of the plan): no sample's attention is zeroed before the cut; from the cut on,
    the drop mask and the data are the ones a run without the keep phase draws at that step."""
    import sys

    import numpy as np

    train = _train_script()
    sys.path.insert(0, str(Path(train.__file__).parent))  # the data loader imports synth beside train.py
    assert train.parse_args(["--out", "x", "--preset", "v3b"]).attn_keep_until == 0.35
    assert train.parse_args(["--out", "x", "--preset", "v3"]).attn_keep_until == 0.0
    with pytest.raises(SystemExit):
        train.parse_args(["--out", "x", "--preset", "v3b", "--attn-keep-until", "1.5"])
    text = tmp_path / "text.npy"
    np.save(text, np.random.default_rng(0).integers(10, 8000, 200_000).astype(np.int32))
    tok = str(DEMO_DIR / "tokenizer.json")
    ids = {"bos": 1, "eos": 2, "pad": 0}

    def batches(keep):
        a = train.parse_args(["--out", "x", "--preset", "v3b", "--total-steps", "100", "--tokens-per-step", "4096",
                              "--attn-keep-until", str(keep)])
        return train.Batches(a, tok, str(text), ids)

    kept, plain = batches(0.35), batches(0.0)
    assert train.attention_kept(34, kept.a) and not train.attention_kept(35, kept.a)
    x, _, _, d, st = kept[20]
    x0, _, _, d0, st0 = plain[20]
    assert int(d.sum()) == 0 == st["attn_dropped"] and int(d0.sum()) > 0 and bool((x == x0).all())
    for step in (35, 60):
        x, _, m, d, _ = kept[step]
        x0, _, m0, d0, _ = plain[step]
        assert bool((x == x0).all()) and bool((m == m0).all()) and bool((d == d0).all()) and int(d.sum()) > 0
