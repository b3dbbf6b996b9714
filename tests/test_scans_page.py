"""The Head scans & budgets page (AppTest, jobs run in-process by the real Worker on the tiny checkpoint): the
plan, bad input refused with its message, a scan and a budget through the worker, the heatmap click (the head
panel under the heatmap), the hand-off
of a budget to Retrieval sweeps."""
from __future__ import annotations

import json

import pyarrow as pa

from app_fixtures import short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz.store import Store
from test_app_pages import app, capture, charts, chart_titles, env, texts, work  # noqa: F401  (fixtures)


def captions(at) -> list[str]:
    return texts(at, "caption")


def scans_page(cache):
    """The page in a new session: it asks for the model's inspection first (answered from the store)."""
    at = app("scans")
    at.run()
    work(cache)
    at.run()
    assert not at.exception, at.exception
    return at


def test_scan_plan_and_bad_input(env, tmp_path):
    cache = env(tmp_path / "c")
    at = scans_page(cache)
    assert any("3 units → 4 settings (the baseline included) × 20 samples = **80 answers**: none in the memo yet, "
               "**80 to run**, no estimate yet (no earlier run of niah_single_1" in c
               for c in captions(at)), captions(at)
    for key, value, message in (("sc_r", 16, "r = 16 keeps every state untouched"),
                                ("sc_length", 20, "Length 20 is too short for niah_single_1: it needs at least"),
                                ("sc_limit", 10, "over the prompt limit of 10")):
        old = at.number_input(key=key).value
        at.number_input(key=key).set_value(value).run()
        assert any(message in e for e in texts(at, "error")), (key, texts(at, "error"))
        assert at.button(key="sc_run").proto.disabled
        at.number_input(key=key).set_value(old).run()
    assert not texts(at, "error")
    at.checkbox(key="sc_keep").check().run()
    at.radio(key="sc_by").set_value("head").run()
    at.multiselect(key="sc_layers").select(3).run()
    assert any("4 units → 6 settings (the baseline included) × 20 samples" in c for c in captions(at))
    # budget bad input
    at.number_input(key="bg_tol").set_value(0.0).run()
    assert any("A tolerance must be > 0 points: 0.0 is not" in e for e in texts(at, "error"))
    assert at.button(key="bg_run").proto.disabled
    at.number_input(key="bg_tol").set_value(1.0)
    at.text_input(key="bg_ladder").input("4, 99").run()
    assert any("rank 99 of the ladder is outside 1..16" in e for e in texts(at, "error"))
    at.text_input(key="bg_ladder").input("4, 1")
    at.multiselect(key="bg_tasks").set_value([]).run()
    assert any("No tasks chosen" in e for e in texts(at, "error"))
    assert Store(cache).queued_count() == 0


def test_scan_and_budget_previews_build_their_prompts_once_per_form(env, tmp_path, monkeypatch):
    """Reruns of an unchanged form build no prompt (scan and budget previews); a changed n builds that form's
    prompts and its counts follow; the memo's share is still read on every run."""
    from gdnviz.probes import sweep

    built = []
    orig = sweep.samples_for
    monkeypatch.setattr(sweep, "samples_for", lambda tok, spec: built.append(spec.n) or orig(tok, spec))
    cache = env(tmp_path / "c")
    at = scans_page(cache)
    at.number_input(key="sc_n").set_value(7).run()  # a form no earlier test built
    at.number_input(key="bg_n").set_value(3).run()
    assert any("× 7 samples = **" in c for c in captions(at)), captions(at)
    first = len(built)
    assert first > 0
    for _ in range(2):
        at.run()
    at.checkbox(key="sc_keep").check().run()  # the same prompts, other settings: keys only
    assert len(built) == first and not at.exception
    at.number_input(key="sc_n").set_value(5).run()
    assert len(built) > first and built[-1] == 5
    assert any("× 5 samples = **" in c for c in captions(at)), captions(at)
    at.number_input(key="sc_n").set_value(7).run()  # back to the first form: its prompts are still there
    assert built[-1] == 5 and any("× 7 samples = **" in c for c in captions(at))


