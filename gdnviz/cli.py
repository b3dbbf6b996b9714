"""Command line: ``gdnviz capture``, ``gdnviz inspect`` (and ``python -m gdnviz ...``).

    gdnviz inspect MODEL
    gdnviz capture MODEL DOC.txt [DOC2.txt ...] --out runs/ [--segment-len 256] [--device auto] [--dtype auto]

``capture`` writes one ``<doc>.capture.npz`` per document (``gdnviz.capture.CaptureResult.save``) and a
``summary.csv`` with every head's statistics (median and min–max over the documents), with a progress bar.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gdnviz.errors import GDNVizError


def _progress(desc: str, total: int):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, leave=False)

    def update(done, n):
        bar.total = n
        bar.n = done
        bar.refresh()
        if done >= n:
            bar.close()

    return update


def cmd_inspect(args) -> int:
    from gdnviz.models import inspect_model

    print(json.dumps(inspect_model(args.model, trust_remote_code=args.trust_remote_code), indent=2, default=str))
    return 0


def cmd_capture(args) -> int:
    from gdnviz import summary
    from gdnviz.capture import capture_document
    from gdnviz.documents_io import read_text_file
    from gdnviz.models import load

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    if lm.tokenizer is None:
        raise GDNVizError(f"{lm.info.path} has no tokenizer files: gdnviz needs one to tokenize documents")
    info = lm.info
    print(f"{info.family}: {len(info.gdn_layers)} GDN layers x {info.num_heads} heads of {info.d_k}x{info.d_v}, "
          f"kernels: {info.kernel_path}, {info.device} {info.dtype}", file=sys.stderr)
    captures = []
    for doc in args.documents:
        text = read_text_file(doc)
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if args.max_tokens and len(ids) > args.max_tokens:
            from gdnviz.errors import DocumentTooLong

            raise DocumentTooLong(f"{doc}: {len(ids)} tokens, over the limit of {args.max_tokens} (--max-tokens)")
        cap = capture_document(lm, ids, args.segment_len, name=Path(doc).name,
                               progress=_progress(Path(doc).name, len(info.gdn_layers)))
        path = cap.save(out / f"{Path(doc).stem}.capture.npz")
        print(f"{doc}: {len(ids)} tokens, {len(cap.positions)} boundaries, {cap.meta['seconds']:.2f} s -> {path} "
              f"({path.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
        captures.append(cap)
    table = summary.document_set_table(captures)
    table.to_csv(out / "summary.csv", index=False)
    ov = summary.overview(table, args.segment_len)
    (out / "overview.json").write_text(json.dumps(ov, indent=2))
    print(json.dumps(ov, indent=2))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gdnviz", description="Look inside the Gated DeltaNet heads of hybrid LMs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="'demo', a local checkpoint directory, or org/name in the local HF cache")
    common.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own code (off by default)")
    sp = sub.add_parser("inspect", parents=[common], help="describe a checkpoint without loading its weights")
    sp.set_defaults(fn=cmd_inspect)
    sp = sub.add_parser("capture", parents=[common], help="capture every GDN head along one or more documents")
    sp.add_argument("documents", nargs="+", help="UTF-8 text files")
    sp.add_argument("--out", required=True, help="output folder")
    sp.add_argument("--segment-len", type=int, default=256)
    sp.add_argument("--device", default="auto")
    sp.add_argument("--dtype", default="auto")
    sp.add_argument("--max-tokens", type=int, default=0, help="refuse documents longer than this (0 = no limit)")
    sp.set_defaults(fn=cmd_capture)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except GDNVizError as e:
        print(f"gdnviz: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
