"""How often does the CUDA truncation kernel miss the 1e-5 energy contract, and on which states? (H200)

For each r: the kernel (``truncate_states`` on CUDA) on GDN-like states, toy-GDN states, the slow / flat batteries
of ``tests.support.states.slow_states`` and real boundary states of the bundled demo model (bf16, 4K tokens of its
sample documents) and of the random 0.8B-shape model; the energy error against the float64 SVD answer. One JSON
line per (source, r): states, how many miss 1e-5, the worst error, and the kernel's attempt certificates.

    python bench/studies/study_contract_gpu.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from bench.common import emit  # noqa: E402


class Record:
    """Runner callback that keeps every boundary state (read-only)."""

    modifies_state = False

    def __init__(self):
        self.states = []

    def on_boundaries(self, layer, positions, states):
        self.states.append(states.reshape(-1, *states.shape[-2:]).float().cpu())


def model_states(lm, ids, L=256):
    from gdnviz import runner

    rec = Record()
    runner.forward(lm, torch.as_tensor(ids)[None].to(lm.device), segment_len=L, callbacks=[rec], keep_hidden=False)
    return torch.cat(rec.states)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", default="1,4,12,16,20,32")
    a = ap.parse_args()
    from gdnviz.truncation import cuda as tc
    from gdnviz.truncation.dispatch import truncate_states
    from gdnviz.truncation.reference import energy_error
    from tests.support import states as S

    dev = torch.device(a.device)
    sources = {"gdn_like": S.gdn_like_states(288, 128, 128, 0), "toy_gdn": S.toy_gdn_states(288, 128, 128, 1)}
    try:
        from gdnviz.documents import sample_documents, tokenize
        from gdnviz.models import load

        lm = load("demo", device=a.device, dtype="bfloat16")
        ids = tokenize(lm.tokenizer, max(sample_documents(), key=lambda d: len(d.text)).text)[:4096]
        sources["demo_model"] = model_states(lm, ids)
    except Exception as e:  # noqa: BLE001 - a study: say what failed, go on
        print("demo model states:", repr(e))
    for r in [int(x) for x in a.ranks.split(",")]:
        srcs = dict(sources)
        srcs["slow"], names = S.slow_states(r)
        for name, X in srcs.items():
            Xd = X.to(dev, torch.float32)
            Y = truncate_states(Xd, r)
            err = energy_error(Xd.double(), Y.double(), r).cpu()
            row = dict(what="kernel_contract", source=name, r=r, states=int(X.shape[0]),
                       over_1e5=int((err > 1e-5).sum()), worst=float(err.max()))
            if name == "slow":
                row["over_by_name"] = sorted({names[i] for i in torch.nonzero(err > 1e-5).flatten().tolist()})
            if r <= 32 and dev.type == "cuda":
                la = tc.launch(Xd.contiguous(), r)
                if la.done.numel():
                    row["attempt_certified"] = int(la.done.sum())
            emit(**row)


if __name__ == "__main__":
    main()
