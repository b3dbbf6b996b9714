"""``device_map`` placement (``gdnviz.models.placement``): bad maps, one-device maps equal to the plain load, the
accelerate-hooked path on CPU, the worker's model cache and the CLI; the GPU tests (one H200: layers offloaded to
"cpu" next to "cuda:0"; two GPUs: layers on cuda:0 and cuda:1) compare with the one-device run.

"auto" and maps over several devices need accelerate (transformers applies them with its hooks): those tests are
skipped without it.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from gdnviz.capture import capture_document
from gdnviz.errors import BadDeviceMap
from gdnviz.generate import greedy_generate
from gdnviz.models import load
from gdnviz.probes.batch import batched_greedy
from gdnviz.probes.loss import token_nll
from gdnviz.truncation import TruncationSpec

try:
    import accelerate  # noqa: F401
    HAVE_ACCELERATE = True
except ImportError:
    HAVE_ACCELERATE = False
needs_accelerate = pytest.mark.skipif(not HAVE_ACCELERATE, reason="needs accelerate (requirements.txt)")

CAPTURE_FIELDS = ("positions", "sv", "final_state", "g", "beta", "key_mean", "key_sample", "key_sample_pos")


def _layer_map(lm, device_of_layer) -> dict:
    """Every module named (embeddings, each decoder layer, norm, rotary, lm_head): decoder layer i on
    ``device_of_layer(i)``, the other modules with the first layer (before the layers) or the last (after)."""
    n = lm.info.num_layers
    m, seen_layers = {}, False
    for name, _ in lm.model.model.named_children():
        if name == "layers":
            m.update({f"model.layers.{i}": device_of_layer(i) for i in range(n)})
            seen_layers = True
        else:
            m[f"model.{name}"] = device_of_layer(n - 1 if seen_layers else 0)
    # tied embeddings (the demo model, the tiny ones) stay with the input embeddings
    tied = lm.model.get_output_embeddings().weight is lm.model.get_input_embeddings().weight
    m["lm_head"] = m[next(iter(m))] if tied else device_of_layer(n - 1)
    return m


def _ids(lm, n: int, seed: int = 0) -> list:
    g = np.random.default_rng(seed)
    return g.integers(3, lm.info.vocab_size, size=n).tolist()


def _same_capture(a, b) -> None:
    for f in CAPTURE_FIELDS:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    for k in a.keycone:
        np.testing.assert_array_equal(a.keycone[k], b.keycone[k], err_msg=k)


def _cut(lm, r: int = 2) -> TruncationSpec:
    return TruncationSpec.uniform([(layer, h) for layer in lm.info.gdn_layers for h in range(lm.info.num_heads)], r)


def _same_runs(plain, other, n_tokens: int, segment_len: int = 64) -> None:
    """Capture statistics, truncated losses and truncated greedy answers (alone and batched) equal bit for bit."""
    ids = _ids(plain, n_tokens)
    _same_capture(capture_document(plain, ids, segment_len), capture_document(other, ids, segment_len))
    spec = _cut(plain)
    np.testing.assert_array_equal(token_nll(plain, ids, segment_len=segment_len, spec=spec),
                                  token_nll(other, ids, segment_len=segment_len, spec=spec))
    a = greedy_generate(plain, ids, 8, segment_len=segment_len, spec=spec, stop_ids=())
    b = greedy_generate(other, ids, 8, segment_len=segment_len, spec=spec, stop_ids=())
    assert a.tokens == b.tokens and len(a.tokens) == 8
    prompts = [ids, ids[: n_tokens - 37]]
    ga = batched_greedy(plain, prompts, 6, segment_len=segment_len, spec=spec, stop_ids=())
    gb = batched_greedy(other, prompts, 6, segment_len=segment_len, spec=spec, stop_ids=())
    assert [g.tokens for g in ga] == [g.tokens for g in gb]


@pytest.fixture(scope="module")
def demo_plain():
    return load("demo", device="cpu", dtype="float32")


# --- bad maps --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, words", [
    ({"": "cpu", "model.nonesuch": "cpu"}, ["'model.nonesuch'", "does not have", "model.layers.0"]),
    ({"model.embed_tokens": "cpu", "model.layers": "cpu"}, ["leaves", "'model.norm'", "'model.rotary_emb'"]),
    ({"": "cuda:7"}, ["device_map['']", "'cuda:7'", "does not exist"]),
    ({"": "tpu"}, ["'tpu'", "is not a device"]),
    ({"": "disk"}, ["'disk'", "no disk"]),
    ({"": "cpu", "model.layers.1.linear_attn": "cpu"}, ["splits a decoder layer", "'model.layers.1.linear_attn'",
                                                        "'model.layers.1'"]),
    ("balanced", ["'auto' or a JSON object", "'balanced'"]),
    ('{"model.layers": cpu}', ["not valid JSON"]),
    ({}, ["non-empty"]),
    ({"": True}, ["True", "not a device"]),
])
def test_a_bad_map_names_the_problem(bad, words):
    with pytest.raises(BadDeviceMap) as e:
        load("demo", dtype="float32", device_map=bad, load_tokenizer=False)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_tied_embeddings_must_share_a_device():
    """Checked on the meta model (this machine has no second device for the map to name)."""
    from gdnviz.models import placement
    from gdnviz.models.loader import _meta_model, read_config, resolve

    meta = _meta_model(read_config(resolve("demo"))[0], torch.float32, False)
    with pytest.raises(BadDeviceMap) as e:
        placement.check_modules(meta, {"": "cpu", "lm_head": "cuda:0"})
    assert "'model.embed_tokens' on 'cpu' and 'lm_head' on 'cuda:0'" in str(e.value)
    assert "ties their weights" in str(e.value)
    placement.check_modules(meta, {"": "cpu", "lm_head": "cpu"})


@pytest.mark.skipif(HAVE_ACCELERATE, reason="accelerate is installed here")
def test_auto_without_accelerate_says_what_to_install():
    with pytest.raises(BadDeviceMap, match="needs the accelerate package.*pip install"):
        load("demo", device_map="auto", load_tokenizer=False)


def test_device_and_device_map_exclude_each_other():
    with pytest.raises(BadDeviceMap, match="'cpu'.*not both"):
        load("demo", device="cpu", device_map="auto", load_tokenizer=False)


def test_where_each_module_executes_under_a_map():
    """transformers' semantics, from the map alone: the most specific entry wins, "cpu" next to a GPU is offloaded
    and executes on the lowest-index GPU of the map (handed to transformers as ints, so that accelerate's main device
    is that one)."""
    from gdnviz.models import placement

    dmap = placement.parse({"": 1, "model.layers.3": "cpu", "model.layers": "cuda:0", "lm_head": "cuda"})
    assert dmap == {"": "cuda:1", "model.layers.3": "cpu", "model.layers": "cuda:0", "lm_head": "cuda:0"}
    assert placement.main_device(dmap) == torch.device("cuda:0")
    assert placement.device_of(dmap, "model.layers.3") == torch.device("cuda:0")  # offloaded
    assert placement.device_of(dmap, "model.layers.30") == torch.device("cuda:0")  # not under 'model.layers.3'
    assert placement.device_of(dmap, "model.norm") == torch.device("cuda:1")
    assert placement.for_transformers(dmap) == {"": 1, "model.layers.3": "cpu", "model.layers": 0, "lm_head": 0}
    assert placement.spans_devices(dmap) and not placement.spans_devices({"a": "cpu", "b": "cpu"})
    cpu_only = {"a": "cpu", "b": "cpu"}
    assert placement.main_device(cpu_only) == torch.device("cpu") == placement.device_of(cpu_only, "a.x")
    assert placement.text(dmap) == placement.text(dict(reversed(list(dmap.items()))))


# --- maps on one device ------------------------------------------------------------------------------------------
def test_explicit_cpu_map_is_the_plain_load(demo_plain):
    dmap = _layer_map(demo_plain, lambda i: "cpu")
    lm = load("demo", dtype="float32", device_map=json.dumps(dmap))
    assert lm.info.device == "cpu" and lm.info.device_map == () and lm.info.memo_device == "cpu"
    assert lm.info.to_dict() == demo_plain.info.to_dict()
    _same_runs(demo_plain, lm, 300)


@needs_accelerate
def test_auto_on_a_cpu_machine_is_the_plain_cpu_load(demo_plain):
    if torch.cuda.is_available():
        pytest.skip("'auto' spreads over the GPUs here")
    lm = load("demo", device_map="auto")  # dtype auto: float32, as on the CPU
    assert (lm.info.device, lm.info.dtype, lm.info.device_map, lm.info.kernel_path) == ("cpu", "float32", (), "torch")
    ids = _ids(lm, 200, seed=3)
    _same_capture(capture_document(demo_plain, ids, 64), capture_document(lm, ids, 64))


def test_tiny_checkpoint_with_a_map_equals_the_plain_load(tmp_path):
    from checkpoints import tiny_qwen35_checkpoint

    path = tiny_qwen35_checkpoint(tmp_path)
    plain = load(str(path), device="cpu", dtype="float32")
    mapped = load(str(path), dtype="float32", device_map={"": "cpu"})
    assert mapped.info.fingerprint == plain.info.fingerprint and mapped.info.device_map == ()
    _same_runs(plain, mapped, 200)


# --- the hooked path (what a map over several devices runs), on the CPU --------------------------------------------
@needs_accelerate
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "fla_gdn"])
def test_accelerate_hooks_leave_every_result_unchanged(family):
    """accelerate's device hooks on every module (``force_hooks``: what transformers attaches for a map over
    several devices) and gdnviz's layer hooks together: the same capture, losses and answers as the bare model."""
    from accelerate import dispatch_model

    import tiny_models
    from gdnviz.models import from_model

    plain = from_model(getattr(tiny_models, family)(seed=2))
    hooked_model = getattr(tiny_models, family)(seed=2)
    hooked = from_model(hooked_model)
    dispatch_model(hooked_model, device_map=_layer_map(plain, lambda i: "cpu"), force_hooks=True,
                   skip_keys=hooked_model._skip_keys_device_placement)
    assert hasattr(hooked_model.model.layers[0], "_hf_hook")
    _same_runs(plain, hooked, 200)


