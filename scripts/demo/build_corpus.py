#!/usr/bin/env python3
"""Build the English text corpus of the bundled demo model from offline sources (nothing is downloaded here).

Sources, each used when present on this machine (install them with apt-get first, see README.md):

- ``kjv``: the King James Bible, Debian ``bible-kjv-text`` + ``bible-kjv`` (its ``bible`` program decodes the
  compressed data file); one document per chapter.
- ``fortunes``: Debian ``fortunes-min`` + ``fortunes`` (``/usr/share/games/fortunes``, English files only, ASCII-art
  files skipped); one document per fortune.
- ``jargon``: Debian ``jargon-text`` (the Jargon File, ``jargon.txt.gz``); one document per glossary entry group,
  table-drawing lines dropped.
- ``pydocs``: Debian ``python3-doc`` (the Python manual as HTML), rendered to plain text with the stdlib
  ``html.parser`` (main body only, code blocks kept); one document per page.
- ``pydoc``: fallback that needs no install: the stdlib's own docstrings through ``pydoc.render_doc`` (plain text).
  Used only when the Debian sources give less than ``--min-mb`` (or when named in ``--sources``).

Output (under ``--out``, default ``out/demo/corpus``; ``out/`` is git-ignored):
  train.jsonl.gz     one JSON object per line: {"src": ..., "text": ...}
  heldout.jsonl.gz   held-out documents (a fixed fraction of each source's documents, never in train)
  sources.json       per-source document counts and sizes, the exact packages/paths used

Deterministic: documents are sorted, then shuffled with ``--seed``; the held-out split is taken from that order.

    python scripts/demo/build_corpus.py --out out/demo/corpus
"""
from __future__ import annotations

import argparse
import gzip
import html.parser
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

FORTUNE_DIR = Path("/usr/share/games/fortunes")
FORTUNE_SKIP = {"art", "ascii-art"}  # pictures, not prose
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
PYDOC_HTML = sorted(Path("/usr/share/doc").glob("python3.*/html"))
BOX = re.compile(r"[\u2500-\u257f]")


def clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = text.replace("\u00a0", " ").replace("\u00b6", "")  # nbsp, Sphinx's pilcrow anchors
    lines = [ln.rstrip() for ln in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


# --- sources ------------------------------------------------------------------------------------------------------
def src_kjv() -> list[str]:
    exe = shutil.which("bible")
    if exe is None or not Path("/usr/lib/bible.data").exists():
        return []
    out = subprocess.run([exe, "-l100000", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    docs, title, verses = [], None, []
    for line in out.split("\n"):
        s = line.strip()
        if not s:
            continue
        m = re.match(r"^(\d+)\s+(.*)$", s)
        if m and title is not None:
            verses.append(m.group(2))
        else:  # a chapter heading such as "Genesis 1"
            if title is not None and verses:
                docs.append(title + "\n\n" + " ".join(verses))
            title, verses = s, []
    if title is not None and verses:
        docs.append(title + "\n\n" + " ".join(verses))
    return [clean(d) for d in docs]


def src_fortunes() -> list[str]:
    if not FORTUNE_DIR.is_dir():
        return []
    docs = []
    for f in sorted(FORTUNE_DIR.iterdir()):
        if f.is_symlink() or not f.is_file() or f.suffix in (".dat", ".u8") or f.name in FORTUNE_SKIP:
            continue
        raw = f.read_bytes().decode("utf-8", errors="replace")
        for item in re.split(r"\n%\n", raw):
            item = clean(item)
            if len(item) >= 40:
                docs.append(item)
    return docs


def src_jargon() -> list[str]:
    if not JARGON.exists():
        return []
    text = gzip.decompress(JARGON.read_bytes()).decode("utf-8", errors="replace")
    lines = [ln for ln in text.split("\n") if not BOX.search(ln)]
    text = clean("\n".join(lines))
    # reflow the indented, hard-wrapped paragraphs into one line each
    paras = [re.sub(r"\s*\n\s*", " ", p.strip()) for p in text.split("\n\n") if p.strip()]
    docs, cur, size = [], [], 0
    for p in paras:  # group paragraphs into ~3 KB documents
        cur.append(p)
        size += len(p)
        if size > 3000:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        docs.append("\n\n".join(cur))
    return docs


class _MainText(html.parser.HTMLParser):
    """Plain text of a Sphinx page's <div role="main"> (falls back to <body>); scripts/styles/nav dropped."""
    BLOCK = {"p", "div", "section", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "table",
             "blockquote", "br", "ul", "ol", "dl"}
    SKIP = {"script", "style", "head", "nav", "footer"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth_main = 0  # >0 while inside the main div
        self.stack: list[tuple[str, bool]] = []
        self.skip = 0
        self.pre = 0
        self.parts: list[str] = []
        self.found_main = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        is_main = tag == "div" and (a.get("role") == "main" or a.get("class") == "body")
        if tag in ("br", "img", "hr", "meta", "link", "input"):
            if tag == "br" and self.depth_main:
                self.parts.append("\n")
            return
        skipped = tag in self.SKIP or (tag == "a" and a.get("class") == "headerlink")
        self.stack.append((tag, is_main, skipped))
        if is_main:
            self.depth_main += 1
            self.found_main = True
        if skipped:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if self.depth_main and tag in self.BLOCK:
            self.parts.append("\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "section") else "\n")
        if self.depth_main and tag == "li":
            self.parts.append("- ")

    def handle_endtag(self, tag):
        while self.stack:
            t, is_main, skipped = self.stack.pop()
            if is_main:
                self.depth_main -= 1
            if skipped:
                self.skip = max(0, self.skip - 1)
            if t == "pre":
                self.pre = max(0, self.pre - 1)
            if t == tag:
                break
        if self.depth_main and tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.depth_main or self.skip:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
        self.parts.append(data)

    def text(self) -> str:
        t = "".join(self.parts)
        t = re.sub(r"[ ]*\n[ ]*", "\n", t) if not self.pre else t
        return clean(re.sub(r"\n{3,}", "\n\n", t))


def _render_html(path: Path) -> str:
    p = _MainText()
    try:
        p.feed(path.read_text(encoding="utf-8", errors="replace"))
        p.close()
    except Exception:
        return ""
    return p.text()


def src_pydocs() -> list[str]:
    if not PYDOC_HTML:
        return []
    root = PYDOC_HTML[-1]
    docs = []
    for f in sorted(root.rglob("*.html")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(("_", "genindex", "py-modindex", "search")) or "/_" in rel:
            continue
        t = _render_html(f)
        if len(t) < 200:
            continue
        # split very long pages (the library reference) into ~20 KB documents on blank lines
        while len(t) > 30000:
            cut = t.rfind("\n\n", 0, 20000)
            cut = cut if cut > 5000 else 20000
            docs.append(t[:cut].strip())
            t = t[cut:].strip()
        docs.append(t)
    return docs


def src_pydoc() -> list[str]:
    """Stdlib docstrings via pydoc (no install needed)."""
    import pkgutil
    import pydoc
    import warnings

    names = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))
    std = set(getattr(sys, "stdlib_module_names", ()))
    names = [n for n in names if n in std and n not in {"antigravity", "this", "idlelib", "tkinter", "turtle",
                                                        "turtledemo", "test", "lib2to3", "ensurepip", "venv"}]
    docs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in names:
            try:
                mod = __import__(n)
                t = pydoc.render_doc(mod, renderer=pydoc.plaintext)
            except BaseException:  # some modules exit or need a display
                continue
            t = clean(t)
            if len(t) > 500:
                docs.append(t[:60000])
    return docs


SOURCES = {
    "kjv": ("bible-kjv-text + bible-kjv (/usr/lib/bible.data via `bible`)", src_kjv),
    "fortunes": ("fortunes-min + fortunes (/usr/share/games/fortunes)", src_fortunes),
    "jargon": ("jargon-text (/usr/share/doc/jargon-text/jargon.txt.gz)", src_jargon),
    "pydocs": ("python3-doc (/usr/share/doc/python3.*/html, html.parser)", src_pydocs),
    "pydoc": ("Python stdlib docstrings via pydoc.render_doc (no install)", src_pydoc),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/demo/corpus")
    ap.add_argument("--sources", default="kjv,fortunes,jargon,pydocs", help="comma-separated; 'pydoc' is the fallback")
    ap.add_argument("--min-mb", type=float, default=3.0, help="add the pydoc fallback when the rest give less")
    ap.add_argument("--max-mb", type=float, default=12.0, help="cap per source (MB of text)")
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--heldout-max-kb", type=float, default=150.0, help="cap of held-out text per source")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [s.strip() for s in args.sources.split(",") if s.strip()]
    stats, train, held = {}, [], []
    got_mb = 0.0

    def take(name: str) -> None:
        nonlocal got_mb
        desc, fn = SOURCES[name]
        docs = sorted(set(d for d in fn() if d))
        random.Random(f"{args.seed}:{name}").shuffle(docs)
        cap, kept, size = args.max_mb * 1e6, [], 0
        for d in docs:
            if size >= cap:
                break
            kept.append(d)
            size += len(d.encode())
        n_held = max(1, int(len(kept) * args.heldout_frac)) if len(kept) >= 20 else 0
        h, hsize = [], 0
        while kept and len(h) < n_held and hsize < args.heldout_max_kb * 1e3:
            d = kept.pop()
            h.append(d)
            hsize += len(d.encode())
        train.extend({"src": name, "text": d} for d in kept)
        held.extend({"src": name, "text": d} for d in h)
        tb = sum(len(d.encode()) for d in kept)
        stats[name] = {"what": desc, "train_docs": len(kept), "train_bytes": tb, "heldout_docs": len(h),
                       "heldout_bytes": hsize}
        got_mb += tb / 1e6
        print(f"{name:9s} {len(kept):6d} docs {tb / 1e6:7.2f} MB train, {len(h):4d} docs {hsize / 1e3:7.1f} KB "
              f"held out  ({desc})", flush=True)

    for name in wanted:
        if name not in SOURCES:
            ap.error(f"unknown source {name}; known: {', '.join(SOURCES)}")
        take(name)
    if got_mb < args.min_mb and "pydoc" not in wanted:
        print(f"only {got_mb:.2f} MB from {wanted}: adding the pydoc fallback", flush=True)
        take("pydoc")
    if not train:
        print("no text found: install the Debian packages (README.md) or use --sources pydoc", file=sys.stderr)
        return 1
    rng = random.Random(args.seed)
    rng.shuffle(train)
    for fname, docs in (("train.jsonl.gz", train), ("heldout.jsonl.gz", held)):
        with gzip.open(out / fname, "wt", encoding="utf-8", compresslevel=6) as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
    total = {"train_docs": len(train), "train_bytes": sum(s["train_bytes"] for s in stats.values()),
             "heldout_docs": len(held), "heldout_bytes": sum(s["heldout_bytes"] for s in stats.values())}
    (out / "sources.json").write_text(json.dumps({"sources": stats, "total": total, "seed": args.seed}, indent=1))
    print(f"total: {total['train_bytes'] / 1e6:.2f} MB train, {total['heldout_bytes'] / 1e3:.0f} KB held out -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
