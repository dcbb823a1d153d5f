// pagellm-int4's CUDA kernels over the fragment layout (pagellm_int4/fragment_layout.py).
//
// w4a16_mma_*: out[M, N] = x[M, K] @ W[K, N] for small M (decode), on the tensor cores with
// the product transposed, out^T = W^T x^T: the weights are the A operand of
// mma.sync.m16n8k16 (16 output columns x 16 inputs), the activations the B operand (16 inputs
// x 8 rows of x), so M <= 8 fills a whole MMA and 9..16 takes two. One warp streams one
// 64-column strip of W over a run of K in 16-row steps: each step is one 16-byte load a lane
// (the 1,024 codes of a 16 x 64 tile, laid out so that a lane's four words are its A
// fragments for the strip's four 16-column MMAs), a shift and a LOP3 per register of codes,
// four MMAs, and a fifth with a fragment of ones that sums x over the step's rows. A code
// becomes the float bits of offset + q by one LOP3 (offset 128 for bfloat16, 1024 for
// float16, whose mantissas then hold q exactly); at the end of each quantization group (or
// every SPG steps of it) the float32 sums give sum (q - z) x = sum (offset + q) x -
// (offset + z) sum x, scaled once per group and column. The loop runs in straight-line passes
// (no condition around the loads, so each load stays in flight in its own registers until its
// step; steps past a warp's run meet zero x). Warps of a block take consecutive runs of K and
// add their sums through shared memory in a fixed order; blocks of a split write float32
// partial sums that the last block of a strip to finish adds in split order (a counter per
// strip, put back to zero), so results do not depend on timing. Launched with programmatic
// dependent launch (sm_90+, `MmaConfig`'s caller decides), a GEMM's first weight loads overlap
// the end of the kernel before it: it waits for that kernel only before it reads x.
//
// dequantize_t_*: W^T [N, K] in the activations' dtype ((q - z) * scale in float32, one
// rounding: bit for bit the reference path's dequantization), for a cuBLAS GEMM at large M;
// dequantize_t_staged_*: the same through shared memory, stored in whole 16-byte pieces.

#include "fragments.cuh"