# --- where a spread model's results are keyed ----------------------------------------------------------------------
def test_memo_device_of_a_spread_model_names_its_map(demo_plain):
    two = dataclasses.replace(demo_plain.info, device="cuda:0",
                              device_map=tuple(sorted(_layer_map(demo_plain, lambda i: f"cuda:{i % 2}").items())))
    other = dataclasses.replace(two, device_map=tuple(sorted(_layer_map(demo_plain, lambda i: f"cuda:{i // 4}")
                                                             .items())))
    assert demo_plain.info.memo_device == "cpu"
    assert two.memo_device.startswith("map-") and two.memo_device != other.memo_device
    assert two.to_dict()["device_map"]["model.layers.1"] == "cuda:1"
    assert "device_map" not in demo_plain.info.to_dict()


def test_the_workers_model_cache_holds_the_map(tmp_path):
    from gdnviz.store import Store
    from gdnviz.worker import Worker

    w = Worker(Store(tmp_path / "cache"))
    plain = w.model("demo", "cpu", "float32", "")
    assert w.model("demo", "cpu", "float32", "") is plain
    mapped = w.model("demo", "auto", "float32", '{"": "cpu"}')
    assert mapped is not plain and w._lm_key[3] == '{"":"cpu"}'
    assert w.model("demo", "auto", "float32", '{ "" : "cpu" }') is mapped  # the same map, written differently
    with pytest.raises(BadDeviceMap, match="'cuda:5'"):
        w.model("demo", "auto", "float32", '{"": "cuda:5"}')