def test_scan_and_budget_through_the_worker(env, tmp_path, tiny_checkpoint):
    cache = env(tmp_path / "c")
    at = scans_page(cache)
    at.number_input(key="sc_length").set_value(400)
    at.number_input(key="sc_n").set_value(2)
    at.number_input(key="sc_r").set_value(2)
    at.number_input(key="sc_batch").set_value(2)
    at.number_input(key="sc_max_new").set_value(6).run()
    assert not texts(at, "error")
    at.button(key="sc_run").click().run()
    assert at.session_state["scan_job"] and work(cache) == 1
    at.run()
    assert not at.exception, at.exception
    rec = Store(cache).job(at.session_state["scan_job"])
    assert rec["status"] == "done", rec.get("error")
    assert rec["result"]["computed"] == 8
    ch = [c for c in charts(at) if c.key == "sc_heat"]
    assert ch and "cell" in list(ch[0].proto.selection_mode)
    spec = json.loads(ch[0].proto.spec)
    assert spec["encoding"]["color"]["scale"]["domainMid"] == 0
    assert "paired SE (points)" in {t["title"] for t in spec["encoding"]["tooltip"]}
    data = pa.ipc.open_stream(ch[0].proto.datasets[0].data.data).read_all().to_pandas()
    assert len(data) == 12 and set(data["unit"]) == {"layer 0", "layer 1", "layer 3"}
    ranked = at.dataframe[0].value
    assert list(ranked.columns)[:4] == ["unit", "score (%)", "baseline (%)", "Δ (points)"] and len(ranked) == 3
    # the target length and the prompts' real token counts (one per sample)
    toks = rec["result"]["prompt_tokens"]
    assert [(t["task"], t["length"], t["seed"]) for t in toks] == [("niah_single_1", 400, 0), ("niah_single_1", 400, 1)]
    assert all(0 < t["n_tokens"] <= 400 for t in toks)
    lo, hi = min(t["n_tokens"] for t in toks), max(t["n_tokens"] for t in toks)
    span = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    assert any(f"at length 400 the prompts have {span} tokens (2 prompts)" in c for c in captions(at)), captions(at)
    # the plan now counts the memo
    assert any("8 of 8 already done (in the memo), **0 to run**, nothing to generate" in c
               for c in captions(at)), captions(at)
    assert not texts(at, "warning")
    # a changed form: the preview counts the new answers, and the shown scan says it is not of these settings
    at.number_input(key="sc_n").set_value(3).run()
    assert any("**12 answers**: 8 of 12 already done (in the memo), **4 to run**, about " in c for c in captions(at))
    assert any("The scan below was run with other settings than the form shows now (samples n changed)" in w
               for w in texts(at, "warning")), texts(at, "warning")
    at.number_input(key="sc_n").set_value(2).run()
    assert not texts(at, "warning")
    # a click on the scan heatmap shows that head in the panel under it, on this page (pick mode is not offered
    # here: the Heatmap's choice does not apply); no capture of the model yet: the panel says so
    at.session_state["click_action"] = "pick"
    at.session_state["sc_heat"] = {"selection": {"cell": [{"layer": 1, "head": 2}]}}
    at.run()
    assert not at.exception and [t.value for t in at.title] == ["Head scans & budgets"]
    assert at.query_params["layer"] in (["1"], "1") and at.query_params["head"] in (["2"], "2")
    assert (at.session_state["layer"], at.session_state["head"]) == (1, 2)
    assert "picked_heads" not in at.session_state or not at.session_state["picked_heads"]
    heading = [m for m in texts(at, "markdown") if m.startswith("### Layer ")]
    assert len(heading) == 1 and heading[0].startswith("### Layer 1 · head 2  \n")
    assert "no capture of this model is open in this session" in heading[0]
    spec = json.loads([c for c in charts(at) if c.key == "sc_heat"][0].proto.spec)
    assert "click a cell to see that head below" in spec["title"]["subtitle"]
    # a capture of the scanned model in this session: the panel shows the head's numbers, spectrum and link
    run = capture(cache, tiny_checkpoint, (("alpha", short_text(200, 0)),))
    at.session_state["run_id"] = run["run_id"]
    at.run()
    assert not at.exception
    heading = [m for m in texts(at, "markdown") if m.startswith("### Layer ")]
    assert len(heading) == 1 and heading[0].startswith("### Layer 1 · head 2  \n") and run["run_id"] in heading[0]
    assert [m.label for m in at.metric][:6] == ["Effective rank", "Numerical rank", "Horizon", "Mean key norm",
                                                "Key-cov erank", "r for 99% energy"]
    assert "Singular spectrum at the document end" in chart_titles(at)
    links = {l.proto.label: l.proto for l in at.get("page_link")}
    assert links["Open the full head page"].query_string == "layer=1&head=2"
    at.button(key="head_panel_close").click().run()
    assert not [m for m in texts(at, "markdown") if m.startswith("### Layer ")] and "layer" not in at.query_params
    # budget
    at = scans_page(cache)
    at.multiselect(key="bg_tasks").set_value(["niah_single_1"])
    at.text_input(key="bg_lengths").input("400")
    at.number_input(key="bg_n").set_value(2)
    at.number_input(key="bg_tol").set_value(5.0)
    at.text_input(key="bg_curve").input("10")
    at.text_input(key="bg_ladder").input("4, 1")
    at.number_input(key="bg_max_new").set_value(6).run()
    assert not texts(at, "error"), texts(at, "error")
    at.button(key="bg_run").click().run()
    assert work(cache) == 1
    at.run()
    assert not at.exception, at.exception
    rec = Store(cache).job(at.session_state["budget_job"])
    assert rec["status"] == "done", rec.get("error")
    summ = rec["result"]["budgets"][0]
    labels = [m.label for m in at.metric]
    assert "Recurrent state, full rank" in labels and "With the δ = 5 budget" in labels
    assert at.metric[0].value == f"{3 * 4 * 16 * 16 * 4 / 1024:,.1f} KiB"
    assert "budget_curve" in [c.key for c in charts(at)] or any("score vs recurrent-state memory" in t
                                                                for t in chart_titles(at))
    if summ["rank_map"]:
        at.button(key="bg_to_sweeps").click().run()
        assert not at.exception
        assert at.session_state["sw_rank_maps"].startswith("budget_d5: ")
        assert at.text_area(key="sw_rank_maps").value.startswith("budget_d5: ")
        # the same rank map opened on Truncate & compare: one head list per rank, the same per-head ranks
        at.switch_page("pages/scans.py").run()
        at.button(key="bg_to_truncate").click().run()
        assert not at.exception, at.exception
        want = {f"{l}:{h}": r for l, h, r in summ["rank_map"]}
        assert at.session_state["tr_rank_map"] == want
        assert len(at.session_state["tr_groups"]) == len(set(want.values()))
        assert all(at.session_state[f"tr_g{g}_mode"] == "heads" for g in at.session_state["tr_groups"])
        # the Truncate page shows those groups and runs exactly the budget's per-head ranks
        assert not texts(at, "error")
        assert [at.number_input(key=f"tr_g{g}_r").value for g in at.session_state["tr_groups"]] == \
            sorted(float(r) for r in set(want.values()))
        at.switch_page("pages/truncate.py").run()  # AppTest reruns the page it last switched to, not st.switch_page's
        assert at.multiselect(key="tr_g0_list").value  # the groups are still there
        at.button(key="tr_run").click().run()
        sent = Store(cache).job(at.session_state["truncate_job"])["spec"]["ranks"]
        assert [list(x) for x in sent] == sorted([list(x) for x in summ["rank_map"]])


