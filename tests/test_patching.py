"""gdnviz.patching: state patching between prompts, on real models (the bundled demo model, a tiny Qwen3.5).

Exactness: a head's own state patched into its own run changes nothing, bit for bit (logits at every position and
every GDN state); every GDN head of A patched into B at the last boundary before B's question is exactly A's states
there; the float64 reference recurrence (gdnviz.gdn.reference) from the donor state reproduces the fast path's
patched state. Then the comparison (answers, the continuation loss against an independent computation, the memo),
the needle pairs, bad input, the job in a real worker process.
"""
import numpy as np
import pytest
import torch

import tiny_models
from app_fixtures import tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import patching, runner
from gdnviz.attribution import head_inputs
from gdnviz.errors import EmptyHeadSet, HeadOutOfRange, LayerNotGDN, ModelMismatch, PositionOutOfRange, UnknownTask
from gdnviz.gdn import reference
from gdnviz.models import from_model, load
from gdnviz.patching import PatchCallback, PatchSpec


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


class Finals:
    """Every GDN layer's final state (batch row 0) and nothing else."""

    modifies_state = False

    def __init__(self):
        self.states = {}

    def on_layer_end(self, layer, position, state):
        self.states[layer] = state[0].clone()


def run(lm, ids, L, callbacks):
    fin = Finals()
    out = runner.forward(lm, torch.as_tensor(ids).reshape(1, -1), segment_len=L, callbacks=[*callbacks, fin],
                         logits_positions="all", keep_hidden=False)
    return out.logits, fin.states