def test_capture_job_with_a_map_through_the_worker(tmp_path):
    from gdnviz import jobs
    from gdnviz.store import Store
    from gdnviz.worker import Worker

    store = Store(tmp_path / "cache")
    w = Worker(store)
    docs = (("a.txt", "The quick brown fox jumps over the lazy dog. " * 12),)
    res = {}
    for dm in ("", '{"": "cpu"}'):
        jid = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(model="demo", documents=docs, segment_len=64,
                                                                         device="auto" if dm else "cpu",
                                                                         dtype="float32", device_map=dm)))
        w.run_pending()
        rec = store.job(jid)
        assert rec["status"] == "done", rec.get("error")
        res[dm] = rec["result"]
    # a map that puts everything on one device is the plain load there: the same run, its captures shared
    assert res[""]["run_id"] == res['{"": "cpu"}']["run_id"]
    bad = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(model="demo", documents=docs, dtype="float32",
                                                                     device_map='{"model.layers": "cpu"}')))
    w.run_pending()
    rec = store.job(bad)
    assert rec["status"] == "failed" and rec["error_type"] == "BadDeviceMap" and "leaves" in rec["error"]


def test_cli_device_map(tmp_path, capsys):
    from gdnviz.capture import CaptureResult
    from gdnviz.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("A small document about states and segments. " * 10)
    mapfile = tmp_path / "map.json"
    mapfile.write_text(json.dumps({"": "cpu"}))
    assert main(["capture", "demo", str(doc), "--out", str(tmp_path / "plain"), "--device", "cpu",
                 "--dtype", "float32", "--segment-len", "64"]) == 0
    assert main(["capture", "demo", str(doc), "--out", str(tmp_path / "mapped"), "--device-map", str(mapfile),
                 "--dtype", "float32", "--segment-len", "64"]) == 0
    _same_capture(CaptureResult.load(tmp_path / "plain" / "doc.capture.npz"),
                  CaptureResult.load(tmp_path / "mapped" / "doc.capture.npz"))
    capsys.readouterr()
    assert main(["capture", "demo", str(doc), "--out", str(tmp_path / "x"), "--device-map",
                 '{"model.layerz": "cpu", "": "cpu"}']) == 2
    err = capsys.readouterr().err
    assert "BadDeviceMap" in err and "'model.layerz'" in err
    assert main(["capture", "demo", str(doc), "--out", str(tmp_path / "x"), "--device-map", "nosuch.json"]) == 2
    assert "no such file" in capsys.readouterr().err