namespace {

template <typename D, int MB, int DEPTH, int XDEPTH, int PF, int SPG>
__device__ __forceinline__ void w4a16_mma(const typename D::T* __restrict__ x,
                                          const uint4* __restrict__ w,
                                          const float* __restrict__ scales,
                                          const uint8_t* __restrict__ zeros,
                                          typename D::T* __restrict__ out,
                                          float* __restrict__ ws, int* __restrict__ counters,
                                          int M, int N, int K, int ldx, int k16, int spg,
                                          int groups, int steps, int splits) {
  // SPG: steps (16 rows each) between two scalings of the sums, dividing the quantization
  // group's spg; UNROLL: steps of one pass of the loop, whose body is straight-line code (no
  // condition around the loads, so the compiler keeps each load in flight in its register of
  // the ring until its step: a copy of a register still being loaded would wait for it).
  // XDEPTH: steps of x loaded ahead (x is read by every strip, so mostly from L1 or L2: it
  // needs a shorter ring than the weights, and each step of it is MB * 2 registers). PF: when
  // not 0, each step also prefetches into L2 the tile PF steps ahead (more of the weights in
  // flight from memory than the registers of the ring hold; the ring's loads then hit L2).
  using T = typename D::T;
  constexpr int UNROLL = DEPTH > SPG ? DEPTH : SPG;
  constexpr int PREFETCH = 8;
  static_assert(UNROLL % XDEPTH == 0 && XDEPTH <= DEPTH, "x's ring must divide a pass");
  static_assert(PF == 0 || (PF > DEPTH && PF <= DEPTH + PREFETCH), "prefetch past the ring");
  extern __shared__ float red[];  // [warps][MB * 8][64]
  __shared__ int last_block;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int nt = blockIdx.x;
  const int split = blockIdx.y;
  const long n_pad = (long)gridDim.x * 64;
  const int first = (split * warps + warp) * steps;  // steps: a multiple of UNROLL
  const int n_steps = min(steps, k16 - first);

  float acc[MB][4][4];
#pragma unroll
  for (int b = 0; b < MB; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[b][j][e] = 0.f;

  if (n_steps > 0) {
    // Weights: the next step's tile to load. The layout has PAD_TILES tiles of padding past
    // its end, so loads and prefetches past a warp's last step need no guard (the loaded
    // values meet zero x).
    const uint4* wq = w + ((long)nt * k16 + first) * 32 + lane;
    // The B fragments: x[8 b + g, k + 2 c .. +1] and [.., k + 8 + 2 c .. +1] of each step
    // (K is a multiple of 16); zero for rows past M and for steps past the warp's last.
    const uint32_t* xq[MB];
    bool row_in[MB];
#pragma unroll
    for (int b = 0; b < MB; ++b) {
      row_in[b] = 8 * b + g < M;
      xq[b] = reinterpret_cast<const uint32_t*>(x + (long)(row_in[b] ? 8 * b + g : 0) * ldx +
                                                16 * first + 2 * c);
    }
    uint4 wbuf[DEPTH];
    uint32_t xbuf[XDEPTH][MB][2];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      wbuf[d] = load_weights(wq);
      wq += 32;
    }
    // The weights' first loads are on their way, and the next PREFETCH steps' tiles go to L2
    // (no registers held); then wait for the kernel before (launched with programmatic
    // dependent launch, this one may start while that one ends): x is its output.
#pragma unroll
    for (int d = 0; d < PREFETCH; ++d)
      if (DEPTH + d < n_steps) prefetch_l2(wq + d * 32);
    wait_for_previous_grid();
#pragma unroll
    for (int d = 0; d < XDEPTH; ++d) {
#pragma unroll
      for (int b = 0; b < MB; ++b) {
        const bool live = d < n_steps && row_in[b];
        xbuf[d][b][0] = live ? __ldg(xq[b]) : 0u;
        xbuf[d][b][1] = live ? __ldg(xq[b] + 4) : 0u;
        xq[b] += 8;
      }
    }
    // A fragment of ones: its product with x is x's sum over the step's 16 rows, in every row.
    const uint32_t ones[4] = {D::ONE, D::ONE, D::ONE, D::ONE};
    const int col = nt * 64 + g * 8;

    const int passes = (n_steps + UNROLL - 1) / UNROLL;
    for (int pass = 0; pass < passes; ++pass) {
      float part[MB][4][4];  // sum over the group's rows of (offset + q) x
      float xsum[MB][4];     // sum of x over them (c0, c1: rows 2 c, 2 c + 1; c2, c3 the same)
      GroupMeta meta;
#pragma unroll
      for (int t = 0; t < UNROLL; ++t) {
        const int s = pass * UNROLL + t;
        if (t % SPG == 0) {
          // A group starts: its scales and zero points (used at its end), sums from zero.
          const int row = min((first + s) / spg, groups - 1);
          meta = load_group(scales, zeros, (long)row * n_pad, col);
#pragma unroll
          for (int b = 0; b < MB; ++b) {
#pragma unroll
            for (int e = 0; e < 4; ++e) xsum[b][e] = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) part[b][j][e] = 0.f;
          }
        }
        const int d = t % DEPTH;
        const int dx = t % XDEPTH;
        const uint32_t words[4] = {wbuf[d].x, wbuf[d].y, wbuf[d].z, wbuf[d].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t a[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = code_pair<D::MAGIC>(words[j] >> (4 * i));
#pragma unroll
          for (int b = 0; b < MB; ++b) mma<D>(part[b][j], a, xbuf[dx][b][0], xbuf[dx][b][1]);
        }
#pragma unroll
        for (int b = 0; b < MB; ++b) mma<D>(xsum[b], ones, xbuf[dx][b][0], xbuf[dx][b][1]);
        // The slots' registers are free: the steps DEPTH (weights) and XDEPTH (x) ahead go
        // into them.
        wbuf[d] = load_weights(wq);
        wq += 32;
        if (PF != 0) prefetch_l2(wq + (PF - DEPTH - 1) * 32);  // (padding past the end)
        const bool ahead = s + XDEPTH < n_steps;
#pragma unroll
        for (int b = 0; b < MB; ++b) {
          const bool live = ahead && row_in[b];
          xbuf[dx][b][0] = live ? __ldg(xq[b]) : 0u;
          xbuf[dx][b][1] = live ? __ldg(xq[b] + 4) : 0u;
          xq[b] += 8;
        }
        if (t % SPG == SPG - 1) {
          // The group ends: sum (q - z) x = part - (offset + z) xsum, times the scale
          // (c0, c1: column 16 j + g, h = 0; c2, c3: + 8, h = 1).
          const float sc[8] = {meta.s0.x, meta.s0.y, meta.s0.z, meta.s0.w,
                               meta.s1.x, meta.s1.y, meta.s1.z, meta.s1.w};
          float zo[8];
#pragma unroll
          for (int q = 0; q < 8; ++q)
            zo[q] = D::OFFSET + (float)(((q < 4 ? meta.z.x : meta.z.y) >> (8 * (q & 3))) & 0xffu);
#pragma unroll
          for (int b = 0; b < MB; ++b)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int q = 2 * j + (e >> 1);
                acc[b][j][e] = fmaf(sc[q], part[b][j][e] - zo[q] * xsum[b][e], acc[b][j][e]);
              }
        }
      }
    }
  }

