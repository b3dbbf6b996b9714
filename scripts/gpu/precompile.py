"""Fill gdnviz's on-disk kernel cache (``gdnviz.gpu.nvrtc``) for this GPU in parallel processes, before anything
else runs: NVRTC is single-threaded and the truncation kernel's builds take 7–45 s each, so a machine's first
process would otherwise compile them one after another at its first truncation (and each pytest or benchmark
process again, without the cache).

    python3 scripts/gpu/precompile.py                      # the builds the current environment's switches select
    python3 scripts/gpu/precompile.py --profile            # also the profile builds (bench_truncate_phases.py)

Prints one line per build: its name, where it came from ("nvrtc": compiled now, "disk": already cached) and the
wall time of the whole run. Needs CUDA only to read the GPU's compute capability (``--capability 90`` skips that).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capability", default=None, help='e.g. "90" (default: the current GPU\'s)')
    ap.add_argument("--profile", action="store_true", help="also the GDNVIZ_PROFILE builds (bench_truncate_phases)")
    ap.add_argument("--float64", action="store_true", help="also the float64 builds")
    ap.add_argument("--workers", type=int, default=None)
    a = ap.parse_args()

    from gdnviz.gpu import nvrtc
    from gdnviz.gpu.prebuild import default_sources

    cap = a.capability
    if cap is None:
        import torch

        cap = "%d%d" % torch.cuda.get_device_capability()
    sources = default_sources(profile=a.profile, dtypes=("float", "double") if a.float64 else ("float",))
    t = time.perf_counter()
    res = nvrtc.precompile(sources, cap, a.workers)
    for name, origin in res:
        print(f"{name}: {origin}")
    print(f"precompiled {len(res)} builds for sm_{cap} into {nvrtc.cache_dir()} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
