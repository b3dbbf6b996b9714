"""What the job pages say around a run (AppTest on the tiny checkpoint, jobs run in-process by the real Worker):
a reopened loss result does not claim it was computed now, a result under a changed form says so (Loss vs rank,
State patching), the patching form survives leaving the page, lengths are called targets, a one-prompt comparison
is called an anecdote, and the budget form says what its test can accept at n and δ — checked here against every
outcome of small n."""
from __future__ import annotations

import itertools

import pytest

from app_fixtures import short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz.probes import budget, ruler
from test_app_pages import app, capture, env, texts, work  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def populated(tmp_path_factory, tiny_checkpoint):  # noqa: F811
    """A cache directory holding one run: two short documents, L = 64."""
    d = tmp_path_factory.mktemp("notes")
    run = capture(d, tiny_checkpoint, (("alpha", short_text(300, 0)), ("beta", short_text(260, 3))))
    return d, run


def stale(at) -> list[str]:
    return [w for w in texts(at, "warning") if "other settings than the form" in w]


# --- Loss vs rank ---------------------------------------------------------------------------------------------------
def test_loss_result_says_when_it_was_computed_and_when_the_form_has_changed(env, populated):
    cache, run = populated
    env(cache)
    at = app("loss", run=run)
    at.run()
    at.text_input(key="ls_ranks").input("2")
    at.number_input(key="ls_dist").set_value(16).run()
    at.button(key="ls_run").click().run()
    jid = at.session_state["loss_job"]
    work(cache)
    at.run()
    assert not at.exception
    assert any("(4 computed now, 0 read from the store)" in m for m in texts(at, "markdown"))
    assert any("Over 2 documents the paired standard error has 1 degree of freedom: a 95% interval is Δ ± 12.7·SE"
               in c for c in texts(at, "caption")), texts(at, "caption")
    assert not stale(at)
    at.text_input(key="ls_ranks").input("3").run()
    assert [w for w in stale(at) if "The loss result below" in w and "(ranks changed)" in w], texts(at, "warning")
    at.text_input(key="ls_ranks").input("2").run()
    assert not stale(at)

    # another session reopens it from the list: its losses were computed when it ran, not now
    at2 = app("loss", run=run)
    at2.run()
    at2.text_input(key="ls_ranks").input("2")
    at2.number_input(key="ls_dist").set_value(32).run()
    at2.selectbox(key="ls_prev").set_value(jid).run()
    md = " ".join(texts(at2, "markdown"))
    assert "computed now" not in md and "(4 computed when it ran (" in md
    assert [w for w in stale(at2) if "(copy distance d changed)" in w], texts(at2, "warning")


# --- State patching -------------------------------------------------------------------------------------------------
def test_patching_form_survives_leaving_the_page_says_what_it_runs_and_when_a_result_is_older(env, populated):
    cache, run = populated
    env(cache)
    at = app("patching", run=run)
    at.run()
    at.number_input(key="pt_len").set_value(400)
    at.number_input(key="pt_seed").set_value(3)
    at.text_input(key="pt_heads").input("1:0")
    at.number_input(key="pt_new").set_value(4).run()
    caps = texts(at, "caption")
    assert any("The length is a target" in c and "at most 272 tokens" in c and "real count is shown with the "
               "result" in c for c in caps), caps
    assert any("3 greedy generations" in c and "up to 4 new tokens" in c and "**5 passes over a prompt**" in c
               for c in caps), caps
    at.switch_page("pages/heatmap.py").run()
    at.switch_page("pages/patching.py").run()
    assert not at.exception
    assert (at.number_input(key="pt_len").value, at.number_input(key="pt_seed").value,
            at.text_input(key="pt_heads").value, at.number_input(key="pt_new").value) == (400, 3, "1:0", 4)
    at.button(key="pt_run").click().run()
    rec = work(cache)
    at.run()
    assert rec == 1 and not at.exception
    assert any(" · A " in m and " tokens, B " in m for m in texts(at, "markdown"))  # the real counts
    assert not stale(at)
    at.number_input(key="pt_new").set_value(5).run()
    assert [w for w in stale(at) if "The comparison below" in w and "(tokens to generate changed)" in w], \
        texts(at, "warning")


