"""trust_remote_code: a checkpoint with its own code (config.json ``auto_map``, ``tests/app_fixtures``'s
``build_remote_code_checkpoint``: a Qwen3.5 decoder that doubles its token embeddings) is never run unless asked;
one that needs it says to tick the box; trusted, it loads as its supported family, and its results never share
a memo key with those of the built-in class or of an edited copy of its code."""
from __future__ import annotations

import numpy as np
import pytest

from app_fixtures import build_remote_code_checkpoint, short_text
from gdnviz import errors, jobs
from gdnviz.models import inspect_model, load
from gdnviz.models.loader import fingerprint
from gdnviz.store import Store
from gdnviz.worker import Worker


def test_a_model_defined_only_by_its_own_code_asks_for_the_box_and_runs_nothing(tmp_path):
    ck, marker = build_remote_code_checkpoint(tmp_path)
    for call in (lambda: inspect_model(ck), lambda: load(ck, device="cpu")):
        with pytest.raises(errors.NeedsRemoteCode) as e:
            call()
        msg = str(e.value)
        assert f"{ck}: model_type 'my_gdn' is defined only by the checkpoint's own Python code" in msg
        assert "AutoModelForCausalLM → modeling_my_gdn.MyGDNForCausalLM" in msg
        assert "tick 'Trust remote code' on the Model & documents page" in msg and "--trust-remote-code" in msg
    assert not marker.exists()  # its code never ran
    lm = load(ck, device="cpu", trust_remote_code=True)
    assert marker.exists() and type(lm.model).__name__ == "MyGDNForCausalLM"
    assert (lm.info.family, lm.info.model_type, lm.info.gdn_layers) == ("qwen3_5", "my_gdn", (0, 1, 3))


def test_a_config_class_of_no_supported_family_is_refused_even_trusted(tmp_path):
    ck, marker = build_remote_code_checkpoint(tmp_path)
    code = (ck / "modeling_my_gdn.py").read_text()
    code = code.replace("class MyGDNConfig(Qwen3_5TextConfig):", "from transformers import PretrainedConfig\n\n\n"
                        "class MyGDNConfig(PretrainedConfig):")
    (ck / "modeling_my_gdn.py").write_text(code)
    with pytest.raises(errors.UnsupportedFamily, match="config class MyGDNConfig \\(model_type 'my_gdn'\\) derives "
                                                       "from none of the supported families' configs"):
        inspect_model(ck, trust_remote_code=True)


def test_trusted_and_untrusted_results_of_one_folder_never_share_a_memo_key(tmp_path):
    """model_type qwen3_5_text with its own model class: untrusted, transformers' class loads it; trusted, its
    code (other states). Through the worker's model pool and the memo: the trusted capture is computed, not reused,
    its states differ; editing the code changes the trusted fingerprint only."""
    ck, marker = build_remote_code_checkpoint(tmp_path, "qwen3_5_text")
    store = Store(tmp_path / "cache")
    w = Worker(store)
    spec = dict(model=str(ck), documents=(("d", short_text(120, 2)),), segment_len=64, device="cpu")
    plain = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(**spec)))
    trusted = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(**spec, trust_remote_code=True)))
    again = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(**spec)))
    w.run_pending(max_jobs=1)
    assert not marker.exists()  # untrusted: its code never ran
    assert w.run_pending() == 2 and marker.exists()
    recs = [store.job(j) for j in (plain, trusted, again)]
    assert [r["status"] for r in recs] == ["done"] * 3, [r["error"] for r in recs]
    res = [r["result"] for r in recs]
    assert [(r["computed"], r["reused"]) for r in res] == [(1, 0), (1, 0), (0, 1)]
    assert res[0]["run_id"] != res[1]["run_id"] and res[2]["run_id"] == res[0]["run_id"]
    runs = [store.run(r["run_id"]) for r in res[:2]]
    assert runs[0]["model"]["fingerprint"] == fingerprint(ck) != runs[1]["model"]["fingerprint"]
    assert runs[1]["spec"]["trust_remote_code"] is True and runs[0]["spec"]["trust_remote_code"] is False
    a, b = (jobs.load_run_captures(store, r)[0] for r in runs)
    assert a.sv.shape == b.sv.shape and not np.allclose(a.sv, b.sv)  # the doubled embeddings change the states
    before = fingerprint(ck, True)
    (ck / "modeling_my_gdn.py").write_text((ck / "modeling_my_gdn.py").read_text().replace("2.0 *", "3.0 *"))
    assert fingerprint(ck, True) != before and fingerprint(ck) == runs[0]["model"]["fingerprint"]


def test_trust_without_code_in_the_folder_changes_nothing(tmp_path):
    from app_fixtures import build_checkpoint

    ck = build_checkpoint(tmp_path)
    assert fingerprint(ck, True) == fingerprint(ck)
    assert inspect_model(ck, trust_remote_code=True) == inspect_model(ck)
