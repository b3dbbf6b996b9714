"""Run a CUDA kernel's source on the CPU: compile it with g++ against a small emulation of CUDA's thread model.

Why: the development and CI machines have no GPU, but NVRTC-compiled kernels (``gdnviz.truncation.cuda``) hold
whole algorithms — their arithmetic, their barriers, their shared-memory layout. Compiling *the same source* as C++
and running every thread of a block as a user-level context (``ucontext``) checks what a compile check cannot: that
the kernel computes what its float64 reference computes, that no thread reads shared memory another thread has not
written yet (shared memory is filled with NaN before each block), and that every barrier is reached by every thread
(a barrier that cannot complete is reported as a deadlock instead of hanging).

Model (enough for kernels written against it, not all of CUDA):

* one block at a time by default, or ``concurrent`` blocks at once in lockstep by barrier phases (each block its own
  shared memory and warp slots), so that a block writing another block's part of a global buffer changes the
  answers as it would on a GPU (a scratch stride bug of the truncation kernel passed one block at a
  time); its ``blockDim.x`` threads each on its own stack; a thread runs until it reaches
  ``__syncthreads()`` / ``__syncwarp()`` (or a warp collective) or returns; ``__syncthreads()`` releases when every
  live thread of the block waits there, ``__syncwarp()`` when every live lane of the warp does (exited threads count
  as arrived, as on the GPU);
* warp collectives over the full warp: ``__shfl_sync``, ``__shfl_xor_sync``, ``__any_sync``, ``__all_sync`` (a
  write, a warp barrier, a read, a warp barrier), and ``dmma_m8n8k4``, the float64 tensor-core instruction
  ``mma.sync.aligned.m8n8k4.row.col.f64`` with its lane layout (kernels define it with inline PTX unless
  ``GDNVIZ_EMULATED`` is defined, as it is here);
* global-memory hand-over between blocks: ``atomicAdd`` / ``atomicExch`` on ``int`` (plain: one thread runs at a
  time), ``__threadfence`` (nothing to do), ``__ldcg`` (a load), and ``__nanosleep``, which hands the turn to the
  other threads and blocks and leaves its thread runnable — so a spin-wait on a flag that a concurrently running
  block sets completes, and one that nothing sets is reported after ``MAX_SPINS`` pauses instead of hanging;
* shared memory: dynamic, declared as ``extern __shared__ T name[];`` (one array, NaN-filled before each block), and
  statically sized ``__shared__`` arrays, which become function-level ``static`` arrays (one instance, as for one
  block; not refilled between blocks);
* math: ``sqrt``, ``rsqrt`` (as ``1/sqrt``: CUDA's is within 1 ulp), ``fma``, ``fabs``, ``__dmul_rn`` /
  ``__dadd_rn`` / ``__dsub_rn`` and the rest of ``<cmath>``;
  the host compiler does not contract ``a*b+c`` into FMAs as nvcc does, so results agree to rounding, not bit for bit.

``Emulated(source, name, signature)`` compiles once per (source, name, signature) into a shared library under the
temp directory; ``launch(grid, block, args, shared_mem)`` runs it on NumPy arrays (pointer arguments) and Python
ints / floats, in place, and raises ``RuntimeError`` on a deadlock.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading

import numpy as np

SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <algorithm>
#include <ucontext.h>
using std::min;
using std::max;
using std::sqrt;
using std::fabs;
using std::fma;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline long long clock64() { return 0; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
struct alignas(16) double2 { double x, y; };
static inline double2 make_double2(double x, double y) { return double2{x, y}; }
using std::ilogb;
using std::ldexp;
static inline int __double2hiint(double d) { int64_t b; std::memcpy(&b, &d, 8); return (int)(b >> 32); }
static inline double __hiloint2double(int hi, int lo) {
    const uint64_t b = ((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo;
    double d;
    std::memcpy(&d, &b, 8);
    return d;
}
static const long EMU_SMEM_DOUBLES = 65536;  // 512 KiB per block: more than any GPU's shared memory per block
static double* emu_smem_cur = nullptr;      // the running block's dynamic shared memory

namespace emu {
enum { RUN = 0, WAIT_WARP = 1, WAIT_BLOCK = 2, DONE = 3 };
static const size_t STACK = 256 * 1024;
static int nthr = 0, cur = 0;
static ucontext_t sched;
static ucontext_t* ctx = nullptr;
static char* stacks = nullptr;
static int* st = nullptr;
static int cap = 0;
static uint64_t (*slot)[32] = nullptr;  // the running block's warp-collective slots [32 warps][32 lanes]
static void (*entry)() = nullptr;
static long long spins = 0;  // __nanosleep calls in this launch: a wait that never ends is reported, not hung on
static const long long MAX_SPINS = 20000000;
static void yield_to_scheduler(int s) { st[cur] = s; swapcontext(&ctx[cur], &sched); }
static void thread_main() { entry(); st[cur] = DONE; }
}  // namespace emu

// global-memory synchronisation between blocks: one thread runs at a time, so the atomics are plain; __nanosleep
// (a spin-wait's pause) hands the turn to the other threads and blocks, staying runnable
static inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
static inline int atomicExch(int* p, int v) { const int old = *p; *p = v; return old; }
static inline void __threadfence() {}
static inline void __nanosleep(unsigned) { ++emu::spins; emu::yield_to_scheduler(emu::RUN); }
template <class T> static inline T __ldcg(const T* p) { return *p; }

static inline void __syncthreads() { emu::yield_to_scheduler(emu::WAIT_BLOCK); }
static inline void __syncwarp(unsigned = 0xffffffffu) { emu::yield_to_scheduler(emu::WAIT_WARP); }
template <class T> static inline T __shfl_sync(unsigned, T v, int src, int = 32) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    emu::slot[w][lane] = b;
    __syncwarp();
    const uint64_t r = emu::slot[w][src & 31];
    __syncwarp();
    T out;
    std::memcpy(&out, &r, sizeof(T));
    return out;
}
template <class T> static inline T __shfl_xor_sync(unsigned m, T v, int lane_mask, int = 32) {
    return __shfl_sync(m, v, (int)(threadIdx.x & 31) ^ lane_mask);
}
static inline int emu_vote(int p, int want_all) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu::slot[w][lane] = p ? 1u : 0u;
    __syncwarp();
    int any = 0, all = 1;
    for (int l = 0; l < 32; ++l) { any |= (int)emu::slot[w][l]; all &= (int)emu::slot[w][l]; }
    __syncwarp();
    return want_all ? all : any;
}
static inline int __any_sync(unsigned, int p) { return emu_vote(p, 0); }
static inline int __all_sync(unsigned, int p) { return emu_vote(p, 1); }
// mma.sync.aligned.m8n8k4.row.col.f64 (a kernel's dmma_m8n8k4 on the GPU): D (8x8) += A (8x4) B (4x8), lane l holding
// A[l/4][l%4], B[l%4][l/4] and D[l/4][2(l%4) + {0, 1}]; the four products of each entry summed in k order by fma
#define GDNVIZ_EMULATED 1
static inline void dmma_m8n8k4(double& d0, double& d1, double a, double b) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, row = lane >> 2, c0 = 2 * (lane & 3);
    double av[4], b0[4], b1[4];
    std::memcpy(&emu::slot[w][lane], &a, sizeof(double));
    __syncwarp();
    for (int k = 0; k < 4; ++k) std::memcpy(&av[k], &emu::slot[w][row * 4 + k], sizeof(double));
    __syncwarp();
    std::memcpy(&emu::slot[w][lane], &b, sizeof(double));
    __syncwarp();
    for (int k = 0; k < 4; ++k) {
        std::memcpy(&b0[k], &emu::slot[w][c0 * 4 + k], sizeof(double));
        std::memcpy(&b1[k], &emu::slot[w][(c0 + 1) * 4 + k], sizeof(double));
    }
    __syncwarp();
    for (int k = 0; k < 4; ++k) { d0 = std::fma(av[k], b0[k], d0); d1 = std::fma(av[k], b1[k], d1); }
}
"""

