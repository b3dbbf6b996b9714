// Fused top-r truncation of GDN head states: one thread block per state, everything but U in shared memory.
// The algorithm of gdnviz.truncation.reference.subspace_truncate: see gdnviz/truncation/cuda.py for the contract and
// docs/kernels-truncation.md for the design.
// Placeholders replaced by the Python side: @K@ (rows of a state), @V@ (columns), @T@ (float or double), @QB@ (block
// width q: 32, or 16 for the small certified attempt).
// Written for tests.support.cuda_emul too: dynamic shared memory only, barriers reached by every thread.
#define K_ @K@
#define V_ @V@
#define M_ (K_ < V_ ? K_ : V_)
#define QB @QB@
#define LQB @LQB@
#define QP (QB + 1)
// row stride of the Jacobi's matrices A, A2 (T = Q^T G Q): even, so that a round's rotation loads A[i][p(i)] and
// A[p(i)][i] — an anti-diagonal, i + p(i) constant — fall in distinct banks (with QP = 33 all 32 lanes of every warp
// hit one bank: ~26 wavefronts per load instead of 2, half the kernel's excess shared-memory wavefronts; Nsight
// Compute); the 2 x 2 block updates stay conflict-free
#define JQP (QB + 2)
#define UL 32
#define HALF 16
#define NT 256
#define KR (K_ / 16)
#define VR (V_ / 16)
#define RA (K_ / 32)
#define RS (NT / QB)
#define QT (QB * QB / NT)
#define NB (QB / 8)
#define NPAIR (QB / 2)  // pairs per Jacobi round
// pair-block Jacobi rounds for 32-column blocks (one barrier per round); the 16-column attempt keeps the per-entry
// rounds: there only 64 of the 256 threads would update a 2 x 2 block, and the r = 1 attempt measured 7% slower
#if QB == 32
#define GDNVIZ_PAIR_JACOBI
#endif
typedef @T@ scalar_t;
#define SHIFT 1e-13
#define TINY 1e-300
#define FILLC 1e-6
#define D2_SLACK 1e-12   // the certificate's allowance for the rounding of ||G||^2 - ||T'||^2 - 2||R||^2
#define DTR_SLACK 1e-12  // ... and for that of tr(D) = 1 - tr(T')
// Both bounds are for an orthonormal basis; the shifted Cholesky-QR leaves the basis columns with norm^2 ~1 - SHIFT,
// so S_r = U (U^T S) keeps ~(1 - 2 SHIFT) of their energy: 2e-13, measured on a state whose bound is 4e-19
#define SCALE_SLACK (3.0 * SHIFT)
#define ORTH_TOL 1e-12  // cholqr's check: a block this close to orthonormal is left as it is

// shared memory map, in doubles
#define GST (K_ + 1)  // row stride of G: odd, so that gemm_gx's fragment loads hit 16 distinct banks
#define OFF_A (K_ * GST)
#define OFF_B (OFF_A + K_ * QP)
#define OFF_C (OFF_B + K_ * QP)
#define OFF_L (OFF_C + QB * JQP)
#define OFF_M (OFF_L + QB * JQP)
#define SMEM_DOUBLES (OFF_M + 384)
// misc area (OFF_M): block-sum partials, Jacobi round arrays, refill norms, selection
#define M_RED 0
#define M_CC 8
#define M_SG 40
#define M_DD 72
#define M_DN 104
#define M_PP 136
#define M_RT 168
#define M_W 200
#define M_SEL 232
#define M_RK 256
#define M_RN 288
#define M_R4 320
// modes (bit flags): READ_DONE skips states whose DONE flag is set; ATTEMPT runs the ATTEMPT table's filter steps,
// certifies the result with the energy-error bound and writes DONE (1: output written; 0: left for a later launch)
#define NO_BOUND 1e300  // BOUND where no bound holds (not attempted, no gap); NVRTC has no INFINITY
#define READ_DONE 1
#define ATTEMPT 2
// split launches (few states: gdnviz.truncation.cuda.split_on): GRAM_IN reads S S^T from GIN [N][K][K] (written by
// gdnviz_gram, whose thread blocks cover the GPU) instead of computing it; NO_PROJ writes the final U into the
// scratch and leaves S_r = U (U^T S) to gdnviz_project. Both give the fused kernel's bits: the same sums in the same
// order, only spread over more thread blocks
#define GRAM_IN 4
#define NO_PROJ 8
// PHASED (more states than multiprocessors, the full algorithm at ranks > HALF: gdnviz.truncation.cuda.phased_on):
// each state as consecutive items, one thread block each, over a grid of (items) x N blocks: item 0 runs everything
// up to and including the first pass's deflation (a state that needs no second pass runs whole); item 1 the second
// pass's sketch and filter steps; item 2 the rest (Rayleigh-Ritz,
// selection, projection). A block takes a ticket (atomicAdd on SYNC[0]): item tk / N of state tk % N. An item leaves
// what the next needs in GSAVE (the deflated G and zscale after item 0, the Q block after item 1; G does not change in
// the second pass) and sets SYNC[1 + n] to the items done; the next waits for it and reads them back: the same
// numbers, so the same bits as one block per state. Why: one block per state (215 KiB of shared memory, one per SM)
// ran 288 states in three waves on 132 SMs, the last with 24 states; smaller items fill the idle SMs (list
// scheduling: ~2.25 state-times instead of 3 with three items). No deadlock: tickets are taken in order by resident
// blocks, so the item a block waits for holds a smaller ticket and is running or done; item 0 never waits
#define PHASED 16
#define M_TK 352  // misc slot: the block's ticket
#define M_CQ 356  // GDNVIZ_PROFILE: cholqr's cycles in its three parts (thread 0)

// GDNVIZ_PROFILE (bench/bench_truncate_phases.py): thread 0 adds clock64() deltas per phase; written to U's scratch
#ifdef GDNVIZ_PROFILE
#define PROF(i) do { if (t == 0) { const long long nw_ = clock64(); pacc[i] += nw_ - pt_; pt_ = nw_; } } while (0)
#define SKIPS(call) do { const int s_ = (call); if (t == 0) pacc[16] += s_; } while (0)  // index 16: checked Cholesky-QRs skipped
#else
#define PROF(i) do { } while (0)
#define SKIPS(call) (void)(call)
#endif

// GDNVIZ_DMMA (the default on GPUs): the Gram matrix, the products G X, the sketch S Omega and the deflation's
// U Y^T + Y U^T on the float64 tensor cores,
// mma.sync.aligned.m8n8k4.row.col.f64 — D (8x8) += A (8x4) B (4x8), each lane holding A[lane/4][lane%4],
// B[lane%4][lane/4] and D[lane/4][2(lane%4) + {0, 1}]. tests.support.cuda_emul defines dmma_m8n8k4 from warp shuffles.
#define RT (K_ / 64)  // 8-row tiles of G per warp (8 warps cover K_ rows)
#define GSL (K_ == 128 ? 9 : K_ / 8)  // lower-triangle items per warp (lower_items)
#define SG 20         // stride of the Gram's 16-column staging rows: a fragment's 8 rows x 4 columns, 2 wavefronts
#if defined(GDNVIZ_DMMA) && !defined(GDNVIZ_EMULATED)
__device__ __forceinline__ void dmma_m8n8k4(double& d0, double& d1, double a, double b) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(d0), "+d"(d1) : "d"(a), "d"(b));
}
#endif
// D (RT 8-row tiles, [RT][2] per lane) += A (RT x (8 x 4)) B (4 x 8): warp w's row tiles of one column tile. For K = 128
// (RT = 2: rows lr and lr + 8) one mma.sync.aligned.m16n8k4 (sm_90), whose fragments are those of two m8n8k4 stacked
// (PTX ISA, f64 m16n8k4: a0 / a1 rows groupID / groupID + 8, c0, c1 / c2, c3 likewise). Measured on the H200
// (bench/bench_mma_shapes.py: 8 warps per SM, 8 independent accumulators each) m8n8k4 ran at 23.6
// TFLOP/s, m16n8k4 at 52.5: the m8n8k4 form left half of the float64 tensor cores idle, and G·Q, the sketches and
// the Gram matrix were bound by it (Nsight Compute: stall "math" on the mma.sync lines)
#ifdef GDNVIZ_DMMA
#if !defined(GDNVIZ_EMULATED)
__device__ __forceinline__ void dmma_rt(double (&d)[RT][2], const double (&a)[RT], double b) {
#if RT == 2
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+d"(d[0][0]), "+d"(d[0][1]), "+d"(d[1][0]), "+d"(d[1][1]) : "d"(a[0]), "d"(a[1]), "d"(b));
#else
    for (int i = 0; i < RT; ++i) dmma_m8n8k4(d[i][0], d[i][1], a[i], b);
#endif
}
#else
__device__ __forceinline__ void dmma_rt(double (&d)[RT][2], const double (&a)[RT], double b) {
    for (int i = 0; i < RT; ++i) dmma_m8n8k4(d[i][0], d[i][1], a[i], b);
}
#endif
#endif

__device__ __forceinline__ double block_sum(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < NT / 32; ++w) s += red[w];
    __syncthreads();
    return s;
}

// Four block-wide sums at once (two barriers); every thread gets the totals. red: 4 * NT / 32 doubles.
__device__ __forceinline__ void block_sum4(double (&v)[4], double* red) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
        for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int k = 0; k < 4; ++k) red[(threadIdx.x >> 5) * 4 + k] = v[k];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        double s = 0.0;
        for (int w = 0; w < NT / 32; ++w) s += red[w * 4 + k];
        v[k] = s;
    }
    __syncthreads();
}

// The partner of index i in round k of the cyclic parallel Jacobi ordering (QB - 1 rounds of QB / 2 disjoint pairs:
// round k pairs i with (2k - i) mod (QB - 1), the index that would pair with itself goes with QB - 1)
__device__ __forceinline__ int jacobi_partner(int i, int k) {
    const int j = (2 * k - i + (QB - 1)) % (QB - 1);
    return (i == QB - 1) ? k : ((j == i) ? QB - 1 : j);
}

