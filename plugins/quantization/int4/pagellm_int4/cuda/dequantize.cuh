// pagellm-int4: W^T [N, K] from the fragment layout, in the activations' dtype, for a cuBLAS
// GEMM at large M (included by w4a16_mma.cu: one cubin).
#pragma once

#include "fragments.cuh"

namespace {

// One 16 x 64 tile (strip nt, rows 16 kt ..) dequantized by a warp: (q - z) * scale in float32,
// one rounding; store(col, row, bits) gets each lane's pair of W^T values at column col of the
// strip (W^T's row) and rows row, row + 1 of the tile.
template <typename D, typename Store>
__device__ __forceinline__ void dequantize_tile(const uint4* __restrict__ w,
                                                const float* __restrict__ scales,
                                                const uint8_t* __restrict__ zeros, int k16,
                                                int spg, int nt, int kt, Store store) {
  using T = typename D::T;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  const long n_pad = (long)gridDim.x * 64;
  const uint4 wv = load_weights(w + ((long)nt * k16 + kt) * 32 + lane);
  const GroupMeta meta = load_group(scales, zeros, (long)(kt / spg) * n_pad, nt * 64 + g * 8);
  const float sc[8] = {meta.s0.x, meta.s0.y, meta.s0.z, meta.s0.w,
                       meta.s1.x, meta.s1.y, meta.s1.z, meta.s1.w};
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t zb = j < 2 ? meta.z.x : meta.z.y;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i & 1;
      const float z = (float)((zb >> (8 * ((2 * j + h) & 3))) & 0xffu);
      const float s = sc[2 * j + h];
      const uint32_t q = words[j] >> (4 * i);
      const float lo = ((float)(q & 0xfu) - z) * s;
      const float hi = ((float)((q >> 16) & 0xfu) - z) * s;
      T pair[2] = {to_out<T>(lo), to_out<T>(hi)};
      store(16 * j + g + 8 * h, 2 * c + 8 * (i >> 1), *reinterpret_cast<uint32_t*>(pair));
    }
  }
}

// Each lane's pairs (4 bytes) straight to W^T, 8 rows a warp at once.
template <typename D>
__device__ __forceinline__ void dequantize_t(const uint4* __restrict__ w,
                                             const float* __restrict__ scales,
                                             const uint8_t* __restrict__ zeros,
                                             typename D::T* __restrict__ out, int N, int K,
                                             int k16, int spg) {
  const int kt = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int nt = blockIdx.x;
  if (kt >= k16) return;
  dequantize_tile<D>(w, scales, zeros, k16, spg, nt, kt, [&](int col, int row, uint32_t bits) {
    const int n = nt * 64 + col;
    const int k = 16 * kt + row;
    if (n < N && k < K) *reinterpret_cast<uint32_t*>(out + (long)n * K + k) = bits;
  });
}

// The same values through shared memory: a block of 8 warps (8 consecutive 16-row tiles of one
// strip) puts its [64 columns][128 rows] of W^T there, then stores them as whole 16-byte pieces
// of each output row (256 contiguous bytes a row).
template <typename D>
__device__ __forceinline__ void dequantize_t_staged(const uint4* __restrict__ w,
                                                    const float* __restrict__ scales,
                                                    const uint8_t* __restrict__ zeros,
                                                    typename D::T* __restrict__ out, int N,
                                                    int K, int k16, int spg) {
  using T = typename D::T;
  constexpr int PITCH = 128 + 8;  // elements a staged row: 272 bytes, rows 16-byte aligned
  __shared__ __align__(16) T tile[64][PITCH];
  const int warp = threadIdx.x >> 5;
  const int kt = blockIdx.y * (blockDim.x >> 5) + warp;
  const int nt = blockIdx.x;
  if (kt < k16) {
    dequantize_tile<D>(w, scales, zeros, k16, spg, nt, kt, [&](int col, int row, uint32_t bits) {
      *reinterpret_cast<uint32_t*>(&tile[col][16 * warp + row]) = bits;
    });
  }
  __syncthreads();
  // 64 rows x 16 pieces of 8 values; K is a multiple of 16, so a piece is whole or out.
  const int k0 = blockIdx.y * 128;
  for (int idx = threadIdx.x; idx < 64 * 16; idx += blockDim.x) {
    const int r = idx >> 4;
    const int piece = idx & 15;
    const int n = nt * 64 + r;
    const int k = k0 + piece * 8;
    if (n < N && k < K)
      *reinterpret_cast<uint4*>(out + (long)n * K + k) =
          *reinterpret_cast<const uint4*>(&tile[r][piece * 8]);
  }
}

}  // namespace

#define PAGELLM_DEQUANTIZE_T(NAME, D)                                                          \
  extern "C" __global__ void NAME(const uint4* w, const float* scales, const uint8_t* zeros,   \
                                  D::T* out, int N, int K, int k16, int spg) {                 \
    dequantize_t<D>(w, scales, zeros, out, N, K, k16, spg);                                    \
  }

PAGELLM_DEQUANTIZE_T(dequantize_t_bf16, Bf16)
PAGELLM_DEQUANTIZE_T(dequantize_t_fp16, Fp16)

#define PAGELLM_DEQUANTIZE_T_STAGED(NAME, D)                                                   \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                      \
      const uint4* w, const float* scales, const uint8_t* zeros, D::T* out, int N, int K,      \
      int k16, int spg) {                                                                      \
    dequantize_t_staged<D>(w, scales, zeros, out, N, K, k16, spg);                             \
  }

PAGELLM_DEQUANTIZE_T_STAGED(dequantize_t_staged_bf16, Bf16)
PAGELLM_DEQUANTIZE_T_STAGED(dequantize_t_staged_fp16, Fp16)
