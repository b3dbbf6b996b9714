"""gdnviz.gpu.nvrtc's on-disk cache of compiled kernels: file format, keys, damaged files, and (CUDA) that a second
``Kernels`` loads the binary the first one compiled, without NVRTC, and launches the same kernel."""
from __future__ import annotations

import os

import pytest
import torch

from gdnviz.gpu import nvrtc


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", str(tmp_path / "k"))
    assert nvrtc.cache_dir() == str(tmp_path / "k")
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", "0")
    assert nvrtc.cache_dir() is None
    monkeypatch.delenv("GDNVIZ_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc.cache_dir() == str(tmp_path / "xdg" / "gdnviz" / "cuda_kernels")


def test_cache_key_names_source_and_capability():
    k = nvrtc.cache_key("src", "90")
    assert len(k) == 64 and k == nvrtc.cache_key("src", "90")
    assert len({k, nvrtc.cache_key("src2", "90"), nvrtc.cache_key("src", "80")}) == 3


def test_cache_file_round_trip_and_damaged_files(tmp_path):
    path = str(tmp_path / "sub" / "x.cubin")
    binary = bytes(range(256)) * 3 + b"\n\0\n"  # newlines and NULs inside the binary survive
    nvrtc.write_cached(path, binary)
    assert nvrtc.read_cached(path) == binary
    assert [p for p in os.listdir(tmp_path / "sub")] == ["x.cubin"]  # no temporary file left behind
    assert nvrtc.read_cached(str(tmp_path / "missing.cubin")) is None
    for bad in (b"", b"not ours\nbin", nvrtc._FORMAT):
        (tmp_path / "bad.cubin").write_bytes(bad)
        assert nvrtc.read_cached(str(tmp_path / "bad.cubin")) is None, bad
    nvrtc.write_cached(str(tmp_path / "bad.cubin"), b"\x01\x02")  # overwrites atomically
    assert nvrtc.read_cached(str(tmp_path / "bad.cubin")) == b"\x01\x02"


def test_unwritable_cache_folder_only_loses_the_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    nvrtc.write_cached(str(blocker / "x.cubin"), b"bin")  # no exception
    assert nvrtc.read_cached(str(blocker / "x.cubin")) is None


SOURCE = r'''
// torch passes Python floats as double
extern "C" __global__ void gdnviz_test_axpy(const float* x, float* y, double a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
'''


def test_entries_of_one_source_share_one_compilation(monkeypatch, tmp_path):
    """gdnviz_gram, gdnviz_truncate and gdnviz_project live in one source: NVRTC runs once for the three, and a new
    process (an empty memory) reads the binary from disk."""
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    calls = []

    def fake_nvrtc(source, name, cap):  # stands in for torch's NVRTC call (no NVRTC in a CPU build of torch)
        calls.append(name)
        return f"cubin of {source} for sm_{cap}".encode(), name

    got = [nvrtc._binary("src", n, "90", fake_nvrtc) for n in ("a", "b")]
    assert got == [(b"cubin of src for sm_90", "nvrtc"), (b"cubin of src for sm_90", "memory")] and calls == ["a"]
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    assert nvrtc._binary("src", "c", "90", fake_nvrtc) == (b"cubin of src for sm_90", "disk") and calls == ["a"]
    assert nvrtc._binary("src", "a", "80", fake_nvrtc)[1] == "nvrtc" and calls == ["a", "a"]
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", "0")
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    assert nvrtc._binary("src", "a", "90", fake_nvrtc)[1] == "nvrtc" and len(calls) == 3
    with pytest.raises(ValueError):
        nvrtc.precompile([("src", "a")], "90")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_second_process_loads_from_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(1000, dtype=torch.float32, device=dev)

    def launch(kernels):
        k = kernels.get("axpy", dev, SOURCE, "gdnviz_test_axpy")
        assert k is not None, kernels.reason
        y = torch.ones(1000, device=dev)
        k(grid=(4, 1, 1), block=(256, 1, 1), args=[x, y, 2.0, 1000])
        return y

    first = nvrtc.Kernels()
    y1 = launch(first)
    assert first.origins["axpy"] == "nvrtc"
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].endswith(".cubin")
    monkeypatch.setattr(nvrtc, "_BINARIES", {})  # a new process: nothing in memory
    second = nvrtc.Kernels()
    y2 = launch(second)
    assert second.origins["axpy"] == "disk"
    assert torch.equal(y1, y2) and torch.equal(y1, 2 * x + 1)
    (tmp_path / files[0]).write_bytes(nvrtc._FORMAT + b"not a cubin")  # damaged: dropped, compiled again
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    third = nvrtc.Kernels()
    assert torch.equal(launch(third), y1) and third.origins["axpy"] == "nvrtc"
    assert nvrtc.read_cached(str(tmp_path / files[0])) != b"not a cubin"  # rewritten
    # precompile (other processes, no GPU) fills the cache that a Kernels here then reads
    other = SOURCE.replace("gdnviz_test_axpy", "gdnviz_test_axpy2")
    cap = "%d%d" % torch.cuda.get_device_capability(dev)
    assert nvrtc.precompile([(other, "gdnviz_test_axpy2")] * 2, cap) == [("gdnviz_test_axpy2", "nvrtc")]
    fourth = nvrtc.Kernels()
    assert fourth.get("axpy2", dev, other, "gdnviz_test_axpy2") is not None and fourth.origins["axpy2"] == "disk"