// The rotation of index i with its partner p in a Jacobi round, from a_ip = A[i][p], a_pi = A[p][i] and the diagonal
// entries d_i, d_p: whether it rotates (the skip test |a_pq| > skip sqrt|a_pp| sqrt|a_qq|, squared), its cosine c,
// index i's signed sine sgn (−s for the pair's first index) and i's new diagonal entry dn. t = sgn(tau) / (|tau| +
// sqrt(1 + tau^2)), tau = d / h, = sgn(d) h / (|d| + sqrt(d^2 + h^2)), and c, s come from two reciprocal square
// roots in the chain, no division (the rounds are latency-bound: bench/RESULTS.md; the seventeenth's
// A/B: 8% fewer cycles in the rotations than a square root, a division and a reciprocal square root). c^2 + s^2 =
// u q^2 = 1 up to rounding. Both members of a pair compute the same rotation.
__device__ __forceinline__ bool jacobi_rotation(double a_ip, double a_pi, double di, double dp, bool is_p, double skip,
                                                double& c, double& sgn, double& dn) {
    // r = 1/rho, rho = sqrt(d^2 + h^2); u = (1 + |d| r)/2 = cos^2(theta), q = 1/sqrt(u): c = u q,
    // s = sgn(d) (h r / 2) q, t = s / c = sgn(d) h / (|d| + rho), t apq = t h / 2 = sgn(d) (h r / 2) h q^2 / 2
    const double app = is_p ? di : dp, aqq = is_p ? dp : di;
    const double apq = 0.5 * (a_ip + a_pi);
    const bool rot = apq * apq > (skip * skip) * fabs(app * aqq);
    const double d = aqq - app, h = 2.0 * apq;
    const double r = rsqrt(rot ? fma(d, d, h * h) : 1.0);
    const double u = 0.5 * fma(fabs(d), r, 1.0);
    const double q = rsqrt(u);
    const double hr = (d < 0.0) ? -0.5 * (h * r) : 0.5 * (h * r);
    c = rot ? u * q : 1.0;
    const double s = rot ? hr * q : 0.0;
    sgn = is_p ? -s : s;
    const double tapq = rot ? (hr * h) * (0.5 * (q * q)) : 0.0;
    dn = is_p ? app - tapq : aqq + tapq;
    return rot;
}

// c·a + s·b with one rounding order fixed in the source (fma(c, a, s·b)): the two Jacobi round forms compute each
// entry from the same operands, and NVRTC contracts `c * a + s * b` into a fused multiply-add either way depending on
// the surrounding code, so without this the forms' bits differed on the H200 though equal in the emulation (g++
// does not contract)
__device__ __forceinline__ double rot2(double c, double a, double s, double b) { return fma(c, a, __dmul_rn(s, b)); }

// G [K][K] from global memory (row-major) into Gs (row stride GST), and with K_ * QB > 0 rows of a [K][QB] block into
// X (row stride QP): each thread's loads in batches of 16, all in flight before their stores (a plain loop waits for
// one L2 round trip per element: 64 per thread for G at K = 128)
#define LD_BATCH 16
__device__ __forceinline__ void load_square(const double* __restrict__ src, double* Gs) {
    const int t = threadIdx.x;
    for (int e0 = 0; e0 < K_ * K_; e0 += LD_BATCH * NT) {
        double v[LD_BATCH];
#pragma unroll
        for (int m = 0; m < LD_BATCH; ++m) v[m] = __ldcg(src + e0 + m * NT + t);
#pragma unroll
        for (int m = 0; m < LD_BATCH; ++m) {
            const int e = e0 + m * NT + t;
            Gs[(e / K_) * GST + (e % K_)] = v[m];
        }
    }
}
__device__ __forceinline__ void load_block(const double* __restrict__ src, double* X) {
    const int t = threadIdx.x;
    double v[K_ * QB / NT];
#pragma unroll
    for (int m = 0; m < K_ * QB / NT; ++m) v[m] = __ldcg(src + m * NT + t);
#pragma unroll
    for (int m = 0; m < K_ * QB / NT; ++m) {
        const int e = m * NT + t;
        X[(e >> LQB) * QP + (e & (QB - 1))] = v[m];
    }
}

// The trace of G [K][K] once every thread has stored its part of it; every thread gets it (three barriers).
__device__ __forceinline__ double gram_trace(const double* Gs, double* red) {
    __syncthreads();
    double d = 0.0;
    for (int i = threadIdx.x; i < K_; i += NT) d += Gs[i * GST + i];
    return block_sum(d, red);
}

// This thread's KR x KR tile of G (rows ty + 16a, columns tx + 16b) back to shared memory, then G's trace.
__device__ __forceinline__ double store_tile_trace(const double (&acc)[KR][KR], double* Gs, double* red, int tx, int ty) {
#pragma unroll
    for (int a = 0; a < KR; ++a)
#pragma unroll
        for (int b = 0; b < KR; ++b) Gs[(ty + 16 * a) * GST + tx + 16 * b] = acc[a][b];
    return gram_trace(Gs, red);
}

// Y [K][QP] = G [K][K] X [K][QP] (G symmetric: G[k][i] read for G[i][k]); no barrier inside.
#ifdef GDNVIZ_DMMA
// The row of k that lane (., lk) reads at step g of a sum over k on the tensor cores: the instruction's 4 rows of k
// are 4 apart (16 g/4 + g%4 + 4 lk), so that with row strides ≡ 1 mod 4 (G's GST, QP) a fragment's 8 x 4 loads fall
// in 16 distinct banks (consecutive rows were 4-way conflicted)
__device__ __forceinline__ int frag_row(int g, int lk) { return 16 * (g >> 2) + (g & 3) + 4 * lk; }

// The items of a K x K lower triangle that warp w computes, for the Gram matrix and the deflation's update on the
// tensor cores: item q is row block irow[q] (RT 8-row tiles: rows 8 RT irow ...) x column tile icol[q] (8 columns),
// accumulators zeroed. K = 128: row blocks of 16 rows (one m16n8k4 per step of k), block P with column tiles
// 0 ... 2P + 1 (its upper 8 x 8 tile unused), 72 items; blocks P and 7 - P (18 items) go to warps 2P and 2P + 1, 9
// each, so a warp reads the A fragments of at most two blocks (rb0 = P, rb1 = 7 - P). K = 64: row tile w whole
// (8 items, its upper part unused; rb0 = rb1 = w). Row / column pairs with i < j are left out when stored.
__device__ __forceinline__ void lower_items(int w, int (&irow)[GSL], int (&icol)[GSL], double (&acc)[GSL][RT][2],
                                            int& rb0, int& rb1) {
    const int g = w >> 1, n0 = 2 * g + 2;
    rb0 = (K_ == 128) ? g : w;
    rb1 = (K_ == 128) ? 7 - g : w;
#pragma unroll
    for (int q = 0; q < GSL; ++q) {
        const int j = 9 * (w & 1) + q;
        irow[q] = (K_ == 128) ? ((j < n0) ? g : 7 - g) : w;
        icol[q] = (K_ == 128) ? ((j < n0) ? j : j - n0) : q;
#pragma unroll
        for (int a = 0; a < RT; ++a) { acc[q][a][0] = 0.0; acc[q][a][1] = 0.0; }
    }
}

// One step of k (4 rows, lane (lr, lk): row k of the operands) over warp w's lower items: A rows from X (row stride
// xs), B rows from Y (row stride ys), both at column k: D[item] += X[rows of its block][k..] Y[rows of its tile][k..]^T.
__device__ __forceinline__ void lower_step(const double* X, int xs, const double* Y, int ys, int k, int rb0, int rb1,
                                           const int (&irow)[GSL], const int (&icol)[GSL],
                                           double (&acc)[GSL][RT][2]) {
    const int lr = (threadIdx.x & 31) >> 2;
    double a0[RT], a1[RT];
#pragma unroll
    for (int a = 0; a < RT; ++a) {
        a0[a] = X[(8 * (RT * rb0 + a) + lr) * xs + k];
        a1[a] = (K_ == 128) ? X[(8 * (RT * rb1 + a) + lr) * xs + k] : a0[a];
    }
#pragma unroll
    for (int q = 0; q < GSL; ++q) {
        double aa[RT];
#pragma unroll
        for (int a = 0; a < RT; ++a) aa[a] = (irow[q] == rb0) ? a0[a] : a1[a];
        dmma_rt(acc[q], aa, Y[(8 * icol[q] + lr) * ys + k]);
    }
}

// Warp w's lower items (lower_items) into G [K][GST], mirrored so that G stays symmetric bit for bit: each (i, j),
// i >= j, written (subtract: G_ij - acc, the deflation; else acc, the Gram matrix) by the one lane that holds it
__device__ __forceinline__ void lower_store(const int (&irow)[GSL], const int (&icol)[GSL],
                                            const double (&acc)[GSL][RT][2], double* G, bool subtract) {
    const int lane = threadIdx.x & 31, lr = lane >> 2, lk = lane & 3;
#pragma unroll
    for (int q = 0; q < GSL; ++q)
#pragma unroll
        for (int a = 0; a < RT; ++a)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 8 * (RT * irow[q] + a) + lr, j = 8 * icol[q] + 2 * lk + h;
                if (i >= j) {
                    const double g = subtract ? G[i * GST + j] - acc[q][a][h] : acc[q][a][h];
                    G[i * GST + j] = g;
                    G[j * GST + i] = g;
                }
            }
}

// Warp w's RT x NB accumulator tiles (gemm_gx, the sketch), zeroed.
__device__ __forceinline__ void zero_tiles(double (&acc)[NB][RT][2]) {
#pragma unroll
    for (int a = 0; a < RT; ++a)
#pragma unroll
        for (int b = 0; b < NB; ++b) { acc[b][a][0] = 0.0; acc[b][a][1] = 0.0; }
}

// Warp w's RT x NB accumulator tiles (rows 8 RT w ..., all QB columns) into Y [K][QP].
__device__ __forceinline__ void store_tiles(const double (&acc)[NB][RT][2], double* Y) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, lr = lane >> 2, lk = lane & 3;
#pragma unroll
    for (int a = 0; a < RT; ++a)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            double* y = Y + (8 * (RT * w + a) + lr) * QP + 8 * b + 2 * lk;
            y[0] = acc[b][a][0];
            y[1] = acc[b][a][1];
        }
}