TRAMPOLINE = r"""
static void* emu_args[32];
static void emu_entry() { %(CALL)s; }
// conc blocks run at once, in lockstep: in every round each live block runs its runnable threads up to their next
// barrier, so a block that writes global memory another block is still using shows up as a wrong answer (as on a
// GPU), which one block at a time cannot show. Each block has its own shared memory and warp slots.
extern "C" int emu_launch(void** args, int nargs, int grid, int nthr, long smem_bytes, int conc) {
    using namespace emu;
    for (int i = 0; i < nargs; ++i) emu_args[i] = args[i];
    if (nthr > 1024 || smem_bytes > EMU_SMEM_DOUBLES * (long)sizeof(double)) return -2;
    if (conc < 1) conc = 1;
    if (conc > 64) conc = 64;  // blk[] below
    if (grid > 0 && conc > grid) conc = grid;
    static double* smem = nullptr;
    static uint64_t (*slots)[32] = nullptr;
    static int scap = 0;
    if (nthr * conc > cap) {
        free(ctx); free(stacks); free(st);
        cap = nthr * conc;
        ctx = (ucontext_t*)calloc(cap, sizeof(ucontext_t));
        stacks = (char*)malloc((size_t)cap * STACK);
        st = (int*)calloc(cap, sizeof(int));
    }
    if (conc > scap) {
        free(smem); free(slots);
        smem = (double*)aligned_alloc(64, (size_t)conc * EMU_SMEM_DOUBLES * sizeof(double));
        slots = (uint64_t (*)[32])calloc((size_t)conc * 32, sizeof(uint64_t[32]));
        scap = conc;
    }
    emu::nthr = nthr;
    emu::entry = emu_entry;
    emu::spins = 0;
    blockDim.x = nthr; gridDim.x = grid;
    int blk[64], next = 0;
    auto start = [&](int s) {
        if (next >= grid) { blk[s] = -1; return; }
        blk[s] = next++;
        const double nan = std::nan("");
        double* m = smem + (size_t)s * EMU_SMEM_DOUBLES;
        for (long i = 0; i < EMU_SMEM_DOUBLES; ++i) m[i] = nan;
        for (int t = s * nthr; t < (s + 1) * nthr; ++t) {
            st[t] = RUN;
            getcontext(&ctx[t]);
            ctx[t].uc_stack.ss_sp = stacks + (size_t)t * STACK;
            ctx[t].uc_stack.ss_size = STACK;
            ctx[t].uc_link = &sched;
            makecontext(&ctx[t], thread_main, 0);
        }
    };
    for (int s = 0; s < conc; ++s) start(s);
    for (;;) {
        bool live = false;
        for (int s = 0; s < conc; ++s) {
            if (blk[s] < 0) continue;
            live = true;
            blockIdx.x = blk[s];
            emu_smem_cur = smem + (size_t)s * EMU_SMEM_DOUBLES;
            slot = slots + (size_t)s * 32;
            for (int t = 0; t < nthr; ++t) {
                const int g = s * nthr + t;
                if (st[g] == RUN) { cur = g; threadIdx.x = t; swapcontext(&sched, &ctx[g]); }
            }
        }
        if (!live) break;
        if (spins > MAX_SPINS) return -3;  // a spin-wait (__nanosleep) that no other block releases
        for (int s = 0; s < conc; ++s) {
            if (blk[s] < 0) continue;
            const int b0 = s * nthr, b1 = b0 + nthr;
            int done = 0;
            bool spinning = false;  // a thread left runnable by __nanosleep: its block's barriers wait for it
            for (int t = b0; t < b1; ++t) { done += (st[t] == DONE); spinning = spinning || st[t] == RUN; }
            if (done == nthr) { start(s); continue; }
            if (spinning) continue;
            bool released = false;
            for (int w0 = b0; w0 < b1; w0 += 32) {
                const int w1 = std::min(w0 + 32, b1);
                bool all = true, some = false;
                for (int t = w0; t < w1; ++t) {
                    all = all && (st[t] == WAIT_WARP || st[t] == DONE);
                    some = some || st[t] == WAIT_WARP;
                }
                if (all && some) {
                    for (int t = w0; t < w1; ++t) if (st[t] == WAIT_WARP) st[t] = RUN;
                    released = true;
                }
            }
            if (!released) {
                bool all = true;
                for (int t = b0; t < b1; ++t) all = all && (st[t] == WAIT_BLOCK || st[t] == DONE);
                if (!all) return -1;  // deadlock: a barrier some live thread never reaches
                for (int t = b0; t < b1; ++t) if (st[t] == WAIT_BLOCK) st[t] = RUN;
            }
        }
    }
    return 0;
}
"""

