"""The "Trust remote code" box on Model & documents (AppTest, jobs run in-process by the worker's code): off by
default with a line saying what ticking it does, a warning once ticked, never offered for the demo; a model that
needs its own code says to tick it (and its code does not run); ticked, the model is inspected and captured with
its code and the run remembers it; choosing another model unticks it."""
from __future__ import annotations

from app_fixtures import build_remote_code_checkpoint, short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz.store import Store
from test_app_pages import app, env, progress, texts, work  # noqa: F401  (fixture)

WARNING = ("the worker imports and runs those `.py` files from the model folder on this machine, with your user's "
           "permissions")


def _page(cache):
    at = app()
    at.run()
    work(cache)
    at.run()
    assert not at.exception
    return at


def test_the_box_is_off_by_default_says_what_it_does_and_is_not_offered_for_the_demo(env, tmp_path):
    cache = env(tmp_path / "c")
    at = _page(cache)
    box = at.checkbox(key="trust_remote_code")
    assert box.label == "Trust remote code" and box.value is False
    assert any("ticking it runs that code on this machine" in c for c in texts(at, "caption"))
    assert not any(WARNING in w for w in texts(at, "warning"))
    box.check().run()
    assert any(WARNING in w and "Remote code is trusted for this model" in w for w in texts(at, "warning"))
    assert at.session_state["inspect"]["key"][-1] is True  # the model is inspected again, trusted
    at.radio(key="model_source").set_value("demo").run()
    assert not at.exception and "trust_remote_code" not in [c.key for c in at.checkbox]
    at.radio(key="model_source").set_value("path").run()
    assert at.checkbox(key="trust_remote_code").value is False  # another choice unticked it


def test_a_model_that_needs_its_code_says_to_tick_the_box_then_runs_with_it(env, tmp_path):
    cache = env(tmp_path / "c")
    ck, marker = build_remote_code_checkpoint(tmp_path / "ck")
    at = _page(cache)
    at.text_input(key="model_path").set_value(str(ck)).run()
    work(cache)
    at.run()
    errs = texts(at, "error")
    assert any(f"Cannot use **{ck}**" in e and "model_type 'my_gdn' is defined only by the checkpoint's own Python "
               "code" in e and "tick 'Trust remote code' on the Model & documents page" in e
               and e.endswith("Or pick another model.")
               for e in errs), errs
    assert not marker.exists()  # nothing of its code ran

    at.checkbox(key="trust_remote_code").check().run()
    assert any("Inspecting" in t for t in progress(at))
    work(cache)
    at.run()
    assert not at.exception and not texts(at, "error")
    assert marker.exists()
    table = " ".join(texts(at, "markdown"))
    assert "qwen3_5 (`my_gdn`)" in table and "3 of 4" in table
    assert any("runs the checkpoint's own code (modeling_my_gdn.py)" in c for c in texts(at, "caption"))

    at.text_area(key="paste_text").input(short_text(150))
    at.button(key="paste_add").click().run()
    at.number_input(key="segment_len").set_value(64)
    at.button(key="run_capture").click().run()
    store = Store(cache)
    assert store.job(at.session_state["capture_job"])["spec"]["trust_remote_code"] is True
    work(cache)
    at.run()
    assert any("Captured 1 document" in t for t in texts(at, "success")), texts(at, "error")
    run = store.run(at.session_state["run_id"])
    assert run["spec"]["trust_remote_code"] is True and run["model"]["model_type"] == "my_gdn"

    # another folder: the box is unticked, and this model asks for it again
    at.text_input(key="model_path").set_value(str(ck) + "/").run()
    assert at.checkbox(key="trust_remote_code").value is False
    work(cache)
    at.run()
    assert any("tick 'Trust remote code'" in e for e in texts(at, "error"))