def test_patching_heads_follow_the_model(env, populated, tmp_path):
    """The heads field names one model's layers: another model opens on its own heads (its default until edited),
    and coming back gives the first model's edited heads again."""
    cache, run = populated
    env(cache)
    demo = capture(cache, "demo", (("gamma", short_text(200, 5)),))
    at = app("patching", run=run)
    at.run()
    assert at.text_input(key="pt_heads").value == "all"
    at.text_input(key="pt_heads").input("1:0").run()
    at.session_state["run_id"] = demo["run_id"]
    at.run()
    assert not at.exception
    assert at.text_input(key="pt_heads").value == "5:1"
    at.session_state["run_id"] = run["run_id"]
    at.run()
    assert at.text_input(key="pt_heads").value == "1:0"


# --- Truncate & compare ---------------------------------------------------------------------------------------------
def test_a_one_prompt_comparison_is_called_an_anecdote(env, populated):
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    at.number_input(key="tr_g0_r").set_value(1)
    at.number_input(key="tr_target_len").set_value(400)
    at.number_input(key="tr_max_new").set_value(4)
    at.checkbox(key="tr_loss_docs").uncheck().run()
    assert not [c for c in texts(at, "caption") if "n = 1" in c]  # said with the result, not before
    at.button(key="tr_run").click().run()
    work(cache)
    at.run()
    assert not at.exception
    assert any(c.startswith("One prompt (n = 1): a changed answer or score here is an anecdote") and
               "Retrieval sweeps" in c for c in texts(at, "caption")), texts(at, "caption")


# --- Head scans & budgets -------------------------------------------------------------------------------------------
def test_scan_and_budget_call_lengths_targets_and_the_budget_form_says_what_its_test_can_accept(env, tmp_path):
    cache = env(tmp_path / "c")
    at = app("scans")
    at.run()
    work(cache)
    at.run()
    assert not at.exception
    assert at.number_input(key="sc_length").label == "Target length (tokens)"
    assert at.text_input(key="bg_lengths").label == "Target lengths (tokens)"
    assert any("The length is a target: RULER builds the largest niah_single_1 sample" in c and "at most 896 tokens"
               in c and "real count" not in c for c in texts(at, "caption")), texts(at, "caption")
    at.multiselect(key="bg_tasks").set_value(["niah_single_1", "cwe"])
    at.number_input(key="bg_n").set_value(20)
    at.number_input(key="bg_tol").set_value(1.0).run()
    want = budget.acceptance_text(["niah_single_1", "cwe"], 20, 1.0, 0.05)
    assert want.startswith("At n = 20 and δ = 1 point, for a budget to pass: no answer of niah_single_1 (0/100), "
                           "cwe (steps of 10 points) may get worse unless others get better")
    assert "first passes at n = 266 for niah_single_1, 28 for cwe" in want
    caps = [c for c in texts(at, "caption") if c.startswith(want)]
    assert caps and "With n = 20, one changed answer moves a 0/100 score by 5 points" in caps[0], texts(at, "caption")
    at.number_input(key="bg_n").set_value(50).run()
    assert any(c.startswith("At n = 50 and δ = 1 point") and "with none better, at most 2 of the 50 answers of cwe"
               in c and "With n = " not in c for c in texts(at, "caption")), texts(at, "caption")


# --- the budget test's acceptance, against every outcome ------------------------------------------------------------
@pytest.fixture(scope="module")
def score_values(tiny_checkpoint):  # noqa: F811
    """task -> every score one sample of it can get: the scorer itself on the answers of a real sample (sized by
    the tiny checkpoint's tokenizer)."""
    from functools import cache

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))

    @cache
    def values(task: str) -> tuple:
        refs = list(ruler.generate(task, tok, 2048, 5, chat_template=False).answers)
        return tuple(sorted({ruler.score(task, [" ".join(refs[:j])], [refs]) for j in range(len(refs) + 1)}))

    return values