_LOCK = threading.Lock()


def available() -> bool:
    """Whether a C++ compiler (``g++``) is on PATH."""
    return shutil.which("g++") is not None


class Emulated:
    """A CUDA kernel compiled for the CPU emulation (module docstring).

    ``signature``: the C types of the kernel's parameters in order, e.g. ``["const double*", "double*", "int",
    "double"]``; pointer parameters take C-contiguous NumPy arrays, ``int`` / ``long long`` Python ints, ``double``
    / ``float`` Python floats.
    """

    def __init__(self, source: str, name: str, signature: list[str]):
        self.signature = list(signature)
        call = f"{name}(" + ", ".join(f"*({t}*)emu_args[{i}]" for i, t in enumerate(self.signature)) + ")"
        # dynamic shared memory -> a pointer to the shim's array; static __shared__ arrays -> one static instance
        source = re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;",
                        r"\1* \2 = reinterpret_cast<\1*>(emu_smem_cur);", source)
        source = source.replace("__shared__", "static")
        text = SHIM + "\n" + source + "\n" + TRAMPOLINE % {"CALL": call}
        digest = hashlib.sha256(text.encode()).hexdigest()[:20]
        path = os.path.join(tempfile.gettempdir(), f"gdnviz-emul-{digest}.so")
        with _LOCK:
            if not os.path.exists(path):
                src = path[:-3] + f".{os.getpid()}.cpp"  # per process: parallel test runs may build the same one
                with open(src, "w") as f:
                    f.write(text)
                tmp = path + f".{os.getpid()}.tmp"
                res = subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-o", tmp, src],
                                     capture_output=True, text=True)
                if res.returncode != 0:
                    raise RuntimeError(f"g++ failed for the emulation of {name}:\n{res.stderr[-4000:]}")
                os.replace(tmp, path)
        self._lib = ctypes.CDLL(path)
        self._lib.emu_launch.restype = ctypes.c_int
        self._lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
                                         ctypes.c_int]

    def launch(self, grid: int, block: int, args: list, shared_mem: int = 0, concurrent: int = 1) -> None:
        """Run the kernel on ``grid`` blocks of ``block`` threads (1-D); pointer arguments are modified in place.
        ``concurrent`` blocks run at once, in lockstep by barrier phases (each with its own shared memory): a block
        writing another block's part of a global buffer then changes the answers, as it does on a GPU. Kernels with
        static ``__shared__`` arrays (one instance here) must run with 1."""
        if len(args) != len(self.signature):
            raise ValueError(f"{len(self.signature)} arguments expected, got {len(args)}")
        keep = []
        for t, a in zip(self.signature, args):
            t = t.strip()
            if t.endswith("*"):
                if not (isinstance(a, np.ndarray) and a.flags.c_contiguous):
                    raise TypeError(f"a C-contiguous numpy array is needed for {t}")
                keep.append(ctypes.c_void_p(a.ctypes.data))
            elif t in ("int", "unsigned"):
                keep.append(ctypes.c_int(int(a)))
            elif t in ("long long", "long"):
                keep.append(ctypes.c_longlong(int(a)))
            elif t == "double":
                keep.append(ctypes.c_double(float(a)))
            elif t == "float":
                keep.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"unsupported parameter type {t!r}")
        ptrs = (ctypes.c_void_p * len(keep))(*[ctypes.addressof(k) for k in keep])
        with _LOCK:  # one emulated launch at a time: the shim's scheduler state is global
            rc = self._lib.emu_launch(ptrs, len(keep), int(grid), int(block), int(shared_mem), int(concurrent))
        if rc == -1:
            raise RuntimeError("emulated kernel deadlocked: a barrier that some live thread never reaches")
        if rc == -3:
            raise RuntimeError("emulated kernel spun forever: a __nanosleep wait that no block released")
        if rc == -2:
            raise RuntimeError("emulated launch exceeds 1024 threads or the emulated shared memory")