def _counting_prompts(monkeypatch) -> list:
    """Every ``ruler.generate_many`` call's prompt tokens (n × target length) in a list; a call that takes the
    total over the page's preview bound fails there (so a page that builds every prompt fails at once)."""
    from gdnviz.probes import ruler
    from gdnviz.ui.common import PREVIEW_TOKENS

    built = []
    real = ruler.generate_many

    def counted(task, tok, target_len, n, *a, **kw):
        built.append(int(n) * int(target_len))
        assert sum(built) <= PREVIEW_TOKENS, f"the preview built {sum(built):,} prompt tokens in one run"
        return real(task, tok, target_len, n, *a, **kw)

    monkeypatch.setattr(ruler, "generate_many", counted)
    return built


def test_a_large_n_builds_at_most_the_preview_bound_and_leaves_the_rest_to_the_job(env, tmp_path, monkeypatch):
    """n = 5,000 (scan and budget): the page renders, each run builds at most ``PREVIEW_TOKENS`` of prompt tokens
    (none of these forms: each is over it), and the plans say the job reads the memo for them; the lengths are
    checked against the smallest prompt of the seeds the bound allows and the caption names those it left to the
    job. A budget whose search fits but whose held-out samples do not counts the search's answers in the memo and
    names the held-out ones it left."""
    from gdnviz.ui.common import PREVIEW_TOKENS

    cache = env(tmp_path / "c")
    at = scans_page(cache)
    built = _counting_prompts(monkeypatch)
    at.number_input(key="sc_length").set_value(1024)
    at.number_input(key="sc_n").set_value(5000)
    at.text_input(key="bg_lengths").input("1024")
    at.number_input(key="bg_n").set_value(5000).run()
    assert not at.exception, at.exception
    assert sum(built) <= PREVIEW_TOKENS
    caps = captions(at)
    assert any("× 5000 samples = **20,000 answers**: the memo is read when the job starts (too many prompts to "
               "build on this page; the job skips what it holds), " in c for c in caps), caps
    assert any("Sensitivity scans 130,000 answers (too many prompts to build on this page: the job reads the memo "
               "for niah_single_1, vt at 1,024 tokens)" in c for c in caps), caps
    assert any("niah_single_1 seeds 0.." in c and "of seeds 0..4999; the job checks the other seeds before any "
               "model call" in c for c in caps), caps
    assert any("of seeds 0..9999; the job checks the other seeds before any model call" in c for c in caps), caps
    errs = texts(at, "error")
    assert any("This scan would run up to 20,000 answers" in e and "over the prompt limit of 2,000" in e
               for e in errs), errs
    # the search's 2 × 100 × 1,024 tokens fit the bound, the held-out check's as many more do not
    assert 2 * 100 * 1024 <= PREVIEW_TOKENS < 4 * 100 * 1024
    built.clear()
    at.number_input(key="bg_n").set_value(100).run()
    assert not at.exception, at.exception
    assert 0 < sum(built) <= PREVIEW_TOKENS
    caps = captions(at)
    assert any("Sensitivity scans 2,600 answers (none in the memo yet)" in c and "the held-out check 400 (too many "
               "prompts to build on this page: the job reads the memo for niah_single_1, vt at 1,024 tokens)" in c
               for c in caps), caps


