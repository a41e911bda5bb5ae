// AVX2 + FMA path: two 8-float registers per packed column block. Compiled for avx2/fma only inside this
// file (never -march=native); chosen at run time when the CPU reports both.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#include <immintrin.h>

#include "matmul_body.h"

namespace grok {
namespace {

struct Avx2 {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kPerBlock = 2;
  static Reg Zero() { return _mm256_setzero_ps(); }
  static Reg Broadcast(float v) { return _mm256_set1_ps(v); }
  static Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg LoadWeight(const MatmulArgs& a, int64_t i) {
    if (a.int8) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(a.w) + i));
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
    return _mm256_loadu_ps(static_cast<const float*>(a.w) + i);
  }
  static Reg Fma(Reg x, Reg w, Reg acc) { return _mm256_fmadd_ps(x, w, acc); }
  static Reg Mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg Add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static void Store(float* p, Reg v, int64_t valid) {
    if (valid >= kWidth) {
      _mm256_storeu_ps(p, v);
    } else if (valid > 0) {
      alignas(32) float tmp[kWidth];
      _mm256_store_ps(tmp, v);
      for (int64_t i = 0; i < valid; ++i) p[i] = tmp[i];
    }
  }
};

}  // namespace

void MatmulAvx2(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  body::Run<Avx2>(a, block_begin, block_end);
}

}  // namespace grok

#if defined(__clang__)
#pragma clang attribute pop
#endif