@pytest.fixture(scope="module")
def demo(one_thread):
    return load("demo", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def pair(demo):
    return patching.needle_pair(demo.tokenizer, 700, 3)


def all_heads(info):
    return [(l, h) for l in info.gdn_layers for h in range(info.num_heads)]


# --- exactness --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [[(5, 1)], "all"])
def test_a_state_patched_into_its_own_run_changes_nothing_bit_for_bit(demo, heads):
    ids = torch.randint(10, 8000, (300,), generator=torch.Generator().manual_seed(2))
    heads = all_heads(demo.info) if heads == "all" else heads
    rec = PatchCallback(demo.info, heads, 128)
    base_logits, base_states = run(demo, ids, 64, [rec])
    donor = rec.seen
    assert donor.position == 128 and donor.states.shape == (len(heads), 128, 128) and donor.states.abs().sum() > 0
    logits, states = run(demo, ids, 64, [PatchCallback(demo.info, heads, 128, donor)])
    assert torch.equal(logits, base_logits)
    assert all(torch.equal(states[l], base_states[l]) for l in demo.info.gdn_layers)
    plain_logits, plain_states = run(demo, ids, 64, [])  # on the CPU also the run without any callback
    assert torch.equal(plain_logits, base_logits)
    assert all(torch.equal(plain_states[l], base_states[l]) for l in demo.info.gdn_layers)


def test_every_gdn_head_of_a_patched_into_b_is_a_s_states_at_the_boundary(demo, pair):
    L = 128
    b = patching.last_boundary(pair.b_question, L)
    assert b > pair.needles[0][1]  # the needle lies before the boundary in A
    heads = all_heads(demo.info)
    rec_a = PatchCallback(demo.info, heads, b)
    run(demo, pair.a.input_ids, L, [rec_a])
    after = PatchCallback(demo.info, heads, b)  # sees what the next segment reads
    own = PatchCallback(demo.info, heads, b)
    run(demo, pair.b_ids, L, [own])
    logits, _ = run(demo, pair.b_ids, L, [PatchCallback(demo.info, heads, b, rec_a.seen), after])
    assert torch.equal(after.seen.states, rec_a.seen.states)
    assert not torch.equal(own.seen.states, rec_a.seen.states)  # B's own states differ (no needle)
    base_logits, _ = run(demo, pair.b_ids, L, [PatchCallback(demo.info, heads, b)])
    assert torch.equal(logits[0, :b], base_logits[0, :b]) and not torch.equal(logits[0, b:], base_logits[0, b:])


@pytest.mark.gpu
def test_patching_on_cuda_is_exact_and_agrees_with_the_cpu(demo, pair):
    """On CUDA (fla's kernels, the demo model in float32): a run's own states patched into it change nothing bit
    for bit; every head of A patched into B at B's last boundary is A's states there, exactly; the patched logits
    agree with the CPU's patched logits as closely as the two devices' unpatched runs agree (within a factor 2)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the H200 through the device tool)")
    gpu = load("demo", device="cuda", dtype="float32")
    L = 128
    b = patching.last_boundary(pair.b_question, L)
    heads = all_heads(gpu.info)
    rec = PatchCallback(gpu.info, heads, b)
    base, base_states = run(gpu, pair.b_ids, L, [rec])
    same, same_states = run(gpu, pair.b_ids, L, [PatchCallback(gpu.info, heads, b, rec.seen)])
    assert torch.equal(same, base) and all(torch.equal(same_states[l], base_states[l]) for l in gpu.info.gdn_layers)
    rec_a = PatchCallback(gpu.info, heads, b)
    run(gpu, pair.a.input_ids, L, [rec_a])
    after = PatchCallback(gpu.info, heads, b)
    patched, _ = run(gpu, pair.b_ids, L, [PatchCallback(gpu.info, heads, b, rec_a.seen), after])
    assert torch.equal(after.seen.states, rec_a.seen.states)
    assert not torch.equal(patched[0, b:], base[0, b:])
    cpu_a = PatchCallback(demo.info, heads, b)
    run(demo, pair.a.input_ids, L, [cpu_a])
    cpu, _ = run(demo, pair.b_ids, L, [PatchCallback(demo.info, heads, b, cpu_a.seen)])
    cpu_base, _ = run(demo, pair.b_ids, L, [])
    # the devices' kernels differ (fla's chunk kernel rounds its float32 products as TF32): patching may add no
    # disagreement beyond what the same unpatched run already shows between them
    plain = float((base.cpu() - cpu_base).abs().max())
    diff = float((patched.cpu() - cpu).abs().max())
    print(f"CUDA vs CPU, max |logit difference|: unpatched {plain:.3g}, patched {diff:.3g}")
    assert diff <= 2 * plain + 1e-6


def test_float64_reference_from_the_donor_state_agrees_with_the_fast_path():
    """Tiny Qwen3.5 (float32): layer 1 head 2 of B gets A's state after 32 tokens at B's boundary 48 (L = 16). The
    float64 recurrence over A's own core inputs gives the donor state, and from the donor over B's inputs after
    token 48 the patched run's final state; the unpatched head 1 of that layer follows B's own recurrence. Measured
    1.6e-7 and 1.3e-7 (float32 cores over ≤ 80 tokens); tolerance 1e-5."""
    lm = from_model(tiny_models.qwen3_5(), "tiny")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 97, (64,), generator=g), torch.randint(0, 97, (80,), generator=g)
    rec = PatchCallback(lm.info, [(1, 2)], 32)
    run(lm, a, 16, [rec])
    ia = head_inputs(lm, a, 1, 2, 32, segment_len=16)
    _, s_a = reference.recurrent(ia.q[:, None], ia.k[:, None], ia.v[:, None], ia.g[:, None], ia.beta[:, None])
    assert rel(rec.seen.states[0].double(), s_a[0]) < 1e-5
    _, finals = run(lm, b, 16, [PatchCallback(lm.info, [(1, 2)], 48, rec.seen)])
    ib = head_inputs(lm, b, 1, 2, 80, segment_len=16)
    x = [t[48:, None] for t in (ib.q, ib.k, ib.v, ib.g, ib.beta)]
    _, want = reference.recurrent(*x, initial_state=rec.seen.states.double())
    assert rel(finals[1][2].double(), want[0]) < 1e-5
    _, unpatched = reference.recurrent(*(t[:, None] for t in (ib.q, ib.k, ib.v, ib.g, ib.beta)))
    assert rel(unpatched[0], want[0]) > 1e-2  # the patch changed the head's state
    i1 = head_inputs(lm, b, 1, 1, 80, segment_len=16)
    _, other = reference.recurrent(*(t[:, None] for t in (i1.q, i1.k, i1.v, i1.g, i1.beta)))
    assert rel(finals[1][1].double(), other[0]) < 1e-5


# --- the comparison ---------------------------------------------------------------------------------------------
def test_needle_pair(demo, pair):
    a, tok = pair.a, demo.tokenizer
    assert a.answers[0] in a.prompt and a.answers[0] not in pair.b_prompt
    assert a.prompt.count("\n") == pair.b_prompt.count("\n")
    (s, e), = pair.needles
    assert tok.decode(a.input_ids[s:e]).strip() .startswith("One of the special magic numbers for")
    assert tok.decode(a.input_ids[s:e]).strip().endswith(f"{a.answers[0]}.")
    for ids, q in ((a.input_ids, pair.a_question), (pair.b_ids, pair.b_question)):
        assert tok.decode(ids[q:]).lstrip().startswith("What is the special magic number for")
    assert a.input_ids[pair.a_question:] == pair.b_ids[pair.b_question:]  # the same question and answer prefix
    with pytest.raises(UnknownTask, match="noise haystack.*niah_single_1.*got 'vt'"):
        patching.needle_pair(tok, 700, 3, "vt")


def test_patch_prompts_compares_answers_and_loss_and_memoises(demo, pair):
    """Layer 5 head 1 of the needle prompt into its twin: the comparison's losses against token_nll (an independent
    computation: the plain run's cross-entropy over the whole document); the memo answers the same request."""
    from gdnviz.probes.loss import token_nll

    x = patching.pair_inputs(pair, demo.tokenizer, 128)
    spec = PatchSpec(heads="5:1", boundary=x["boundary"], segment_len=128, max_new_tokens=8)
    memo: dict = {}
    res = patching.patch_prompts(demo, x["a_ids"], x["b_ids"], spec, continuation=x["continuation"],
                                 references=x["references"], store=memo)
    assert not res["memo_hit"] and list(memo) == [res["memo_key"]] and res["memo_key"].startswith("patch:")
    assert res["heads"] == [[5, 1]] and res["boundary"] == res["source"] == x["boundary"]
    c, n = x["continuation"], len(x["b_ids"])
    nll = token_nll(demo, x["b_ids"] + c, segment_len=128)[n - 1:]
    np.testing.assert_allclose(res["loss"]["nll_B"], nll, rtol=1e-4, atol=1e-5)
    assert res["loss"]["delta"] == pytest.approx(np.mean(res["loss"]["nll_patched"]) - np.mean(nll), abs=1e-5)
    assert res["loss"]["n"] == len(c) and res["continuation"] == dict(tokens=c, given=True)
    (st,) = res["states"]
    assert (st["layer"], st["head"]) == (5, 1) and st["rel_change"] > 0
    t = patching.comparison_table(res)
    assert list(t.columns) == patching.compare.COMPARISON_COLUMNS and t["run"].tolist() == list(patching.compare.RUNS)
    assert t["prompt_tokens"].tolist() == [len(x["a_ids"]), n, n]
    assert t["delta_loss"].iloc[2] == res["loss"]["delta"] and t["delta_loss"].iloc[1] == 0
    assert res["scores"]["A"] == 100.0 and t["score"].tolist() == [res["scores"][k] for k in patching.compare.RUNS]
    again = patching.patch_prompts(demo, x["a_ids"], x["b_ids"], spec, continuation=x["continuation"],
                                   references=x["references"], store=memo)
    assert again["memo_hit"] and again["answers"] == res["answers"]
    other = patching.patch_key(demo.info, x["a_ids"], x["b_ids"], PatchSpec(heads="5:0", boundary=x["boundary"],
                               segment_len=128, max_new_tokens=8), [(5, 0)], x["continuation"])
    assert other != res["memo_key"]


def test_without_a_continuation_the_loss_is_on_b_s_own_answer(demo):
    ids = demo.tokenizer("The grass is green. The sky is blue. " * 12, add_special_tokens=False)["input_ids"]
    res = patching.patch_prompts(demo, ids[::-1], ids, PatchSpec(heads="4:0,5:1", boundary=64, segment_len=64,
                                                                 max_new_tokens=4))
    assert res["continuation"] == dict(tokens=res["answers"]["B"]["tokens"], given=False)
    assert res["loss"]["n"] == len(res["answers"]["B"]["tokens"]) == 4 and res["scores"] == {}


# --- bad input --------------------------------------------------------------------------------------------------
def test_bad_input_gets_clear_errors(demo):
    info = demo.info
    a, b = list(range(10, 310)), list(range(20, 220))

    def check(**kw):
        return patching.check_patch(PatchSpec(**{"boundary": 128, "segment_len": 64, **kw}), info, len(a), len(b))

    assert check(heads="layers:5") == [(5, 0), (5, 1)] and len(check()) == 12
    with pytest.raises(LayerNotGDN, match=r"layer 3 \(a full-attention layer\).*\[0, 1, 2, 4, 5, 6\]"):
        check(heads="3:0")
    with pytest.raises(LayerNotGDN, match=r"layer 7 \(a full-attention layer\)"):
        check(heads="layers:4,7")
    with pytest.raises(HeadOutOfRange, match=r"head 2 .*0\.\.1"):
        check(heads=[(4, 2)])
    with pytest.raises(EmptyHeadSet):
        check(heads="")
    with pytest.raises(ValueError, match="expected 'all'"):
        check(heads="five")
    with pytest.raises(PositionOutOfRange, match=r"boundary 256 is beyond prompt B \(200 tokens\).*64\.\.192"):
        check(boundary=256)
    with pytest.raises(PositionOutOfRange, match=r"boundary 320 is beyond prompt A \(300 tokens\)"):
        check(source=320)
    with pytest.raises(PositionOutOfRange, match="boundary 100 of prompt B is not a boundary.*multiple of the "
                                                 "segment length 64"):
        check(boundary=100)
    with pytest.raises(ModelMismatch, match="fingerprint 0123"):
        check(fingerprint="0123")
    tiny = from_model(tiny_models.qwen3_5(), "tiny")
    rec = PatchCallback(tiny.info, [(0, 0)], 16)
    run(tiny, torch.arange(32) % 97, 16, [rec])
    with pytest.raises(ModelMismatch, match="donor states come from model fingerprint"):
        PatchCallback(info, [(0, 0)], 64, rec.seen)
    with pytest.raises(ValueError, match=r"hold heads \[\(0, 0\)\], the patch asks for \[\(0, 1\)\]"):
        PatchCallback(tiny.info, [(0, 1)], 16, rec.seen)


# --- the worker -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_patch_job_in_a_worker_process_is_memoised(tmp_path, tiny_checkpoint):  # noqa: F811
    """A PatchJob through a real worker process and its diskcache store: the comparison, then the same job from the
    memo, then a full-attention layer refused with its message."""
    import subprocess
    import sys
    from pathlib import Path

    from app_fixtures import short_text
    from gdnviz import jobs
    from gdnviz.store import Store

    root = Path(__file__).resolve().parent.parent
    store = Store(tmp_path / "cache")
    p = subprocess.Popen([sys.executable, "-m", "gdnviz.worker", "--cache-dir", str(tmp_path / "cache"), "--poll",
                          "0.05"], cwd=str(root), env=dict(__import__("os").environ, PYTHONPATH=str(root)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        spec = jobs.PatchJob(model=str(tiny_checkpoint), prompt_a=short_text(200, 1), prompt_b=short_text(150, 2),
                             heads="1:2,3:0", segment_len=64, max_new_tokens=4)
        rec = store.wait(store.submit("patch", jobs.spec_to_dict(spec)), timeout=300)
        assert rec["status"] == "done", rec.get("error")
        res = rec["result"]
        assert not res["memo_hit"] and res["heads"] == [[1, 2], [3, 0]] and res["boundary"] % 64 == 0
        assert set(res["answers"]) == {"A", "B", "B patched"} and res["loss"]["n"] == 4
        again = store.wait(store.submit("patch", jobs.spec_to_dict(spec)), timeout=120)["result"]
        assert again["memo_hit"] and again["answers"] == res["answers"]
        bad = jobs.PatchJob(model=str(tiny_checkpoint), prompt_a="one two three", prompt_b="four five six",
                            heads="2:0", segment_len=1, max_new_tokens=2)
        rec = store.wait(store.submit("patch", jobs.spec_to_dict(bad)), timeout=120)
        assert rec["status"] == "failed" and rec["error_type"] == "LayerNotGDN" and "layer 2" in rec["error"], rec
    finally:
        p.terminate()
        p.wait(20)


# --- the page's logic -------------------------------------------------------------------------------------------
def test_page_logic_validates_and_builds_the_job(demo):
    from gdnviz import jobs
    from gdnviz.ui import patching as UP

    info = demo.info.to_dict()
    assert UP.check_heads("layers:5", info) == [(5, 0), (5, 1)] and len(UP.check_heads("all", info)) == 12
    with pytest.raises(LayerNotGDN, match=r"layer 7 \(a full-attention layer\)"):
        UP.check_heads("7:0", info)
    UP.check_position(0, 256, "Boundary of B")
    UP.check_position(512, 256, "Boundary of B")
    with pytest.raises(ValueError, match="Boundary of B 300 is not a boundary.*L = 256"):
        UP.check_position(300, 256, "Boundary of B")
    d = UP.job_dict("demo", "cpu", "float32", info, source="needle", heads="5:1", L=256, boundary=0, from_a=0,
                    max_new_tokens=16, continuation="", target_len=1024, seed=4)
    spec = jobs.spec_from_dict(d)
    assert isinstance(spec, jobs.PatchJob) and spec.task == "niah_single_1" and spec.seed == 4
    assert spec.fingerprint == demo.info.fingerprint and spec.heads == "5:1"
    d = UP.job_dict("demo", "cpu", "float32", info, source="texts", heads=" ", L=64, boundary=128, from_a=64,
                    max_new_tokens=4, continuation="x", prompt_a="a", prompt_b="b")
    spec = jobs.spec_from_dict(d)
    assert (spec.task, spec.prompt_a, spec.heads, spec.boundary, spec.source) == ("", "a", "all", 128, 64)