@pytest.mark.parametrize("task", list(ruler.TASK_NAMES))
def test_score_step_is_the_smallest_change_of_a_real_samples_score(task, score_values):
    vals = score_values(task)
    assert budget.score_step(task) == pytest.approx(min(b - a for a, b in zip(vals, vals[1:])), abs=1e-9)


@pytest.mark.parametrize("task, n_max", [("niah_single_1", 9), ("vt", 6), ("fwe", 7), ("cwe", 5)])
def test_losses_allowed_bounds_every_outcome_with_none_better(task, n_max, score_values):
    """Every multiset of per-sample differences with none better (from the task's real score values) that passes
    ``noninferiority`` has at most ``losses_allowed`` answers worse, and k answers a step worse pass exactly for
    k ≤ losses_allowed; ``one_loss_n`` is the first n where one does."""
    vals = score_values(task)
    drops = sorted({round(a - b, 9) for a in vals for b in vals if a < b})
    step = budget.score_step(task)
    for n in range(2, n_max + 1):
        for tol in (1.0, 0.3 * step, 0.45 * step, 0.6 * step, 0.9 * step):
            k_max = budget.losses_allowed(n, tol, 0.05, step)
            for d in itertools.combinations_with_replacement([0.0] + drops, n):
                worse = sum(x < 0 for x in d)
                if worse and budget.noninferiority(d, tol, 0.05)["passed"]:
                    assert worse <= k_max, (n, tol, d)
            for k in range(1, n + 1):
                passed = budget.noninferiority([-step] * k + [0.0] * (n - k), tol, 0.05)["passed"]
                assert passed == (k <= k_max), (n, tol, k)
    for tol in (1.0, 5.0, 0.45 * step):
        m = budget.one_loss_n(tol, 0.05, step)
        assert budget.losses_allowed(m, tol, 0.05, step) >= 1
        assert m == 2 or budget.losses_allowed(m - 1, tol, 0.05, step) == 0


def test_acceptance_text_at_the_seed_settings():
    assert budget.acceptance_text(["niah_single_1"], 10, 1.0) == (
        "At n = 10 and δ = 1 point, for a budget to pass: no answer of niah_single_1 (0/100) may get worse unless "
        "others get better to make up for it (one answer a step worse, the rest unchanged, first passes at n = 266 "
        "for niah_single_1).")
    # a worse answer offset by better ones can pass at small n: the "unless" is needed
    assert budget.noninferiority([-100.0] + [100.0] * 9, 1.0, 0.05)["passed"]
    big = budget.acceptance_text(["niah_single_1", "vt"], 300, 1.0)
    assert "with none better, at most 1 of the 300 answers of niah_single_1 (0/100), 9 of vt (steps of 20 points) " \
           "may get worse" in big
    assert "δ is at least one score step of cwe (steps of 10 points)" in budget.acceptance_text(["cwe"], 20, 10.0)


def test_cli_budget_prints_what_its_test_can_accept(tiny_checkpoint, tmp_path, capsys):  # noqa: F811
    from gdnviz.cli import main

    assert main(["budget", str(tiny_checkpoint), "--tasks", "niah_single_1", "--lengths", "400", "--n", "2",
                 "--n-heldout", "0", "--tolerance", "5", "--ladder", "1", "--batch", "2", "--max-new-tokens", "4",
                 "--out", str(tmp_path / "b"), "--device", "cpu", "--dtype", "float32"]) == 0
    assert budget.acceptance_text(["niah_single_1"], 2, 5.0, 0.05) in capsys.readouterr().err


def test_few_documents_note_gives_the_t_factor_of_the_paired_se():
    from gdnviz.ui import loss as LS

    assert "no standard error" in LS.few_documents_note(1)
    assert "Δ ± 12.7·SE" in LS.few_documents_note(2) and "1 degree of" in LS.few_documents_note(2)
    assert "Δ ± 2.3·SE" in LS.few_documents_note(9) and "8 degrees" in LS.few_documents_note(9)
    assert LS.few_documents_note(10) is None