def test_prebuild_lists_the_builds_runs_select_and_skips_cached_ones(monkeypatch, tmp_path):
    from gdnviz.truncation import cuda as ct
    from gdnviz.gpu import cuda_gram
    from gdnviz.gpu.prebuild import default_sources, missing, prebuild

    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    src = default_sources()
    names = [n for _, n in src]
    assert names == ["gdnviz_truncate", "gdnviz_truncate", "gdnviz_gram", "gdnviz_tridiag", "gdnviz_bisect"]
    assert src[0][0] == ct.source(128, 128, "float", 16)  # what cuda.kernel builds
    assert src[2][0] == cuda_gram.source(128, 128, "float")  # what cuda_gram.kernel builds
    assert len(default_sources(profile=True, dtypes=("float", "double"))) == 12
    assert [n for _, n in default_sources(64, 32)] == ["gdnviz_tridiag", "gdnviz_bisect"]  # V = 32: no truncation
    assert missing(src, "90") == src
    nvrtc.write_cached(str(tmp_path / (nvrtc.cache_key(src[0][0], "90") + ".cubin")), b"bin")
    nvrtc._BINARIES[nvrtc.cache_key(src[1][0], "90")] = b"bin"
    assert missing(src + src, "90") == src[2:]
    assert missing(src, "80") == src
    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", "0")
    assert prebuild(src, "90") == []  # no disk cache: nothing to fill, nothing compiled


def test_prebuild_compiles_the_missing_builds_in_other_processes(monkeypatch, tmp_path):
    """The spawned processes (the worker's warm-up path) write every missing build to disk, once per source; a
    second prebuild finds nothing to do and this process then reads them from disk."""
    from cuda_kernel_checks import fake_nvrtc
    from gdnviz.gpu.prebuild import missing, prebuild

    monkeypatch.setenv("GDNVIZ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    src = [("source one", "gdnviz_truncate"), ("source two", "gdnviz_bisect"), ("source one", "gdnviz_truncate")]
    assert prebuild(src, "90", workers=2, compile_fn=fake_nvrtc) == [("gdnviz_truncate", "nvrtc"),
                                                                     ("gdnviz_bisect", "nvrtc")]
    files = sorted(nvrtc.cache_key(s, "90") + ".cubin" for s in ("source one", "source two"))
    assert sorted(os.listdir(tmp_path)) == files
    assert missing(src, "90") == [] and prebuild(src, "90", compile_fn=fake_nvrtc) == []
    assert nvrtc._binary("source two", "gdnviz_bisect", "90", fake_nvrtc) == (b"cubin of source two for sm_90", "disk")