# --- GPU: the single H200, and two GPUs ------------------------------------------------------------------------------
def _gpu_compare(dmap_of, n_tokens: int = 1024) -> None:
    """Float32 (where the runner's and the StaticCache's decode agree token for token): a map against the whole
    model on cuda:0; a 256-token segment length on fla's chunk grid."""
    plain = load("demo", device="cuda:0", dtype="float32")
    spread = load("demo", dtype="float32", device_map=dmap_of(plain))
    assert spread.info.device_map and spread.info.memo_device.startswith("map-")
    _same_runs(plain, spread, n_tokens, segment_len=256)


@pytest.mark.gpu
@needs_accelerate
def test_gpu_gdn_layers_on_cpu_and_cuda0():
    """Half the decoder layers mapped to "cpu" next to "cuda:0": accelerate offloads their weights to host memory
    and runs them on cuda:0 (transformers' semantics), the rest live on cuda:0."""
    _gpu_compare(lambda lm: _layer_map(lm, lambda i: "cpu" if i % 2 else "cuda:0"))


@pytest.mark.gpu
@needs_accelerate
def test_gpu_gdn_layers_on_two_gpus():
    """GDN layers on cuda:0 and cuda:1 (every other decoder layer): each layer's scan, truncation and statistics on
    its own GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _gpu_compare(lambda lm: _layer_map(lm, lambda i: f"cuda:{i % 2}"))
