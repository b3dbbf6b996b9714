"""float64 ``mma.sync`` throughput by shape on the GPU (issue #6): m8n8k4 (sm_80, what the
truncation kernel used) against the sm_90 shapes m16n8k4, m16n8k8 and m16n8k16.

One block of 8 warps per SM (as the truncation kernel runs), each warp issuing 1, 2, 4 or 8 independent accumulator
chains for 2,000 steps; one JSON line per (shape, chains): the launch's time (CUDA events, after a warm-up launch),
TFLOP/s over the GPU and ns per instruction per warp. The operands are register constants (no memory traffic).

    python bench/studies/bench_mma_shapes.py      # CUDA only, a few seconds
"""
import json, torch
SRC = r'''
#define NCH @NCH@
extern "C" __global__ void __launch_bounds__(256, 1) k(double* out, int iters) {
    double a[8], b[4], d[NCH][4];
    for (int i = 0; i < 8; ++i) a[i] = 1e-3 * (threadIdx.x + i);
    for (int i = 0; i < 4; ++i) b[i] = 1e-3 * (threadIdx.x - i);
#pragma unroll
    for (int c = 0; c < NCH; ++c) for (int i = 0; i < 4; ++i) d[c][i] = 0.0;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            @MMA@
        }
    }
    double s = 0.0;
#pragma unroll
    for (int c = 0; c < NCH; ++c) for (int i = 0; i < 4; ++i) s += d[c][i];
    out[blockIdx.x * 256 + threadIdx.x] = s;
}
'''
MMA = {
 "m8n8k4": ('asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};" : "+d"(d[c][0]), "+d"(d[c][1]) : "d"(a[0]), "d"(b[0]));', 256),
 "m16n8k4": ('asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};" : "+d"(d[c][0]), "+d"(d[c][1]), "+d"(d[c][2]), "+d"(d[c][3]) : "d"(a[0]), "d"(a[1]), "d"(b[0]));', 512),
 "m16n8k8": ('asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" : "+d"(d[c][0]), "+d"(d[c][1]), "+d"(d[c][2]), "+d"(d[c][3]) : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));', 1024),
 "m16n8k16": ('asm volatile("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};" : "+d"(d[c][0]), "+d"(d[c][1]), "+d"(d[c][2]), "+d"(d[c][3]) : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));', 2048),
}
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
out = torch.empty(sms * 256, dtype=torch.float64, device=dev)
for name, (mma, fma) in MMA.items():
    for nch in (1, 2, 4, 8):
        src = SRC.replace("@NCH@", str(nch)).replace("@MMA@", mma)
        try:
            kern = torch.cuda._compile_kernel(src, "k")
        except Exception as e:
            print(json.dumps(dict(shape=name, nch=nch, error=str(e)[:300]))); break
        iters = 2000
        kern(grid=(sms, 1, 1), block=(256, 1, 1), args=[out, iters]); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); kern(grid=(sms, 1, 1), block=(256, 1, 1), args=[out, iters]); e1.record(); torch.cuda.synchronize()
        ms = e0.elapsed_time(e1)
        n_mma = sms * 8 * nch * iters
        tf = n_mma * fma * 2 / (ms * 1e-3) / 1e12
        print(json.dumps(dict(shape=name, nch=nch, ms=round(ms, 3), tflops=round(tf, 1),
                              ns_per_mma_per_warp=round(ms * 1e6 / (nch * iters), 2))))