// acc (warp w's rows 8 RT w ... x NC column tiles of 8) = X [K][QP] B, B [QB][NC * 8] read as B[k][j] = bcol(k, j)
// through the functor: the small products U (U^T Z), U (U^T G U) and Q W_sel on the tensor cores (they
// were sums of QB fused multiply-adds with two shared-memory loads each, per entry: 288 states at r = 32
// 0.9516 / 0.9649 -> 0.9247 / 0.9139 ms in two same-run pairs; sketch 43.0K -> 34.5K cycles, deflation 45.4K ->
// 36.3K, selection 17.9K -> 9.1K)
template <int NC, class F>
__device__ __forceinline__ void gemm_xb(const double* X, F bcol, double (&acc)[NC][RT][2]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, lr = lane >> 2, lk = lane & 3;
#pragma unroll
    for (int b = 0; b < NC; ++b)
#pragma unroll
        for (int a = 0; a < RT; ++a) { acc[b][a][0] = 0.0; acc[b][a][1] = 0.0; }
#pragma unroll
    for (int k0 = 0; k0 < QB; k0 += 4) {
        double ga[RT];
#pragma unroll
        for (int a = 0; a < RT; ++a) ga[a] = X[(8 * (RT * w + a) + lr) * QP + k0 + lk];  // A[i][k] = X[i][k]
#pragma unroll
        for (int b = 0; b < NC; ++b) dmma_rt(acc[b], ga, bcol(k0 + lk, 8 * b + lr));
    }
}

// Y [K][QP] <- (Y - coef X C) scale for X [K][QP], C [QB][QP] (gemm_xb), each entry by the lane holding its product
// (the second pass's sketch: Z <- (Z - U (U^T Z)) zscale; the deflation: Y = GU - U (U^T G U) / 2)
__device__ __forceinline__ void sub_xc(const double* X, const double* C, double* Y, double coef, double scale) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, lr = lane >> 2, lk = lane & 3;
    double acc[NB][RT][2];
    gemm_xb<NB>(X, [&](int k, int j) { return C[k * QP + j]; }, acc);
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int a = 0; a < RT; ++a)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                double* y = Y + (8 * (RT * w + a) + lr) * QP + 8 * b + 2 * lk + h;
                *y = (*y - coef * acc[b][a][h]) * scale;
            }
}

// Warp w: rows 8 RT w ... (RT tiles of 8) x all QB columns (NB tiles of 8), 4 rows of k per instruction.
__device__ __forceinline__ void gemm_gx(const double* G, const double* X, double* Y) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, lr = lane >> 2, lk = lane & 3;
    double acc[NB][RT][2];
    zero_tiles(acc);
#pragma unroll 4
    for (int g = 0; g < K_ / 4; ++g) {
        const int k = frag_row(g, lk);
        double ga[RT];
#pragma unroll
        for (int a = 0; a < RT; ++a) ga[a] = G[k * GST + 8 * (RT * w + a) + lr];  // A[i][k] = G[k][i]
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const double xb = X[k * QP + 8 * b + lr];  // B[k][j] = X[k][8b + j]
            dmma_rt(acc[b], ga, xb);
        }
    }
    store_tiles(acc, Y);
}
#else
__device__ __forceinline__ void gemm_gx(const double* G, const double* X, double* Y) {
    const int cg = threadIdx.x & 7, rg = threadIdx.x >> 3;
    double acc[RA][NB];
#pragma unroll
    for (int a = 0; a < RA; ++a)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[a][b] = 0.0;
#pragma unroll 4
    for (int k = 0; k < K_; ++k) {
        double g[RA], x[NB];
#pragma unroll
        for (int a = 0; a < RA; ++a) g[a] = G[k * GST + rg + 32 * a];
#pragma unroll
        for (int b = 0; b < NB; ++b) x[b] = X[k * QP + cg + 8 * b];
#pragma unroll
        for (int a = 0; a < RA; ++a)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[a][b] = fma(g[a], x[b], acc[a][b]);
    }
#pragma unroll
    for (int a = 0; a < RA; ++a)
#pragma unroll
        for (int b = 0; b < NB; ++b) Y[(rg + 32 * a) * QP + cg + 8 * b] = acc[a][b];
}
#endif

// T [QB][QP] = X^T Y over K rows (X, Y [K][QP]). mirror: T[i][j] = T[max][min] (the lower triangle, as eigh reads
// it); shift: C_ii (1 + SHIFT) + TINY on the diagonal, X = Y (a Gram matrix, symmetric: also mirrored).
#ifdef GDNVIZ_DMMA
// On the tensor cores: 8x8 tiles of T, lower-triangle tiles only when mirrored; warp w takes tasks w, w + 8 (a task:
// one tile over one of XT_KS chunks of k — two at 16 columns, where 3-4 tiles would leave most warps idle). Fragments
// read rows of k four apart (frag_row). With two chunks the second chunk's partial tiles are added through T: one
// barrier inside, reached by every thread. (The FMA form below loads both operands of every multiply-add from shared
// memory.)
#define XT_KS (QB == 16 ? 2 : 1)
#define XT_R (QB == 16 ? 1 : 2)
template <int TS = QP>  // T's row stride
__device__ __forceinline__ void gemm_xty(const double* X, const double* Y, double* T, bool mirror, bool shift) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, lr = lane >> 2, lk = lane & 3;
    const bool lower = mirror || shift;
    const int ntask = (lower ? NB * (NB + 1) / 2 : NB * NB) * XT_KS;
    double acc[XT_R][2];
    int ti[XT_R], tj[XT_R], ch[XT_R];
    bool act[XT_R];
#pragma unroll
    for (int q = 0; q < XT_R; ++q) {
        const int task = w + 8 * q, tile = task / XT_KS;
        act[q] = task < ntask;
        ch[q] = task % XT_KS;
        int a = 0;
        if (lower) {
            while ((a + 1) * (a + 2) / 2 <= tile) ++a;
            ti[q] = a;
            tj[q] = tile - a * (a + 1) / 2;
        } else {
            ti[q] = tile / NB;
            tj[q] = tile % NB;
        }
        acc[q][0] = 0.0;
        acc[q][1] = 0.0;
        if (act[q]) {  // warp-uniform
            const int g0 = ch[q] * (K_ / 4 / XT_KS);
#pragma unroll 4
            for (int g = g0; g < g0 + K_ / 4 / XT_KS; ++g) {
                const int k = frag_row(g, lk);
                dmma_m8n8k4(acc[q][0], acc[q][1], X[k * QP + 8 * ti[q] + lr], Y[k * QP + 8 * tj[q] + lr]);
            }
        }
    }
    if (XT_KS == 2) {
#pragma unroll
        for (int q = 0; q < XT_R; ++q)
            if (act[q] && ch[q] == 1)
#pragma unroll
                for (int h = 0; h < 2; ++h) T[(8 * ti[q] + lr) * TS + 8 * tj[q] + 2 * lk + h] = acc[q][h];
        __syncthreads();
#pragma unroll
        for (int q = 0; q < XT_R; ++q)
            if (act[q] && ch[q] == 0)
#pragma unroll
                for (int h = 0; h < 2; ++h) acc[q][h] += T[(8 * ti[q] + lr) * TS + 8 * tj[q] + 2 * lk + h];
        __syncwarp();  // every lane has read its partial before any lane writes a mirrored entry
    }
#pragma unroll
    for (int q = 0; q < XT_R; ++q) {
        if (act[q] && (XT_KS == 1 || ch[q] == 0)) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 8 * ti[q] + lr, j = 8 * tj[q] + 2 * lk + h;
                double v = acc[q][h];
                if (shift && i == j) v = v * (1.0 + SHIFT) + TINY;
                if (!lower) T[i * TS + j] = v;
                else if (i >= j) { T[i * TS + j] = v; T[j * TS + i] = v; }
            }
        }
    }
}
#else
// Fused multiply-adds, each thread one entry (QB = 16) or four; with one entry the sum over k runs as XS interleaved
// partial sums, so that the chain of dependent fmas is K / XS long, not K. No barrier inside.
#define XS (QT == 1 ? 4 : 1)
template <int TS = QP>  // T's row stride
__device__ __forceinline__ void gemm_xty(const double* X, const double* Y, double* T, bool mirror, bool shift) {
    const int j = threadIdx.x & (QB - 1), i0 = threadIdx.x >> LQB;
    double acc[QT][XS];
    int ii[QT], jj[QT];
#pragma unroll
    for (int a = 0; a < QT; ++a) {
        const int i = i0 + RS * a;
        const bool sw = mirror && i < j;
        ii[a] = sw ? j : i;
        jj[a] = sw ? i : j;
#pragma unroll
        for (int h = 0; h < XS; ++h) acc[a][h] = 0.0;
    }
#pragma unroll 4
    for (int k = 0; k < K_; k += XS) {
#pragma unroll
        for (int h = 0; h < XS; ++h)
#pragma unroll
            for (int a = 0; a < QT; ++a) acc[a][h] = fma(X[(k + h) * QP + ii[a]], Y[(k + h) * QP + jj[a]], acc[a][h]);
    }
#pragma unroll
    for (int a = 0; a < QT; ++a) {
        const int i = i0 + RS * a;
        double v = (XS == 4) ? (acc[a][0] + acc[a][1]) + (acc[a][2 % XS] + acc[a][3 % XS]) : acc[a][0];
        if (shift && i == j) v = v * (1.0 + SHIFT) + TINY;
        T[i * TS + j] = v;
    }
}
#endif

