// pagellm-int4: what the CUDA kernels share: the activation types' float codes, the MMA, the
// loads of the fragment layout (pagellm_int4/fragment_layout.py).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {


struct Bf16 {
  using T = __nv_bfloat16;
  static constexpr bool BF16 = true;
  static constexpr uint32_t MAGIC = 0x43004300u;  // 128.0 in both halves: 128 + q for q < 128
  static constexpr uint32_t ONE = 0x3F803F80u;
  static constexpr float OFFSET = 128.0f;
};

struct Fp16 {
  using T = __half;
  static constexpr bool BF16 = false;
  static constexpr uint32_t MAGIC = 0x64006400u;  // 1024.0: 1024 + q
  static constexpr uint32_t ONE = 0x3C003C00u;
  static constexpr float OFFSET = 1024.0f;
};

template <uint32_t MAGIC>
__device__ __forceinline__ uint32_t code_pair(uint32_t w) {
  // (w & 0x000f000f) | MAGIC: the low nibble of each half as offset + q.
  uint32_t r;
  asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xea;" : "=r"(r) : "r"(w), "n"(MAGIC));
  return r;
}

template <typename D>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (D::BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint4 load_weights(const uint4* p) {
  // Read once: not kept in L1.
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p) : "memory");
}

__device__ __forceinline__ void wait_for_previous_grid() {
  // Programmatic dependent launch (sm_90+): a kernel launched with programmatic stream
  // serialization may start while the kernel before it on the stream finishes; this waits for
  // that kernel's completion and its memory. Before it, only what no earlier kernel writes may be
  // read (the weights, scales and zero points); a no-op for a launch without the attribute.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename T>
__device__ __forceinline__ T to_out(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half to_out<__half>(float v) {
  return __float2half_rn(v);
}

// One group's eight scales and zero points of a lane (columns 16 j + g + 8 h at 2 j + h).
struct GroupMeta {
  float4 s0, s1;
  uint2 z;
};

__device__ __forceinline__ GroupMeta load_group(const float* scales, const uint8_t* zeros,
                                                long row, int col) {
  GroupMeta m;
  const float4* s = reinterpret_cast<const float4*>(scales + row + col);
  m.s0 = __ldg(s);
  m.s1 = __ldg(s + 1);
  m.z = __ldg(reinterpret_cast<const uint2*>(zeros + row + col));
  return m;
}

}  // namespace
