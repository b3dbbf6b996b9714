"""Loading: every family from a checkpoint folder, the multimodal Qwen3.5 checkpoint as a text decoder, and the
specific error for each kind of bad path or config."""
import json

import pytest
import torch

import tiny_models
from gdnviz import errors, runner
from gdnviz.models import inspect_model, load

MM_TEXT = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
               max_position_embeddings=4096)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_load_saved_checkpoint_of_each_family(tmp_path, family):
    model = getattr(tiny_models, family)()
    model.save_pretrained(tmp_path)
    lm = load(tmp_path, device="cpu", load_tokenizer=False)
    assert lm.info.family == family and lm.info.kernel_path == "torch" and lm.info.dtype == "float32"
    assert lm.info.num_heads == 4 and lm.info.d_k == lm.info.d_v == 16 and len(lm.info.fingerprint) == 16
    x = torch.randint(0, 97, (1, 70))
    with torch.no_grad():
        ref = model(input_ids=x).logits
    out = runner.forward(lm, x, segment_len=32, logits_positions="all")
    torch.testing.assert_close(out.logits, ref, atol=2e-5, rtol=1e-4)
    assert load(tmp_path, device="cpu", load_tokenizer=False).info.fingerprint == lm.info.fingerprint


def test_multimodal_qwen35_loads_as_text_decoder(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vc = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    m = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=MM_TEXT, vision_config=vc)).eval()
    m.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    lm = load(tmp_path, device="cpu", load_tokenizer=False)
    assert type(lm.model).__name__ == "Qwen3_5ForCausalLM" and lm.info.gdn_layers == (0, 1, 2)
    x = torch.randint(0, 97, (1, 50))
    with torch.no_grad():
        ref = m.model.language_model(input_ids=x).last_hidden_state
    out = runner.forward(lm, x, segment_len=16)
    torch.testing.assert_close(out.hidden, ref, atol=2e-5, rtol=1e-4)


def test_not_a_model_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(errors.NotAModelDirectory, match="config.json"):
        load(tmp_path)
    with pytest.raises(errors.NotAModelDirectory, match="a file"):
        load(tmp_path / "notes.txt")


def test_config_without_gdn_layers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(errors.NotAGDNModel, match="found layer types"):
        inspect_model(tmp_path)
    cfg = dict(MM_TEXT, model_type="qwen3_5_text", layer_types=["full_attention"] * 4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.NotAGDNModel, match="full_attention ×4"):
        inspect_model(tmp_path)


def test_unsupported_family_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "some_hybrid", "layer_types": ["linear_attention", "full_attention"]}))
    with pytest.raises(errors.UnsupportedFamily, match="Qwen3.5.*Qwen3-Next.*fla"):
        inspect_model(tmp_path)


def test_weights_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(MM_TEXT, model_type="qwen3_5_text")))
    with pytest.raises(errors.WeightsMissing, match="no weight files"):
        inspect_model(tmp_path)


def test_hub_id_not_in_cache_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(errors.ModelNotFound, match="hf download"):
        inspect_model("nobody/not-a-model")
    with pytest.raises(errors.ModelNotFound):
        inspect_model("/definitely/not/here")


def test_auto_map_code_is_not_run_without_trust_remote_code(tmp_path):
    """A checkpoint that ships its own code (auto_map) loads with the built-in class: its code is never imported."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5_text", "auto_map": {"AutoConfig": "evil.Config"}, **MM_TEXT}))
    torch.manual_seed(0)
    tiny_models.qwen3_5().save_pretrained(tmp_path / "w")
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "w" / "model.safetensors").read_bytes())
    info = inspect_model(tmp_path)  # auto_map is ignored: the built-in qwen3_5_text class is used
    assert info["family"] == "qwen3_5"


def _saved_tiny(tmp_path):
    model = tiny_models.qwen3_5()
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("text,message", [
    ('{"model_type": "qwen3_5", ', "config.json is not valid JSON"),
    ('[{"model_type": "qwen3_5"}]', "config.json holds a list, not a JSON object"),
])
def test_config_that_is_not_a_json_object_names_the_file(tmp_path, text, message):
    ck = _saved_tiny(tmp_path)
    (ck / "config.json").write_text(text)
    with pytest.raises(errors.BadConfig, match=message) as e:
        inspect_model(ck)
    assert str(ck / "config.json") in str(e.value)


@pytest.mark.parametrize("how", ["truncated", "garbled header"])
def test_damaged_safetensors_get_a_specific_message(tmp_path, how):
    ck = _saved_tiny(tmp_path)
    f = ck / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if how == "truncated" else data[:8] + b"\x00garbage" + data[16:])
    with pytest.raises(errors.BadWeights, match="model.safetensors") as e:
        load(ck, device="cpu", load_tokenizer=False)
    assert "damaged or truncated" in str(e.value)