// X [K][QP] <- X L^{-T}, L L^T = C = X^T X + SHIFT diag + TINY I (shifted Cholesky-QR). C: the Cs area ([QB][JQP]),
// B: 2 QB + 8 doubles of scratch. Warp 0 factorises: lane i holds row i of C in registers; column j's updated entries
// C'[.][j] go through B (double-buffered: one __syncwarp per column), the pivot C'[j][j] by a warp shuffle, and lane
// i's entries update as C'[i][k] -= m_i C'[k][j] with m_i = C'[i][j] / L_jj^2 (one multiply-add per entry: the
// product L[i][j] L[k][j] formed as (C'[i][j] r_j)(C'[k][j] r_j) cost a second multiply per entry, and the warp's
// float64 issue was half of each column's time). L goes to C transposed — row j of C holds column j of L, 1 / L_jj
// on the diagonal — so that threads < K forward-substitute row t of X (right-looking) with 16-byte loads of
// consecutive entries (JQP even: a row starts 16-byte aligned). Three block barriers in all (four when checked).
// check > 0 (the Cholesky-QR pairs after the refill and of the final U): when max |C_ij - delta_ij| over the leading
// check x check block is <= ORTH_TOL, X is left as it is and 1 returned (block-uniform; a NaN never passes) — the
// factorisation would move it by ~ORTH_TOL / 2 (gdnviz.truncation.constants.ORTH_TOL, reference.checked_cholqr: the same rule).
// Measured (H200, 288 states at r = 32, same run): the folded update and the transposed L took
// 1.164 -> 1.141 ms, the checked pairs -> 1.096 ms (cholqr 243.5K -> 208.7K cycles of thread 0)
// Not inlined: one copy of its code serves its 18 calls per state at r = 32 instead of a copy per call site (the
// kernel's code was 478 KB, far more than an SM's instruction cache; with one copy 199 KB).
__device__ __forceinline__ double nan_max(double a, double b) { return (a != a || a > b) ? a : b; }
__device__ __noinline__ int cholqr(double* X, double* C, double* B, int check) {
    const int t = threadIdx.x;
#ifdef GDNVIZ_PROFILE  // thread 0's cycles: C and its check, the factorisation, the substitution (PHASES 17 ... 19)
    extern __shared__ double smem[];
    double* cq = smem + OFF_M + M_CQ;
    long long c0 = clock64();
#define CQ(i) do { if (t == 0) { const long long c1 = clock64(); cq[i] += (double)(c1 - c0); c0 = c1; } } while (0)
#else
#define CQ(i) do { } while (0)
#endif
    gemm_xty<JQP>(X, X, C, false, true);
    __syncthreads();
    if (check > 0) {  // block-uniform
        double m = 0.0;
        for (int e = t; e < QB * QB; e += NT) {
            const int i = e >> LQB, j = e & (QB - 1);
            if (i < check && j < check) m = nan_max(m, fabs(C[i * JQP + j] - ((i == j) ? 1.0 : 0.0)));
        }
        for (int o = 16; o > 0; o >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
        double* red = B + 2 * QB;
        if ((t & 31) == 0) red[t >> 5] = m;
        __syncthreads();
        double mm = red[0];
        for (int w = 1; w < NT / 32; ++w) mm = nan_max(mm, red[w]);
        if (mm <= ORTH_TOL) { CQ(0); return 1; }  // every thread read red before any returns; X, C untouched
    }
    CQ(0);
    if (t < 32) {  // warp-uniform
        const bool own = t < QB;
        double c[QB];
#pragma unroll
        for (int k = 0; k < QB; ++k) c[k] = own ? C[t * JQP + k] : 0.0;
#pragma unroll
        for (int j = 0; j < QB; ++j) {
            double* b = B + (j & 1) * QB;  // column j's entries (lane i: C'[i][j]); the other buffer is column j - 1's
            if (own) b[t] = c[j];
            const double piv = __shfl_sync(0xffffffffu, c[j], j);
            __syncwarp();
            double bk[QB];
#pragma unroll
            for (int k = j + 1; k < QB; ++k) bk[k] = b[k];
            const double rj = rsqrt(piv);
            const double mi = c[j] * (rj * rj);
            if (own && t >= j) C[j * JQP + t] = (t == j) ? rj : c[j] * rj;  // L[t][j], transposed
#pragma unroll
            for (int k = j + 1; k < QB; ++k) c[k] = fma(-mi, bk[k], c[k]);  // lanes' entries k > i: unused
        }
    }
    __syncthreads();
    CQ(1);
    if (t < K_) {
        double x[QB];
#pragma unroll
        for (int c = 0; c < QB; ++c) x[c] = X[t * QP + c];
#pragma unroll
        for (int j = 0; j < QB; ++j) {
            const double* row = C + j * JQP;  // column j of L: row[j] = 1 / L_jj, row[k] = L[k][j] for k > j
            double y = 0.0;
#pragma unroll
            for (int k0 = j & ~1; k0 < QB; k0 += 2) {
                const double2 v = *reinterpret_cast<const double2*>(row + k0);
                if (k0 == j) { y = x[j] * v.x; x[j] = y; x[k0 + 1] = fma(-v.y, y, x[k0 + 1]); }
                else if (k0 + 1 == j) { y = x[j] * v.y; x[j] = y; }
                else { x[k0] = fma(-v.x, y, x[k0]); x[k0 + 1] = fma(-v.y, y, x[k0 + 1]); }
            }
        }
#pragma unroll
        for (int c = 0; c < QB; ++c) X[t * QP + c] = x[c];
    }
    __syncthreads();
    CQ(2);
    return 0;
#undef CQ
}

extern "C" __global__ void __launch_bounds__(NT, 1)
gdnviz_truncate(const scalar_t* __restrict__ S, scalar_t* __restrict__ OUT, const int* __restrict__ RANKS,
                int rank, int rank_stride, const double* __restrict__ OMEGA, const double* __restrict__ FILLD,
                const int* __restrict__ ITER_TAB, int iters, double* __restrict__ USCR, int max_sweeps,
                double tol2, double skip, int mode, int* __restrict__ DONE, double* __restrict__ BOUND,
                double cert_tol, const double* __restrict__ GIN, double* __restrict__ GSAVE,
                int* __restrict__ SYNC)
{
    extern __shared__ double smem[];
    double* Gs = smem;
    double* As = smem + OFF_A;
    double* Bs = smem + OFF_B;
    double* Cs = smem + OFF_C;
    double* Ls = smem + OFF_L;
    double* misc = smem + OFF_M;
    const int t = threadIdx.x;
    // mode and gridDim are re-read where used (kernel parameters, special registers): the phased bookkeeping holds
    // two 32-bit registers, n and item (a 64-bit n and the item count in registers took the per-entry Jacobi build
    // from 0 to 80 bytes of spills)
    const bool phased = (mode & PHASED) != 0;
    int n = blockIdx.x;
    int item = 0;  // PHASED: which part of state n this block runs
    if (phased) {
        if (t == 0) misc[M_TK] = (double)atomicAdd(SYNC, 1);
        __syncthreads();
        const int tk = (int)misc[M_TK], nst = gridDim.x / 3;
        item = tk / nst;
        n = tk - item * nst;
    }
    const long long nl = n;  // 64-bit offsets below
    const scalar_t* Sn = S + nl * (K_ * V_);
    scalar_t* On = OUT + nl * (K_ * V_);
    double* Un = USCR + nl * (K_ * UL);  // [K][UL] per state, whatever the block width
    double* Gsave = GSAVE + nl * (K_ * K_ + K_ * QB + 16);  // PHASED: the deflated G [K][K], Q [K][QB], zscale, trace
    const int r = (rank_stride >= 0) ? RANKS[n * rank_stride] : rank;
    if ((mode & READ_DONE) && DONE[n] != 0) return;  // an earlier launch wrote this state
    const bool attempt = (mode & ATTEMPT) != 0;
    const bool two_pass = r > HALF && r <= 2 * HALF && r < M_;  // a valid rank that needs the second pass
    if (item > 0 && (!two_pass || attempt)) return;  // item 0 wrote it whole
    if (r >= M_) {  // kept: the state unchanged, bit for bit
        for (int e = t; e < K_ * V_; e += NT) On[e] = Sn[e];
        if (attempt && t == 0) { DONE[n] = 1; BOUND[n] = 0.0; }
        return;
    }
    if (r < 1 || r > 2 * HALF) {  // an invalid device-side rank: NaN, not a silent answer
        for (int e = t; e < K_ * V_; e += NT) On[e] = (scalar_t)nan("");
        if (attempt && t == 0) { DONE[n] = 1; BOUND[n] = nan(""); }
        return;
    }
#ifdef GDNVIZ_PROFILE
    long long pacc[17];
    for (int q = 0; q < 17; ++q) pacc[q] = 0;
    if (t == 0)
        for (int q = 0; q < 3; ++q) misc[M_CQ + q] = 0.0;  // cholqr's own counters (a barrier follows before its first call)
    long long pt_ = clock64();
#endif
    const int n_it0 = (iters >= 0) ? iters : ITER_TAB[r];  // pass p's steps: ITER_TAB[(2 HALF + 1) p + r]
    if (attempt && (n_it0 < 0 || r > QB || r > HALF)) {  // not attempted at this rank: left for a later launch
        if (t == 0) { DONE[n] = 0; BOUND[n] = NO_BOUND; }
        return;
    }
    const int npass = (r > HALF) ? 2 : 1;
    if (item == 0)
        for (int e = t; e < K_ * UL; e += NT) Un[e] = 0.0;
    const int tx = t & 15, ty = t >> 4;

    double tr = 0.0, gf2 = 0.0, zscale = 0.0;  // gf2: ||G||_F^2 (the attempt's certificate)
#ifdef GDNVIZ_DMMA
    const bool sketch_fused = !attempt && !(mode & GRAM_IN);  // Z = S Omega_0 computed with the Gram matrix
#else
    const bool sketch_fused = false;
#endif
    if (item > 0) {  // PHASED: wait for this state's previous item, then the deflated G, zscale (and Q for item 2)
        if (t == 0) {
            while (atomicAdd(SYNC + 1 + n, 0) < item) __nanosleep(256);
            __threadfence();
        }
        __syncthreads();
        load_square(Gsave, Gs);
        if (item == 2) load_block(Gsave + K_ * K_, As);
        zscale = __ldcg(Gsave + K_ * K_ + K_ * QB);
        __syncthreads();
    } else {
    if (mode & GRAM_IN) {  // G = S S^T from gdnviz_gram (both triangles written there)
        load_square(GIN + nl * (K_ * K_), Gs);
        tr = gram_trace(Gs, misc + M_RED);
    } else {
#ifdef GDNVIZ_DMMA
    // ---- G = S S^T / ||S||_F^2 on the tensor cores: S staged 16 columns at a time through As..Bs (free until the
    // sketch; K_ x SG doubles; the next 16 columns are loaded into registers while a stage's products run). Only the
    // lower triangle is needed (mirrored: G exactly symmetric; gemm_gx reads G[k][i] for G[i][k]): warp w computes the
    // 9 items of lower_items (K = 128: 16 x 8 blocks on m16n8k4; before, 17 8 x 8 tiles per warp
    // on m8n8k4, 60K -> 41K cycles at r = 32; no branch between the products: a branch per tile
    // made the Gram 10% slower than the full square); for K = 64 warp w computes row tile w whole and keeps
    // its lower part
    // The first pass's sketch Z = S Omega_0 (the full algorithm) is accumulated in the same loop, while each 16
    // columns of S are in shared memory (Omega_0's 16 rows staged in Cs): the separate sketch read S again, 32 columns
    // per stage with no prefetch (35K cycles per pass at r = 32). Its accumulators see the same
    // mma.sync sequence as the separate sketch's (v = 0, 4, 8, ... per 8x8 tile), so the same bits; Z goes to As
    // (free again after the loop) unscaled, as the pass loop's sketch leaves it
    {
        const int lane = t & 31, w = t >> 5, lr = lane >> 2, lk = lane & 3;
        double* St = As;
        int irow[GSL], icol[GSL], rb0, rb1;
        double acc[GSL][RT][2];
        lower_items(w, irow, icol, acc, rb0, rb1);
        double accz[NB][RT][2];
        zero_tiles(accz);
        scalar_t nx[K_ * 16 / NT];
        double nz[16 * QB / NT];  // Omega_0's next 16 rows (fused sketch only)
#pragma unroll
        for (int m = 0; m < K_ * 16 / NT; ++m) {
            const int e = t + m * NT;
            nx[m] = Sn[(e >> 4) * V_ + (e & 15)];
        }
        if (sketch_fused) {
#pragma unroll
            for (int m = 0; m < 16 * QB / NT; ++m) {
                const int e = t + m * NT;
                nz[m] = OMEGA[(e >> LQB) * UL + (e & (QB - 1))];
            }
        }
        for (int v0 = 0; v0 < V_; v0 += 16) {
#pragma unroll
            for (int m = 0; m < K_ * 16 / NT; ++m) {
                const int e = t + m * NT;
                St[(e >> 4) * SG + (e & 15)] = (double)nx[m];
            }
            if (sketch_fused) {
#pragma unroll
                for (int m = 0; m < 16 * QB / NT; ++m) {
                    const int e = t + m * NT;
                    Cs[(e >> LQB) * QP + (e & (QB - 1))] = nz[m];
                }
            }
            __syncthreads();
            if (v0 + 16 < V_) {
#pragma unroll
                for (int m = 0; m < K_ * 16 / NT; ++m) {
                    const int e = t + m * NT;
                    nx[m] = Sn[(e >> 4) * V_ + v0 + 16 + (e & 15)];
                }
                if (sketch_fused) {
#pragma unroll
                    for (int m = 0; m < 16 * QB / NT; ++m) {
                        const int e = t + m * NT;
                        nz[m] = OMEGA[(v0 + 16 + (e >> LQB)) * UL + (e & (QB - 1))];
                    }
                }
            }
#pragma unroll 1
            for (int k0 = 0; k0 < 16; k0 += 4) {
                lower_step(St, SG, St, SG, k0 + lk, rb0, rb1, irow, icol, acc);  // A[i][k] = S[i][k], B[k][j] = S[j][k]
                if (sketch_fused) {  // block-uniform
                    double ga[RT];
#pragma unroll
                    for (int a = 0; a < RT; ++a) ga[a] = St[(8 * (RT * w + a) + lr) * SG + k0 + lk];  // S[i][v0+k]
#pragma unroll
                    for (int b = 0; b < NB; ++b) {
                        const double xb = Cs[(k0 + lk) * QP + 8 * b + lr];  // B[k][j] = Omega[v0 + k][j]
                        dmma_rt(accz[b], ga, xb);
                    }
                }
            }
            __syncthreads();
        }
        lower_store(irow, icol, acc, Gs, false);
        if (sketch_fused) store_tiles(accz, As);
        tr = gram_trace(Gs, misc + M_RED);
    }
#else
    // ---- G = S S^T / ||S||_F^2, S staged through As 32 columns at a time
    {
        double acc[KR][KR];
#pragma unroll
        for (int a = 0; a < KR; ++a)
#pragma unroll
            for (int b = 0; b < KR; ++b) acc[a][b] = 0.0;
        for (int v0 = 0; v0 < V_; v0 += QB) {
            for (int e = t; e < K_ * QB; e += NT) As[(e >> LQB) * QP + (e & (QB - 1))] = (double)Sn[(e >> LQB) * V_ + v0 + (e & (QB - 1))];
            __syncthreads();
#pragma unroll 1
            for (int c = 0; c < QB; ++c) {
                double rb[KR];
#pragma unroll
                for (int b = 0; b < KR; ++b) rb[b] = As[(tx + 16 * b) * QP + c];
#pragma unroll
                for (int a = 0; a < KR; ++a) {
                    const double ra = As[(ty + 16 * a) * QP + c];
#pragma unroll
                    for (int b = 0; b < KR; ++b) acc[a][b] = fma(ra, rb[b], acc[a][b]);
                }
            }
            __syncthreads();
        }
        tr = store_tile_trace(acc, Gs, misc + M_RED, tx, ty);
    }
#endif
    }
    const double inv = (tr > 0.0) ? 1.0 / sqrt(tr) : 0.0;
    for (int e = t; e < K_ * K_; e += NT) {
        const int ge = (e / K_) * GST + (e % K_);
        const double g = Gs[ge] * (inv * inv);
        Gs[ge] = g;
        gf2 = fma(g, g, gf2);
    }
    zscale = inv;
    if (attempt) gf2 = block_sum(gf2, misc + M_RED);
    __syncthreads();
    }
    PROF(0);

    for (int p = (item > 0) ? 1 : 0; p < npass; ++p) {
        const int take = min(r - HALF * p, HALF);
        if (item < 2) {  // item 2 starts after the second pass's filter steps
        // ---- Z = S Omega_p (S staged through Bs), deflated by U for the second pass, scaled to the state's norm.
        // An attempt (one pass) starts from Z = G Omega' instead, Omega' the first K rows of OMEGA: G is in shared
        // memory already, so S is not read again, and G Omega' spans (S S^T) Omega', one power more than S Omega
        if (attempt) {
            for (int e = t; e < K_ * QB; e += NT)
                Bs[(e >> LQB) * QP + (e & (QB - 1))] = OMEGA[(e >> LQB) * UL + (e & (QB - 1))];
            __syncthreads();
            gemm_gx(Gs, Bs, As);
        } else if (p == 0 && sketch_fused) {
            // Z = S Omega_0 is in As already (the Gram matrix's loop)
        } else {
#ifdef GDNVIZ_DMMA
            // on the tensor cores: per chunk of QB columns of S (Bs) and rows of Omega_p (Cs), warp w accumulates
            // rows 8 RT w ... x all QB columns as gemm_gx does; the sum over v runs in v order
            const int lane = t & 31, w = t >> 5, lr = lane >> 2, lk = lane & 3;
            double acc[NB][RT][2];
            zero_tiles(acc);
            for (int v0 = 0; v0 < V_; v0 += QB) {
                for (int e = t; e < K_ * QB; e += NT) Bs[(e >> LQB) * QP + (e & (QB - 1))] = (double)Sn[(e >> LQB) * V_ + v0 + (e & (QB - 1))];
                for (int e = t; e < QB * QB; e += NT)
                    Cs[(e >> LQB) * QP + (e & (QB - 1))] = OMEGA[(p * V_ + v0 + (e >> LQB)) * UL + (e & (QB - 1))];
                __syncthreads();
#pragma unroll 2
                for (int k0 = 0; k0 < QB; k0 += 4) {
                    const int k = k0 + lk;
                    double ga[RT];
#pragma unroll
                    for (int a = 0; a < RT; ++a) ga[a] = Bs[(8 * (RT * w + a) + lr) * QP + k];  // S[i][v0 + k]
#pragma unroll
                    for (int b = 0; b < NB; ++b) {
                        const double xb = Cs[k * QP + 8 * b + lr];  // B[k][j] = Omega[v0 + k][j]
                        dmma_rt(acc[b], ga, xb);
                    }
                }
                __syncthreads();
            }
            store_tiles(acc, As);
            // warp w stored rows 16w ... of As, and the first pass's scaling below runs over As by other rows: without
            // this barrier it read rows not yet stored (found by the emulation: the tensor-core
            // build's Z differed from S Omega in 70 of 128 rows — a start block with some rows unscaled, which the
            // filter steps still converged from, so no accuracy test saw it)
            __syncthreads();
#else
            const int c = t & (QB - 1), r0 = t >> LQB;
            double acc[K_ / RS];
#pragma unroll
            for (int m = 0; m < K_ / RS; ++m) acc[m] = 0.0;
            for (int v0 = 0; v0 < V_; v0 += QB) {
                for (int e = t; e < K_ * QB; e += NT) Bs[(e >> LQB) * QP + (e & (QB - 1))] = (double)Sn[(e >> LQB) * V_ + v0 + (e & (QB - 1))];
                __syncthreads();
#pragma unroll 4
                for (int vv = 0; vv < QB; ++vv) {
                    const double o = OMEGA[(p * V_ + v0 + vv) * UL + c];
#pragma unroll
                    for (int m = 0; m < K_ / RS; ++m) acc[m] = fma(Bs[(r0 + RS * m) * QP + vv], o, acc[m]);
                }
                __syncthreads();
            }
#pragma unroll
            for (int m = 0; m < K_ / RS; ++m) As[(r0 + RS * m) * QP + c] = acc[m];
#endif
        }
        if (p > 0) {
            for (int e = t; e < K_ * QB; e += NT) Bs[(e >> LQB) * QP + (e & (QB - 1))] = Un[(e >> LQB) * UL + (e & (QB - 1))];
            __syncthreads();
            gemm_xty(Bs, As, Cs, false, false);  // U^T Z
            __syncthreads();
#ifdef GDNVIZ_DMMA
            sub_xc(Bs, Cs, As, 1.0, zscale);  // Z <- (Z - U (U^T Z)) zscale
#else
            for (int e = t; e < K_ * QB; e += NT) {
                const int i = e >> LQB, c = e & (QB - 1);
                double s = 0.0;
#pragma unroll 8
                for (int m = 0; m < QB; ++m) s = fma(Bs[i * QP + m], Cs[m * QP + c], s);
                As[i * QP + c] = (As[i * QP + c] - s) * zscale;
            }
#endif
        } else if (!attempt) {
            for (int e = t; e < K_ * QB; e += NT) As[(e >> LQB) * QP + (e & (QB - 1))] *= zscale;
        }
        __syncthreads();
        PROF(1);
        cholqr(As, Cs, Ls, 0);
        PROF(2);
        // ---- filter steps: Q <- cholqr(G (G Q))
        const int n_it = (p == 0 || iters >= 0) ? n_it0 : ITER_TAB[(2 * HALF + 1) + r];
        for (int it = 0; it < n_it; ++it) {
            gemm_gx(Gs, As, Bs);
            __syncthreads();
            gemm_gx(Gs, Bs, As);
            __syncthreads();
            PROF(3);
            cholqr(As, Cs, Ls, 0);
            PROF(2);
        }
        }  // item < 2
        if (p == 1 && item == 1) {  // item 1 ends; Q to GSAVE (G unchanged since item 0)
            for (int e = t; e < K_ * QB; e += NT) Gsave[K_ * K_ + e] = As[(e >> LQB) * QP + (e & (QB - 1))];
            __threadfence();
            __syncthreads();
            if (t == 0) atomicExch(SYNC + 1 + n, 2);
            return;
        }
        // ---- refill damped columns with fixed unit directions, then Cholesky-QR twice
        {
            const int c = t & (QB - 1), g = t >> LQB;
            double s = 0.0;
            for (int i = g; i < K_; i += RS) s = fma(As[i * QP + c], As[i * QP + c], s);
            Cs[g * QP + c] = s;
            __syncthreads();
            if (t < QB) {
                double sum = 0.0;
                for (int gg = 0; gg < RS; ++gg) sum += Cs[gg * QP + t];
                misc[M_W + t] = sqrt(fmax(1.0 - sum, 0.0));
            }
            __syncthreads();
            for (int e = t; e < K_ * QB; e += NT) {
                const int i = e >> LQB, cc = e & (QB - 1);
                As[i * QP + cc] += (FILLC * misc[M_W + cc]) * FILLD[(p * K_ + i) * UL + cc];
            }
            __syncthreads();
        }
        PROF(4);
        // checked (the full algorithm): left as it is when orthonormal already (ORTH_TOL); an attempt's certificate
        // is for an orthonormal basis to the shift's rounding (SCALE_SLACK), so its pair always runs
        SKIPS(cholqr(As, Cs, Ls, attempt ? 0 : QB));
        SKIPS(cholqr(As, Cs, Ls, attempt ? 0 : QB));
        PROF(2);
        // ---- Rayleigh-Ritz: T = Q^T G Q (lower triangle), cyclic parallel Jacobi (A: Cs/Ls, V: Bs halves)
        gemm_gx(Gs, As, Bs);
        __syncthreads();
        PROF(3);
        gemm_xty<JQP>(As, Bs, Cs, true, false);
        __syncthreads();
        if (attempt) {  // R0 = GQ - Q T into Gs (an attempt needs G no more): the residual of the block
            for (int e = t; e < K_ * QB; e += NT) {
                const int i = e >> LQB, c = e & (QB - 1);
                double s = 0.0;
#pragma unroll 8
                for (int m = 0; m < QB; ++m) s = fma(As[i * QP + m], Cs[m * JQP + c], s);
                Gs[i * QP + c] = Bs[i * QP + c] - s;
            }
            __syncthreads();
        }
        PROF(5);
        double* A = Cs;
        double* A2 = Ls;
        double* W = Bs;
        double* W2 = Bs + QB * QP;
        double* cc = misc + M_CC;
        double* sg = misc + M_SG;
        double* dd = misc + M_DD;
        double* dn = misc + M_DN;
        double* pp = misc + M_PP;
        double* rt = misc + M_RT;
        double fro = 0.0, off = 0.0;
        for (int e = t; e < QB * QB; e += NT) {
            const int i = e >> LQB, j = e & (QB - 1);
            W[i * QP + j] = (i == j) ? 1.0 : 0.0;
            const double a = A[i * JQP + j];
            fro = fma(a, a, fro);
            if (i != j) off = fma(a, a, off);
        }
        if (t < QB) dd[t] = A[t * JQP + t];
        fro = block_sum(fro, misc + M_RED);
        off = block_sum(off, misc + M_RED);
        const double thresh = tol2 * fro;
        bool any = true;
#ifdef GDNVIZ_PAIR_JACOBI
        double dreg = dd[t & (QB - 1)];  // index (t & (QB - 1))'s diagonal entry (block_sum's barriers passed)
#endif
        for (int sweep = 0; sweep < max_sweeps && off > thresh && any; ++sweep) {
            bool rotated = false;
            // Pair-block rounds (GDNVIZ_PAIR_JACOBI): every warp computes all QB rotations of the round itself,
            // lane l the one of index l & (QB - 1), so that their parameters are read by warp shuffles and the
            // diagonal lives in registers (dreg: index l's); thread b updates one 2 x 2 block of A and of W — rows
            // of pair b / NPAIR, columns of pair b % NPAIR — from 4 loads of each, with the same rot2 expressions
            // per entry as the per-entry form below, so the same bits; one barrier per round instead of two, and no
            // rotation parameters through shared memory (their loads were most of a round's shared-memory traffic).
            // Built for 32-column blocks only (the GDNVIZ_PAIR_JACOBI define above): at 16 columns 64 of the 256 threads would
            // update the 8 x 8 blocks, and the r = 1 attempt measured 7% slower
            for (int k = 0; k < QB - 1; ++k) {
#ifdef GDNVIZ_PAIR_JACOBI
                const int li = t & (QB - 1);
                const int pr = jacobi_partner(li, k);
                double c, sgn, dnew;
                const bool rot = jacobi_rotation(A[li * JQP + pr], A[pr * JQP + li], dreg,
                                                 __shfl_sync(0xffffffffu, dreg, pr), li < pr, skip, c, sgn, dnew);
                rotated = rotated || rot;
                PROF(12);
                const int bl = t & (NPAIR * NPAIR - 1), pa = bl / NPAIR, pb = bl % NPAIR;
                const int p0 = pa ? (k + pa) % (QB - 1) : k, q0 = pa ? (k - pa + QB - 1) % (QB - 1) : QB - 1;
                const int p1 = pb ? (k + pb) % (QB - 1) : k, q1 = pb ? (k - pb + QB - 1) % (QB - 1) : QB - 1;
                // a pair's two members hold the same cosine and opposite signed sines (jacobi_rotation), so one
                // member's pair of shuffles serves both
                const double cp = __shfl_sync(0xffffffffu, c, p0), sp = __shfl_sync(0xffffffffu, sgn, p0);
                const double cq = cp, sq = -sp;
                const double cp1 = __shfl_sync(0xffffffffu, c, p1), sp1 = __shfl_sync(0xffffffffu, sgn, p1);
                const double cq1 = cp1, sq1 = -sp1;
                const double dp = __shfl_sync(0xffffffffu, dnew, p0), dq = __shfl_sync(0xffffffffu, dnew, q0);
                const bool rp = __shfl_sync(0xffffffffu, rot ? 1 : 0, p0) != 0;
                if (t < NPAIR * NPAIR) {
                    const double x = A[p0 * JQP + p1], y = A[p0 * JQP + q1], z = A[q0 * JQP + p1], u = A[q0 * JQP + q1];
                    const double xp = rot2(cp1, x, sp1, y), zp = rot2(cp1, z, sp1, u);  // columns p1 of rows p0, q0
                    const double yq = rot2(cq1, y, sq1, x), uq = rot2(cq1, u, sq1, z);  // columns q1
                    double vpp = rot2(cp, xp, sp, zp), vpq = rot2(cp, yq, sp, uq);
                    double vqp = rot2(cq, zp, sq, xp), vqq = rot2(cq, uq, sq, yq);
                    if (pa == pb) {  // the diagonal block: Rutishauser's diagonal, the annihilated pair exact 0
                        vpp = dp;
                        vqq = dq;
                        if (rp) vpq = vqp = 0.0;
                    }
                    A2[p0 * JQP + p1] = vpp;
                    A2[p0 * JQP + q1] = vpq;
                    A2[q0 * JQP + p1] = vqp;
                    A2[q0 * JQP + q1] = vqq;
                    const double wpp = W[p0 * QP + p1], wpq = W[p0 * QP + q1];
                    const double wqp = W[q0 * QP + p1], wqq = W[q0 * QP + q1];
                    W2[p0 * QP + p1] = rot2(cp1, wpp, sp1, wpq);
                    W2[p0 * QP + q1] = rot2(cq1, wpq, sq1, wpp);
                    W2[q0 * QP + p1] = rot2(cp1, wqp, sp1, wqq);
                    W2[q0 * QP + q1] = rot2(cq1, wqq, sq1, wqp);
                }
                dreg = dnew;
#else
                if (t < QB) {  // the rotation of index t's pair in round k (both members compute the same one)
                    const int pr = jacobi_partner(t, k);
                    const double a_ip = A[t * JQP + pr], a_pi = A[pr * JQP + t];
                    double c, sgn, dnew;
                    const bool rot = jacobi_rotation(a_ip, a_pi, dd[t], dd[pr], t < pr, skip, c, sgn, dnew);
                    rotated = rotated || rot;
                    cc[t] = c;
                    sg[t] = sgn;
                    pp[t] = (double)pr;
                    rt[t] = rot ? 1.0 : 0.0;
                    dn[t] = dnew;
                }
                PROF(12);  // profile build: a round's parts (rotations, barriers, apply); PROF(6) keeps the rest
                __syncthreads();
                PROF(13);
                for (int e = t; e < QB * QB; e += NT) {  // A2 = J^T A J, W2 = W J
                    const int i = e >> LQB, j = e & (QB - 1);
                    const int pi = (int)pp[i], pj = (int)pp[j];
                    const double ci = cc[i], si = sg[i], cj = cc[j], sj = sg[j];
                    double v = rot2(ci, rot2(cj, A[i * JQP + j], sj, A[i * JQP + pj]),
                                    si, rot2(cj, A[pi * JQP + j], sj, A[pi * JQP + pj]));
                    if (i == j) v = dn[i];
                    else if (j == pi && rt[i] != 0.0) v = 0.0;
                    A2[i * JQP + j] = v;
                    W2[i * QP + j] = rot2(cj, W[i * QP + j], sj, W[i * QP + pj]);
                }
                if (t < QB) dd[t] = dn[t];
#endif
                PROF(14);
                __syncthreads();
                PROF(13);
                double* tmp = A; A = A2; A2 = tmp;
                tmp = W; W = W2; W2 = tmp;
            }
            double o = 0.0;
            for (int e = t; e < QB * QB; e += NT) {
                const int i = e >> LQB, j = e & (QB - 1);
                if (i != j) o = fma(A[i * JQP + j], A[i * JQP + j], o);
            }
            off = block_sum(o, misc + M_RED);
            any = block_sum(rotated ? 1.0 : 0.0, misc + M_RED) > 0.0;
#ifdef GDNVIZ_PROFILE
            pacc[15] += 1;
#endif
        }
#ifdef GDNVIZ_PAIR_JACOBI
        if (t < QB) dd[t] = dreg;
        __syncthreads();
#endif
        PROF(6);
        // ---- the top `take` Ritz vectors (descending, ties by index) -> U columns HALF*p ...
        // NaN Ritz values (a state with NaN or inf) rank last: the ranks stay a permutation, so every selected
        // column index is valid (with NaN compared as is, no rank was 1 .. take - 1 and the column index read
        // from unwritten shared memory was out of bounds: a crash, found by the emulation)
        if (t < QB) {
            const double di = (dd[t] == dd[t]) ? dd[t] : -1.7976931348623157e308;
            int rk = 0;
            for (int j = 0; j < QB; ++j) {
                const double dj = (dd[j] == dd[j]) ? dd[j] : -1.7976931348623157e308;
                rk += (dj > di || (dj == di && j < t)) ? 1 : 0;
            }
            if (rk < take) misc[M_SEL + rk] = (double)t;
            misc[M_RK + t] = (double)rk;
        }
        __syncthreads();
#ifdef GDNVIZ_DMMA
        {  // U columns HALF p + m = Q W[:, sel[m]] (m < take), B[k][m] = W[k][sel[m]] gathered per lane
            const int lane = t & 31, w = t >> 5, lr = lane >> 2, lk = lane & 3;
            const double* Wc = W;
            double acc[HALF / 8][RT][2];
            gemm_xb<HALF / 8>(As, [&](int k, int m) { return (m < take) ? Wc[k * QP + (int)misc[M_SEL + m]] : 0.0; },
                              acc);
#pragma unroll
            for (int b = 0; b < HALF / 8; ++b)
#pragma unroll
                for (int a = 0; a < RT; ++a)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int m = 8 * b + 2 * lk + h;
                        if (m < take) Un[(8 * (RT * w + a) + lr) * UL + HALF * p + m] = acc[b][a][h];
                    }
        }
#else
        for (int e = t; e < K_ * HALF; e += NT) {
            const int i = e >> 4, m = e & (HALF - 1);
            if (m < take) {
                const int col = (int)misc[M_SEL + m];
                double s = 0.0;
#pragma unroll 8
                for (int c = 0; c < QB; ++c) s = fma(As[i * QP + c], W[c * QP + col], s);
                Un[i * UL + HALF * p + m] = s;
            }
        }
#endif
        __syncthreads();
        PROF(7);
        if (attempt) {
            // ---- certificate (gdnviz.truncate.energy_error_bound in the Ritz basis U = QW, T' = A = W^T T W):
            // error <= (||T'_rc||^2 + ||R_r||^2) / (lmin(T'_rr) - c), c = max(lmax(T'_cc), ||D||_F) + ||R_c||,
            // R = R0 W, ||D||^2 = ||G||^2 - ||T'||^2 - 2||R||^2 (or tr(D), below); lmin / lmax from A's diagonal -/+
            // the Frobenius norm of the block's off-diagonal part (Weyl)
            double* part = A2;  // free after the Jacobi
            {
                const int c = t & (QB - 1), g = t >> LQB;
                double acc = 0.0;
                for (int i = g; i < K_; i += RS) {
                    double v = 0.0;
#pragma unroll 8
                    for (int m = 0; m < QB; ++m) v = fma(Gs[i * QP + m], W[m * QP + c], v);
                    acc = fma(v, v, acc);
                }
                part[g * QP + c] = acc;
            }
            __syncthreads();
            if (t < QB) {
                double sum = 0.0;
                for (int g = 0; g < RS; ++g) sum += part[g * QP + t];
                misc[M_RN + t] = sum;
            }
            double v4[4] = {0.0, 0.0, 0.0, 0.0};  // off-diagonal A^2: r x c (both triangles), r x r, c x c; all A^2
            for (int e = t; e < QB * QB; e += NT) {
                const int i = e >> LQB, j = e & (QB - 1);
                const double a2 = A[i * JQP + j] * A[i * JQP + j];
                v4[3] += a2;
                if (i != j) {
                    const bool ki = misc[M_RK + i] < (double)take, kj = misc[M_RK + j] < (double)take;
                    v4[(ki && kj) ? 1 : ((!ki && !kj) ? 2 : 0)] += a2;
                }
            }
            block_sum4(v4, misc + M_R4);  // its first barrier also publishes M_RN
            double rr = 0.0, rc = 0.0, dmin = NO_BOUND, cmax = 0.0, kept = 0.0, trt = 0.0;
            for (int j = 0; j < QB; ++j) {
                const double d = A[j * JQP + j], rn = misc[M_RN + j];
                trt += d;
                if (misc[M_RK + j] < (double)take) { rr += rn; dmin = fmin(dmin, d); kept += d; }
                else { rc += rn; cmax = fmax(cmax, d); }
            }
            const double lam_c = (take < QB) ? cmax + sqrt(v4[2]) : 0.0;
            // ||D||_F: the difference ||G||^2 - ||T'||^2 - 2||R||^2 cancels (its rounding reached ~7e-14, a ~3e-7
            // floor on ||D||_F that can over- or understate a tiny D), so it gets the slack D2_SLACK, and it is
            // capped by tr(D) = tr(G) - tr(T') = 1 - tr(T') >= ||D||_F (D is positive semidefinite), which does not
            // cancel (its rounding, ~(K + QB) eps, is covered by DTR_SLACK): rank-deficient states, where D = 0,
            // keep a bound of ~1e-12 instead of the floor (gdnviz.truncate.energy_error_bound forms D instead)
            const double d2 = fmax(gf2 - v4[3] - 2.0 * (rr + rc), 0.0);
            const double dfro = fmin(sqrt(d2 + D2_SLACK), fmax(1.0 - trt, 0.0) + DTR_SLACK);
            const double gap = dmin - sqrt(v4[1]) - (fmax(lam_c, dfro) + sqrt(rc));
            const double num = 0.5 * v4[0] + rr;
            const bool zero = tr == 0.0;
            // and the error is at most the energy the kept directions miss, 1 - tr(T'_rr) (G has trace 1): this
            // certifies rank-deficient states, where T'_rr is singular and the gap test cannot. A state with NaN or
            // inf gets no bound (every comparison below is false for NaN; fmax / fmin would drop a NaN)
            const double miss = 1.0 - kept;
            const double b_gap = (gap > 0.0) ? num / gap + SCALE_SLACK : NO_BOUND;
            const double b_miss = (miss == miss) ? fmax(miss, 0.0) + SCALE_SLACK : NO_BOUND;
            const double bound = zero ? 0.0 : ((b_gap == b_gap && b_gap < b_miss) ? b_gap : b_miss);
            const bool ok = zero || bound <= cert_tol;
            if (t == 0) { DONE[n] = ok ? 1 : 0; BOUND[n] = bound; }
            PROF(11);
            if (!ok) return;  // block-uniform: every thread computed the same numbers
        }
        if (p + 1 < npass) {
            // ---- deflate: G <- (I - UU^T) G (I - UU^T) = G - U Y^T - Y U^T, Y = GU - U (U^T G U) / 2; trace 1 again
            for (int e = t; e < K_ * QB; e += NT) Bs[(e >> LQB) * QP + (e & (QB - 1))] = Un[(e >> LQB) * UL + (e & (QB - 1))];
            __syncthreads();
            gemm_gx(Gs, Bs, As);  // GU
            __syncthreads();
            gemm_xty(Bs, As, Cs, false, false);  // U^T G U
            __syncthreads();
#ifdef GDNVIZ_DMMA
            sub_xc(Bs, Cs, As, 0.5, 1.0);  // Y = GU - U (U^T G U) / 2 into As
#else
            double y[K_ * QB / NT];
#pragma unroll
            for (int m = 0; m < K_ * QB / NT; ++m) {
                const int e = t + m * NT, i = e >> LQB, c = e & (QB - 1);
                double s = 0.0;
#pragma unroll 8
                for (int mm = 0; mm < QB; ++mm) s = fma(Bs[i * QP + mm], Cs[mm * QP + c], s);
                y[m] = As[i * QP + c] - 0.5 * s;
            }
            __syncthreads();
#pragma unroll
            for (int m = 0; m < K_ * QB / NT; ++m) {
                const int e = t + m * NT;
                As[(e >> LQB) * QP + (e & (QB - 1))] = y[m];
            }
#endif
            __syncthreads();
            double t2;
#ifdef GDNVIZ_DMMA
            // on the tensor cores: P = U Y^T + Y U^T = [U Y] [Y U]^T (a sum over 2 QB), only the lower triangle's
            // items (the Gram's assignment, lower_items: 9 per warp at K = 128), G_ij - P_ij written to both (i, j) and
            // (j, i), so G stays symmetric bit for bit; each (i, j), i >= j, is read and written by one lane only
            {
                const int w = t >> 5, lk = t & 3;
                int irow[GSL], icol[GSL], rb0, rb1;
                double acc[GSL][RT][2];
                lower_items(w, irow, icol, acc, rb0, rb1);
#pragma unroll 1
                for (int half = 0; half < 2; ++half) {
                    const double* L = half ? As : Bs;  // A[i][k]: U, then Y
                    const double* R = half ? Bs : As;  // B[k][j] = Y[j][k], then U[j][k]
#pragma unroll 2
                    for (int k0 = 0; k0 < QB; k0 += 4) lower_step(L, QP, R, QP, k0 + lk, rb0, rb1, irow, icol, acc);
                }
                lower_store(irow, icol, acc, Gs, true);
                t2 = gram_trace(Gs, misc + M_RED);
            }
#else
            {
                double acc[KR][KR];
#pragma unroll
                for (int a = 0; a < KR; ++a)
#pragma unroll
                    for (int b = 0; b < KR; ++b) acc[a][b] = Gs[(ty + 16 * a) * GST + tx + 16 * b];
#pragma unroll 1
                for (int m = 0; m < QB; ++m) {
                    double uj[KR], yj[KR];
#pragma unroll
                    for (int b = 0; b < KR; ++b) {
                        uj[b] = Bs[(tx + 16 * b) * QP + m];
                        yj[b] = As[(tx + 16 * b) * QP + m];
                    }
#pragma unroll
                    for (int a = 0; a < KR; ++a) {
                        const double ui = Bs[(ty + 16 * a) * QP + m], yi = As[(ty + 16 * a) * QP + m];
#pragma unroll
                        for (int b = 0; b < KR; ++b)  // symmetric in (i, j) bit for bit: no contraction
                            acc[a][b] = __dsub_rn(acc[a][b], __dadd_rn(__dmul_rn(ui, yj[b]), __dmul_rn(yi, uj[b])));
                    }
                }
                t2 = store_tile_trace(acc, Gs, misc + M_RED, tx, ty);
            }
#endif
            const bool ok = t2 > 0.0;
            const double g2 = ok ? 1.0 / t2 : 0.0;
            for (int e = t; e < K_ * K_; e += NT) Gs[(e / K_) * GST + (e % K_)] *= g2;
            zscale *= ok ? 1.0 / sqrt(t2) : 0.0;
            __syncthreads();
            PROF(8);
            if (phased) {  // item 0 ends: the deflated G and zscale to GSAVE, visible before the flag
                for (int e = t; e < K_ * K_; e += NT) Gsave[e] = Gs[(e / K_) * GST + (e % K_)];
                if (t == 0) Gsave[K_ * K_ + K_ * QB] = zscale;
                __threadfence();
                __syncthreads();
                if (t == 0) atomicExch(SYNC + 1 + n, 1);
                return;
            }
        }
    }
    // ---- U into As; Cholesky-QR twice after two passes (the second pass's refilled columns need not be ⊥ the first's)
    for (int e = t; e < K_ * QB; e += NT) As[(e >> LQB) * QP + (e & (QB - 1))] = Un[(e >> LQB) * UL + (e & (QB - 1))];
    __syncthreads();
    PROF(9);
    if (npass > 1) {
        SKIPS(cholqr(As, Cs, Ls, r));  // checked over the r kept columns (the rest are zero)
        SKIPS(cholqr(As, Cs, Ls, r));
        PROF(2);
    }
    if (mode & NO_PROJ) {  // U for gdnviz_project (its first r columns are the kept directions)
        for (int e = t; e < K_ * QB; e += NT) Un[(e >> LQB) * UL + (e & (QB - 1))] = As[(e >> LQB) * QP + (e & (QB - 1))];
        return;
    }
    // ---- S_r = U (U^T S): M = U^T S [QB][V] in Gs (S staged through Bs 16 rows at a time, the next 16 in registers),
    // then U M. Only U's first r columns are kept directions (the rest are zero): M's rows and the sum over columns
    // stop there
    {
        const int cg = t & 7, vg = t >> 3, nbu = (r + 7) >> 3;
        double acc[V_ / 32][NB];
#pragma unroll
        for (int a = 0; a < V_ / 32; ++a)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[a][b] = 0.0;
        scalar_t nx[16 * V_ / NT];  // the next 16 rows of S, loaded while a stage's products run
#pragma unroll
        for (int m = 0; m < 16 * V_ / NT; ++m) nx[m] = Sn[t + m * NT];
        for (int k0 = 0; k0 < K_; k0 += 16) {
#pragma unroll
            for (int m = 0; m < 16 * V_ / NT; ++m) Bs[t + m * NT] = (double)nx[m];
            __syncthreads();
            if (k0 + 16 < K_) {
#pragma unroll
                for (int m = 0; m < 16 * V_ / NT; ++m) nx[m] = Sn[(k0 + 16) * V_ + t + m * NT];
            }
#pragma unroll 4
            for (int kk = 0; kk < 16; ++kk) {
                double s[V_ / 32];
#pragma unroll
                for (int a = 0; a < V_ / 32; ++a) s[a] = Bs[kk * V_ + vg + 32 * a];
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    if (b < nbu) {  // block-uniform
                        const double u = As[(k0 + kk) * QP + cg + 8 * b];
#pragma unroll
                        for (int a = 0; a < V_ / 32; ++a) acc[a][b] = fma(u, s[a], acc[a][b]);
                    }
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int a = 0; a < V_ / 32; ++a)
#pragma unroll
            for (int b = 0; b < NB; ++b) Gs[(cg + 8 * b) * V_ + vg + 32 * a] = acc[a][b];
    }
    __syncthreads();
    {
        double acc[KR][VR];
#pragma unroll
        for (int a = 0; a < KR; ++a)
#pragma unroll
            for (int b = 0; b < VR; ++b) acc[a][b] = 0.0;
#pragma unroll 1
        for (int c = 0; c < r; ++c) {
            double m[VR];
#pragma unroll
            for (int b = 0; b < VR; ++b) m[b] = Gs[c * V_ + tx + 16 * b];
#pragma unroll
            for (int a = 0; a < KR; ++a) {
                const double u = As[(ty + 16 * a) * QP + c];
#pragma unroll
                for (int b = 0; b < VR; ++b) acc[a][b] = fma(u, m[b], acc[a][b]);
            }
        }
#pragma unroll
        for (int a = 0; a < KR; ++a)
#pragma unroll
            for (int b = 0; b < VR; ++b) On[(ty + 16 * a) * V_ + tx + 16 * b] = (scalar_t)acc[a][b];
    }
    PROF(10);
#ifdef GDNVIZ_PROFILE
    if (t == 0)
        for (int q = 0; q < 20; ++q) Un[q] = (q < 17) ? (double)pacc[q] : misc[M_CQ + q - 17];
#endif
}

// ---- split launches (mode GRAM_IN | NO_PROJ): the fused kernel's first and last phases over more thread blocks ----

// The fused kernel's lower-triangle items (lower_items: a block of RT 8-row tiles x an 8-column tile; K = 128: 16
// rows, block P with column tiles 0 ... 2P + 1, 72 items; K = 64: 8 x 8 tiles, row tile >= column tile, 36), and
// thread blocks of gdnviz_gram per state (one item per warp, NT / 32 warps per block)
#define GITEMS (K_ == 128 ? 72 : (K_ / 8) * (K_ / 8 + 1) / 2)
#define GRAM_BLOCKS ((GITEMS + NT / 32 - 1) / (NT / 32))

// G [N][K][K] = S S^T, both triangles, unscaled: what the fused kernel holds in Gs before its trace. Grid N *
// GRAM_BLOCKS; warp w of block b computes item b * NT / 32 + w. The DMMA build sums each item with the same
// mma.sync sequence as the fused kernel (dmma_rt, k = 0, 4, ..., V - 4, one accumulator set), the FMA build each
// entry as one chain over v = 0 ... V - 1: the same bits either way.
extern "C" __global__ void __launch_bounds__(NT)
gdnviz_gram(const scalar_t* __restrict__ S, double* __restrict__ G)
{
    const long long n = blockIdx.x / GRAM_BLOCKS;
    const int item = (blockIdx.x % GRAM_BLOCKS) * (NT / 32) + (threadIdx.x >> 5);
    if (item >= GITEMS) return;  // warp-uniform; no barrier in this kernel
    int I = 0;  // row block: items of block I are I (I + 1) ... for K = 128 (2I + 2 each), I (I + 1) / 2 ... for K = 64
    if (K_ == 128) { while ((I + 1) * (I + 2) <= item) ++I; }
    else { while ((I + 1) * (I + 2) / 2 <= item) ++I; }
    const int J = item - ((K_ == 128) ? I * (I + 1) : I * (I + 1) / 2);
    const scalar_t* Sn = S + n * (K_ * V_);
    double* Gn = G + n * (K_ * K_);
    const int lane = threadIdx.x & 31;
#ifdef GDNVIZ_DMMA
    const int lr = lane >> 2, lk = lane & 3;
    double acc[RT][2] = {};
    const scalar_t* b = Sn + (8 * J + lr) * V_ + lk;
    double av[RT][V_ / 4], bv[V_ / 4];  // every load in flight before the chain of mma.sync
#pragma unroll
    for (int q = 0; q < V_ / 4; ++q) {
#pragma unroll
        for (int a = 0; a < RT; ++a) av[a][q] = (double)Sn[(8 * (RT * I + a) + lr) * V_ + lk + 4 * q];
        bv[q] = (double)b[4 * q];
    }
#pragma unroll
    for (int q = 0; q < V_ / 4; ++q) {
        double aa[RT];
#pragma unroll
        for (int a = 0; a < RT; ++a) aa[a] = av[a][q];
        dmma_rt(acc, aa, bv[q]);
    }
#pragma unroll
    for (int a = 0; a < RT; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = 8 * (RT * I + a) + lr, j = 8 * J + 2 * lk + h;
            if (i >= j) { Gn[i * K_ + j] = acc[a][h]; Gn[j * K_ + i] = acc[a][h]; }
        }
#else
    for (int q = lane; q < 64 * RT; q += 32) {
        const int i = 8 * RT * I + (q >> 3), j = 8 * J + (q & 7);
        if (i >= j) {
            double s = 0.0;
            for (int v = 0; v < V_; ++v) s = fma((double)Sn[i * V_ + v], (double)Sn[j * V_ + v], s);
            Gn[i * K_ + j] = s;
            Gn[j * K_ + i] = s;
        }
    }
#endif
}

// S_r = U (U^T S) from the U that gdnviz_truncate left in the scratch (mode NO_PROJ), 16 columns of S per thread
// block: grid N * (V / 16). States with rank >= min(K, V) or an invalid rank were written by gdnviz_truncate itself.
// U's r columns and the block's columns of S are staged in shared memory first (every load in flight at once), then
// M = U^T S as one chain over k per entry and S_r as one chain over the r kept columns: the fused kernel's order.
#define PCOLS 16
#define PROJ_SMEM_DOUBLES (K_ * 2 * HALF + K_ * PCOLS + 2 * HALF * PCOLS)
extern "C" __global__ void __launch_bounds__(NT)
gdnviz_project(const scalar_t* __restrict__ S, scalar_t* __restrict__ OUT, const int* __restrict__ RANKS, int rank,
               int rank_stride, const double* __restrict__ USCR)
{
    extern __shared__ double psm[];  // U [K][2 HALF], S's columns [K][PCOLS], M [2 HALF][PCOLS]
    double* Us = psm;
    double* Ss = psm + K_ * 2 * HALF;
    double* Ms = Ss + K_ * PCOLS;
    const long long n = blockIdx.x / (V_ / PCOLS);
    const int v0 = (blockIdx.x % (V_ / PCOLS)) * PCOLS;
    const int r = (rank_stride >= 0) ? RANKS[n * rank_stride] : rank;
    if (r >= M_ || r < 1 || r > 2 * HALF) return;  // block-uniform
    const scalar_t* Sn = S + n * (K_ * V_);
    scalar_t* On = OUT + n * (K_ * V_);
    const double* Un = USCR + n * (K_ * UL);
    const int t = threadIdx.x;
    for (int e = t; e < K_ * 2 * HALF; e += NT) Us[e] = Un[(e / (2 * HALF)) * UL + e % (2 * HALF)];
    for (int e = t; e < K_ * PCOLS; e += NT) Ss[e] = (double)Sn[(e / PCOLS) * V_ + v0 + e % PCOLS];
    __syncthreads();
    for (int e = t; e < r * PCOLS; e += NT) {
        const int c = e / PCOLS, v = e % PCOLS;
        double s = 0.0;
#pragma unroll 8
        for (int k = 0; k < K_; ++k) s = fma(Us[k * 2 * HALF + c], Ss[k * PCOLS + v], s);
        Ms[e] = s;
    }
    __syncthreads();
    for (int e = t; e < K_ * PCOLS; e += NT) {
        const int i = e / PCOLS, v = e % PCOLS;
        double s = 0.0;
        for (int c = 0; c < r; ++c) s = fma(Us[i * 2 * HALF + c], Ms[c * PCOLS + v], s);
        On[i * V_ + v0 + v] = (scalar_t)s;
    }
}