  wait_for_previous_grid();  // (warps without steps): before out, ws and the counters
  // The block's warps add their sums in warp order through shared memory.
  constexpr int ROWS = MB * 8;
  float* mine = red + warp * ROWS * 64;
#pragma unroll
  for (int b = 0; b < MB; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = 8 * b + 2 * c;
      const int n = 16 * j + g;
      mine[m * 64 + n] = acc[b][j][0];
      mine[(m + 1) * 64 + n] = acc[b][j][1];
      mine[m * 64 + n + 8] = acc[b][j][2];
      mine[(m + 1) * 64 + n + 8] = acc[b][j][3];
    }
  __syncthreads();
  const int rows = min(M, ROWS);
  for (int i = threadIdx.x; i < rows * 64; i += blockDim.x) {
    float v = 0.f;
    for (int q = 0; q < warps; ++q) v += red[q * ROWS * 64 + i];
    const int m = i >> 6;
    const int n = nt * 64 + (i & 63);
    if (n < N) {
      if (splits == 1)
        out[(long)m * N + n] = to_out<T>(v);
      else
        ws[((long)split * M + m) * N + n] = v;
    }
  }
  if (splits == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_block = atomicAdd(counters + nt, 1) == splits - 1;
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  for (int i = threadIdx.x; i < rows * 64; i += blockDim.x) {
    const int m = i >> 6;
    const int n = nt * 64 + (i & 63);
    if (n < N) {
      float v = 0.f;
      for (int q = 0; q < splits; ++q) v += __ldcg(ws + ((long)q * M + m) * N + n);
      out[(long)m * N + n] = to_out<T>(v);
    }
  }
  if (threadIdx.x == 0) counters[nt] = 0;
}

}  // namespace


#define PAGELLM_W4A16_MMA(NAME, D, MB, DEPTH, XDEPTH, PF, SPG)                                 \
  extern "C" __global__ void __launch_bounds__(MB == 1 && SPG >= 4 ? 512 : 256) NAME(        \
      const D::T* x, const uint4* w, const float* scales, const uint8_t* zeros, D::T* out,     \
      float* ws, int* counters, int M, int N, int K, int ldx, int k16, int spg, int groups,    \
      int steps, int splits) {                                                                 \
    w4a16_mma<D, MB, DEPTH, XDEPTH, PF, SPG>(x, w, scales, zeros, out, ws, counters, M, N, K,  \
                                             ldx, k16, spg, groups, steps, splits);            \
  }

// w4a16_mma_<dtype>_m<rows>_d<depth>[x<x depth>][p<prefetch>]_s<steps a scaling> (x's depth
// that of the weights where not named; no L2 prefetch in the loop where not named). Blocks of up
// to 16 warps for 8 rows and 4 or 8 steps a scaling (their registers fit 512 threads), else up
// to 8. x's shorter ring and the prefetch only with 4 or 8 steps a scaling (groups of 64 or more
// rows; with fewer, ptxas spills x's shorter ring).
#define PAGELLM_W4A16_MMA_S48(D, NAME, MB, ROWS, DEPTH, XDEPTH, PF, RING)                      \
  PAGELLM_W4A16_MMA(w4a16_mma_##NAME##_m##ROWS##_##RING##_s4, D, MB, DEPTH, XDEPTH, PF, 4)     \
  PAGELLM_W4A16_MMA(w4a16_mma_##NAME##_m##ROWS##_##RING##_s8, D, MB, DEPTH, XDEPTH, PF, 8)
#define PAGELLM_W4A16_MMA_SPG(D, NAME, MB, ROWS, DEPTH)                                        \
  PAGELLM_W4A16_MMA(w4a16_mma_##NAME##_m##ROWS##_d##DEPTH##_s1, D, MB, DEPTH, DEPTH, 0, 1)     \
  PAGELLM_W4A16_MMA(w4a16_mma_##NAME##_m##ROWS##_d##DEPTH##_s2, D, MB, DEPTH, DEPTH, 0, 2)     \
  PAGELLM_W4A16_MMA_S48(D, NAME, MB, ROWS, DEPTH, DEPTH, 0, d##DEPTH)

#define PAGELLM_W4A16_MMA_DTYPE(D, NAME)                                                       \
  PAGELLM_W4A16_MMA_SPG(D, NAME, 1, 8, 4)                                                      \
  PAGELLM_W4A16_MMA_SPG(D, NAME, 2, 16, 4)                                                     \
  PAGELLM_W4A16_MMA_SPG(D, NAME, 1, 8, 8)                                                      \
  PAGELLM_W4A16_MMA_SPG(D, NAME, 2, 16, 8)                                                     \
  PAGELLM_W4A16_MMA_S48(D, NAME, 1, 8, 8, 2, 0, d8x2)                                          \
  PAGELLM_W4A16_MMA_S48(D, NAME, 2, 16, 8, 2, 0, d8x2)                                         \
  PAGELLM_W4A16_MMA_S48(D, NAME, 1, 8, 8, 8, 16, d8p16)                                        \
  PAGELLM_W4A16_MMA_S48(D, NAME, 2, 16, 8, 8, 16, d8p16)                                       \
  PAGELLM_W4A16_MMA_S48(D, NAME, 1, 8, 8, 2, 16, d8x2p16)                                      \
  PAGELLM_W4A16_MMA_S48(D, NAME, 2, 16, 8, 2, 16, d8x2p16)

PAGELLM_W4A16_MMA_DTYPE(Bf16, bf16)
PAGELLM_W4A16_MMA_DTYPE(Fp16, fp16)

#include "dequantize.cuh"