def test_scan_and_budget_whose_prompts_cannot_fit_in_memory_are_refused_before_any_prompt(env, tmp_path,
                                                                                      monkeypatch):
    """With 4 GiB available, n = 10,000 at 32,768 tokens (about 12 GiB of prompts): the scan and the budget are
    refused with the sweeps' memory message before a prompt is built, and neither Run is offered."""
    from types import SimpleNamespace

    import psutil

    from gdnviz.probes import ruler

    cache = env(tmp_path / "c")
    at = scans_page(cache)

    def no_prompts(*a, **kw):
        raise AssertionError("a prompt was built before the form's size was checked")

    monkeypatch.setattr(ruler, "generate_many", no_prompts)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 << 30))
    at.number_input(key="sc_length").set_value(32_768)
    at.number_input(key="sc_n").set_value(10_000)
    at.text_input(key="bg_lengths").input("32768")
    at.number_input(key="bg_n").set_value(10_000).run()
    assert not at.exception, at.exception
    errs = texts(at, "error")
    assert any("the prompts of this scan would not fit in memory: n = 10,000 samples × 1 task(s)" in e
               for e in errs), errs
    assert any("the prompts of this budget (10,000 search and 10,000 held-out samples per task and length) would "
               "not fit in memory: n = 20,000 samples × 2 task(s)" in e for e in errs), errs
    assert at.button(key="sc_run").proto.disabled and at.button(key="bg_run").proto.disabled
