"""docs/reliability.md, generated: every bad input tried here is refused with its own gdnviz error and a message
that names the bad value; the store-fuzz, kill-under-load, crash-point, large-upload and cross-session cases and
the tests that cover them (the kill and crash-point tests' counts are read from the records they write).

``test_reliability_table_is_current`` fails when the file, up to the ``HAND_WRITTEN`` marker line, differs from what
this module generates; ``python tests/test_reliability_table.py`` rewrites that part and keeps the hand-written
sections after the marker as they are. Each row is run, not written down: a case whose error or
message changes fails here first.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import tiny_models  # noqa: E402
from gdnviz import documents as D  # noqa: E402
from gdnviz import errors as E  # noqa: E402

DOC = HERE.parent / "docs" / "reliability.md"
KILL_RECORD = HERE / "records" / "kill_under_load.json"  # written by tests/test_kill_under_load.py
CRASH_RECORD = HERE / "records" / "crash_points.json"  # written by tests/test_worker_crash_points.py
#: the line after the generated part of docs/reliability.md; what follows it is hand-written and kept as it is
HAND_WRITTEN = "<!-- Hand-written below this line: tests/test_reliability_table.py keeps it as it is. -->"


def _checkpoint(root: Path, damage=None) -> Path:
    out = root / f"ck{len(list(root.iterdir()))}"
    torch.manual_seed(0)
    tiny_models.qwen3_5().save_pretrained(out)
    if damage:
        damage(out)
    return out


def _cases(root: Path):
    """(bad input, where it is checked, callable that must raise, expected error type, words the message has)."""
    from gdnviz.jobs import ScanJob, SweepJob, run_scan_job, run_sweep_job
    from gdnviz.models import inspect_model, load
    from gdnviz.runner import check_segment_len
    from gdnviz.truncation import check_rank
    from gdnviz.probes import ruler
    from gdnviz.probes.budget import BudgetSpec
    from gdnviz.probes.budget import check_prompt_memory as budget_memory
    from gdnviz.probes.scan import ScanSpec
    from gdnviz.probes.scan import check_prompt_memory as scan_memory
    from gdnviz.probes.sweep import SweepSpec, check_prompt_memory
    from gdnviz.ui.sweeps import parse_lengths

    def cfg(text):
        return lambda ck: (ck / "config.json").write_text(text)

    def weights(fn):
        return lambda ck: (ck / "model.safetensors").write_bytes(fn((ck / "model.safetensors").read_bytes()))

    def no_weights(ck):
        (ck / "model.safetensors").unlink()

    def own_code(ck):  # a model type only its own (absent) code defines: refused before any code is looked at
        raw = json.loads((ck / "config.json").read_text())
        raw.update(model_type="my_gdn", auto_map={"AutoConfig": "modeling_my_gdn.MyGDNConfig"})
        (ck / "config.json").write_text(json.dumps(raw))

    def plain_qwen3(ck):
        (ck / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))

    up = D.decode_upload
    return [
        ("upload: a PNG renamed .txt", "documents.decode_upload", lambda: up("a.txt", b"\x89PNG\r\n\x1a\n\x00\x00"),
         E.NotText, "NUL byte at byte offset 8"),
        ("upload: Latin-1 text", "documents.decode_upload", lambda: up("a.txt", "café".encode("latin-1")),
         E.NotText, "byte 0xe9 at byte offset 3"),
        ("upload: UTF-16 (LE) text", "documents.decode_upload", lambda: up("a.txt", "hi".encode("utf-16")),
         E.NotText, "iconv -f UTF-16 -t UTF-8"),
        ("upload: UTF-16 (BE) text", "documents.decode_upload", lambda: up("a.txt", b"\xfe\xff\x00h\x00i"),
         E.NotText, "UTF-16 big-endian byte-order mark"),
        ("upload: UTF-32 text", "documents.decode_upload", lambda: up("a.txt", "hi".encode("utf-32")),
         E.NotText, "iconv -f UTF-32 -t UTF-8"),
        ("upload: empty file", "documents.decode_upload", lambda: up("a.txt", b""), E.EmptyDocument, "0 bytes"),
        ("upload: whitespace only", "documents.decode_upload", lambda: up("a.txt", b" \n\t "), E.EmptyDocument,
         "'a.txt' is empty"),
        ("upload: 1 MB for a 100-token limit", "documents.check_size", lambda: D.check_size("a.txt", 10 ** 6, 100, 32),
         E.DocumentTooLong, "at least 31,250 tokens, over the limit of 100"),
        ("document: over the token limit", "documents.check_length", lambda: D.check_length("a", 5000, 100),
         E.DocumentTooLong, "5,000 tokens, over the limit of 100"),
        ("token limit 0", "documents.check_token_limit", lambda: D.check_token_limit(0), E.BadTokenLimit, "got 0"),
        ("segment length 0", "runner.check_segment_len", lambda: check_segment_len(0), E.BadSegmentLength, "got 0"),
        ("segment length -64", "runner.check_segment_len", lambda: check_segment_len(-64), E.BadSegmentLength,
         "got -64"),
        ("rank 2.5", "truncation.check_rank", lambda: check_rank(2.5, upper=16), E.RankOutOfRange, "got 2.5"),
        ("rank 0", "truncation.check_rank", lambda: check_rank(0, upper=16), E.RankOutOfRange, "rank 0 is outside"),
        ("rank 17 of 16", "truncation.check_rank", lambda: check_rank(17, upper=16), E.RankOutOfRange,
         "rank 17 is outside 1..16"),
        ("sweep lengths '1024, x'", "ui.sweeps.parse_lengths", lambda: parse_lengths("1024, x"), ValueError, "'x'"),
        ("sweep lengths '0'", "ui.sweeps.parse_lengths", lambda: parse_lengths("0"), ValueError, "0 is not"),
        ("sweep job: length 99,999,999 (token limit 32,768)", "jobs.run_sweep_job",
         lambda: run_sweep_job(SweepJob(model="demo", tasks=("vt",), lengths=(1024, 99_999_999)), None),
         E.DocumentTooLong, "length 99,999,999 is over the token limit of 32,768"),
        ("scan job: length 99,999,999 (token limit 32,768)", "jobs.run_scan_job",
         lambda: run_scan_job(ScanJob(model="demo", task="vt", length=99_999_999), None),
         E.DocumentTooLong, "Scan length 99,999,999 is over the token limit of 32,768"),
        ("sweep: n = 10,000 × 6 tasks × 20 lengths near 32K (64 GiB available)", "probes.sweep.check_prompt_memory",
         lambda: check_prompt_memory(SweepSpec(model="m", tasks=ruler.TASK_NAMES, n=10_000,
                                               lengths=tuple(32_768 - i for i in range(20))), available=64 << 30),
         E.TooManyPrompts, "n = 10,000 samples × 6 task(s) × 20 length(s)"),
        ("scan: n = 10,000 at 32,768 tokens (4 GiB available)", "probes.scan.check_prompt_memory",
         lambda: scan_memory(ScanSpec(model="m", task="vt", length=32_768, n=10_000), available=4 << 30),
         E.TooManyPrompts, "the prompts of this scan would not fit in memory: n = 10,000 samples"),
        ("budget: n = 10,000 × 2 tasks at 32,768 tokens (4 GiB available)", "probes.budget.check_prompt_memory",
         lambda: budget_memory(BudgetSpec(model="m", tasks=("niah_single_1", "vt"), lengths=(32_768,), n=10_000),
                               available=4 << 30),
         E.TooManyPrompts, "10,000 search and 10,000 held-out samples"),
        ("RULER task 'needle'", "probes.ruler.generate", lambda: ruler.generate("needle", None, 100, 0),
         E.UnknownTask, "'needle'"),
        ("model 'nobody/nothing'", "models.resolve", lambda: inspect_model("nobody/nothing"), E.ModelNotFound,
         "not in the local Hugging Face cache"),
        ("model path: a folder without config.json", "models.resolve", lambda: inspect_model(root),
         E.NotAModelDirectory, "has no config.json"),
        ("config.json: not JSON", "models.read_raw_config", lambda: inspect_model(_checkpoint(root, cfg("{"))),
         E.BadConfig, "is not valid JSON"),
        ("config.json: a list", "models.read_raw_config", lambda: inspect_model(_checkpoint(root, cfg("[]"))),
         E.BadConfig, "holds a list"),
        ("config.json: no GDN layers (qwen3)", "models.read_config",
         lambda: inspect_model(_checkpoint(root, plain_qwen3)), E.NotAGDNModel, "model_type 'qwen3'"),
        ("checkpoint without weight files", "models.inspect_model",
         lambda: inspect_model(_checkpoint(root, no_weights)), E.WeightsMissing, "no weight files"),
        ("safetensors: truncated", "models.load", lambda: load(_checkpoint(root, weights(lambda b: b[:len(b) // 2])),
                                                              device="cpu", load_tokenizer=False),
         E.BadWeights, "damaged or truncated"),
        ("safetensors: garbled header", "models.load",
         lambda: load(_checkpoint(root, weights(lambda b: b[:8] + b"\x00garbage" + b[16:])), device="cpu",
                      load_tokenizer=False), E.BadWeights, "damaged or truncated"),
        ("device_map: a module the model lacks", "models.placement.check_modules",
         lambda: load(_checkpoint(root), device_map={"": "cpu", "model.nonesuch": "cpu"}, load_tokenizer=False),
         E.BadDeviceMap, "names 'model.nonesuch', which the model"),
        ("device_map: modules left out", "models.placement.check_modules",
         lambda: load(_checkpoint(root), device_map={"model.embed_tokens": "cpu", "model.layers": "cpu"},
                      load_tokenizer=False), E.BadDeviceMap, "leaves 'model.norm', 'model.rotary_emb' out"),
        ("device_map: a GDN layer split from its decoder layer", "models.placement.check_modules",
         lambda: load(_checkpoint(root), device_map={"": "cpu", "model.layers.0.linear_attn": "cpu"},
                      load_tokenizer=False), E.BadDeviceMap, "'model.layers.0.linear_attn'"),
        ("device_map: 'disk'", "models.placement.parse",
         lambda: load(_checkpoint(root), device_map={"": "disk"}, load_tokenizer=False), E.BadDeviceMap,
         "device_map[''] = 'disk'"),
        ("model defined by its own code, box unticked", "models.read_config",
         lambda: inspect_model(_checkpoint(root, own_code)), E.NeedsRemoteCode, "tick 'Trust remote code'"),
    ]


def _hf_cache_dir() -> str:
    from gdnviz.models.loader import _hf_cache_dir as where

    return where()


def _run_cases(root: Path) -> list[tuple[str, str, str, str]]:
    rows = []
    for what, where, fn, etype, words in _cases(root):
        with pytest.raises(etype) as e:
            fn()
        msg = str(e.value).replace(str(root), "<tmp>").replace(_hf_cache_dir(), "<HF cache>")
        assert words in msg, (what, msg)
        rows.append((what, where, type(e.value).__name__, msg))
    return rows


def _kill_section() -> list[str]:
    assert KILL_RECORD.exists(), f"{KILL_RECORD} is missing: run `pytest tests/test_kill_under_load.py`"
    k = json.loads(KILL_RECORD.read_text())
    return ["",
            f"## Worker killed mid-job under load: {k['lost']} lost, {k['misattributed']} misattributed, "
            f"{k['answered_twice']} answered twice",
            "",
            f"`tests/test_kill_under_load.py` (marker `slow`): {k['sessions']} sessions (threads sharing one store and "
            f"one worker handle, as the sessions of one Streamlit server do) submit {k['jobs_per_session']} capture "
            "jobs each on the demo model to the real worker process; the worker is SIGKILLed while a job runs and is "
            "restarted by the sessions' polls. The test writes its counts to `tests/records/kill_under_load.json`.",
            "",
            "| submitted | finished | failed by the kill (told to its session) | lost | misattributed | "
            "answered twice | other failures |",
            "|---|---|---|---|---|---|---|",
            f"| {k['submitted']} | {k['finished']} | {k['crashed']} | {k['lost']} | {k['misattributed']} | "
            f"{k['answered_twice']} | {k['other_failures']} |"]


def _crash_points_section() -> list[str]:
    assert CRASH_RECORD.exists(), f"{CRASH_RECORD} is missing: run `pytest tests/test_worker_crash_points.py`"
    c = json.loads(CRASH_RECORD.read_text())
    out = ["",
           f"## Worker killed after each of its store writes: {c['points']} points, {c['lost']} lost, "
           f"{c['answered_twice']} answered twice",
           "",
           "Every step of a job is one sqlite transaction of the store's `jobs/` table: `submit` writes the record "
           "and the queue entry, `claim_job` takes the job off the queue, marks it running by the worker's pid and "
           "records the claim (`running:<pid>`), `finish_job` writes the answer and drops the claim. Killed at any "
           "instant, a job is therefore queued, claimed by a pid, or answered, never in between. A claimed job "
           "whose worker is gone is answered \"failed\" (`WorkerCrashed`, with the exit code when the app saw it) "
           "by `reap_worker` (the app's handle when its child exits, or the next worker's start), and both "
           "`finish_job` and `reap_worker` write only a job still claimed by that pid, so a job is answered once. "
           "It is not re-queued: the job may be what killed the worker (the kernel's OOM killer, a crash in a "
           "native library), and running it again would take the next worker down too; its finished parts "
           "(memo entries) stay, so running it again recomputes only what was lost.",
           "",
           "`tests/test_worker_crash_points.py` (marker `slow`) forks the real worker (`gdnviz.worker.main`) on a "
           "store with one queued capture job and SIGKILLs it right after its k-th store write (k = 1, 2, ... "
           "until it exits on its own; each write is one transaction, so these are all the instants it can die "
           "at), recovers the job as the app does (odd k: the app's handle, even k: the next worker's start), "
           "then runs a next worker on the same store. Before claim and answer were single transactions, this "
           "test found three points that stranded the job for ever (after the take: \"queued\"; after marking "
           "it running and before recording the claim, and after dropping the claim and before the answer: "
           "\"running\").",
           "",
           "| k | the worker was killed right after | job then | recovered by | job at the end |",
           "|---|---|---|---|---|"]
    out += [f"| {r['k']} | {r['after']} | {r['at_kill']} | {r['recovered_by']} | {r['final']}"
            f"{' (' + r['error_type'] + ')' if r['error_type'] else ''} |" for r in c["rows"]]
    return out


def render(rows) -> str:
    from support import store_fuzz
    from test_store_fuzz import KINDS

    def cell(s: str) -> str:
        s = s.replace("|", "\\|").replace("\n", " ")
        return s if len(s) <= 140 else s[:137] + "…"

    out = ["# Reliability: bad inputs, damaged store entries, sessions",
           "",
           "Generated by `tests/test_reliability_table.py` (`python tests/test_reliability_table.py` rewrites it; the "
           "test fails when this file is not current), up to the hand-written sections at its end. Every bad input "
           "below was run by that test; the other sections name the tests that run their cases.",
           "",
           f"## Bad inputs: {len(rows)} tried, {len(rows)} refused with their own error and a message naming the "
           "bad value",
           "",
           "| bad input | checked in | error | message |", "|---|---|---|---|"]
    out += [f"| {cell(a)} | `{b}` | `{c}` | {cell(d)} |" for a, b, c, d in rows]
    n = len(KINDS) * len(store_fuzz.HOW)
    out += ["",
            f"## Damaged store entries: {n} cases, every page renders",
            "",
            "`tests/test_store_fuzz.py` (marker `slow`) truncates, garbles (14 bytes flipped in the middle) and deletes "
            "one entry of a real store, for each kind below, and opens all 7 pages (AppTest) with the run picked: "
            "no page fails, a damaged entry is skipped and named, a damaged capture is recomputed and never shown, "
            "its zip is not offered without saying why.",
            "",
            "| kind of entry | store table | " + " | ".join(store_fuzz.HOW) + " |",
            "|---|---|" + "---|" * len(store_fuzz.HOW)]
    out += [f"| {k} | `{area}/` | " + " | ".join("renders" for _ in store_fuzz.HOW) + " |"
            for k, (area, _p) in KINDS.items()]
    out += _kill_section()
    out += _crash_points_section()
    bound = re.search(r"^REFUSED_PEAK_MIB = (\d+)", (HERE / "test_large_upload.py").read_text(), re.M).group(1)
    out += ["",
            "## A 45 MB upload: refused by its size, the server's memory bounded",
            "",
            "`tests/test_large_upload.py` (markers `browser`, `slow`) uploads 45,000,000 bytes of UTF-8 prose to a "
            "real `streamlit run` in Chromium. At the default token limit the file is refused by its size before "
            f"it is decoded, and the server's peak resident memory grows by less than {bound} MiB (asserted). "
            "With the limit raised so that it is accepted, it is decoded and tokenised once and later reruns do not "
            "tokenise it again; that case's time and memory are measured, not bounded (docs/ui-speed.md).",
            "",
            "## Sessions: cross-session leaks 0",
            "",
            "- `tests/test_app_pages.py::test_a_new_session_is_shown_no_other_sessions_run` (6 pages): a new session "
            "is shown no run of another session, and no zip, until it picks one.",
            "- `tests/test_app_pages.py::test_a_finished_capture_is_this_sessions_run_when_another_session_stored_a_"
            "newer_one`.",
            "- `tests/test_browser.py::test_two_sessions_each_see_and_export_only_their_own_run` (Chromium against "
            "`streamlit run`): two sessions capture at once; each one's heatmap and downloaded zip are its own run, "
            "a third session sees neither.",
            ""]
    return "\n".join(out)


def _hand_written() -> str:
    """The marker line and the hand-written sections after it (just the marker when the file has none)."""
    text = DOC.read_text() if DOC.exists() else ""
    return text[text.index(HAND_WRITTEN):] if HAND_WRITTEN in text else HAND_WRITTEN + "\n"


def test_reliability_table_is_current(tmp_path):
    text = render(_run_cases(tmp_path))
    assert DOC.exists() and DOC.read_text().split(HAND_WRITTEN)[0] == text + "\n", \
        "docs/reliability.md is not current: run `python tests/test_reliability_table.py`"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        DOC.write_text(render(_run_cases(Path(d))) + "\n" + _hand_written())
    print(f"wrote {DOC}")
