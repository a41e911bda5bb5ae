// AVX2 + FMA path: two 8-float registers per packed column block. Compiled for avx2/fma only inside this
// file (never -march=native); chosen at run time when the CPU reports both.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#include <immintrin.h>

#include "matmul_body.h"
#include "matmul_panel.h"

namespace grok {
namespace {

struct Avx2 {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRegs = 16;  // vector registers
  static constexpr int kPerBlock = 2;
  static constexpr int kRowTile = 6;  // rows per tile of the rows form (matmul_body.h)
  static constexpr int kPanelRows = 6;   // 6 x 2 accumulators + 2 weights + 1 broadcast of 16 registers
  static constexpr int kPanelGroup = 1;
  static Reg Zero() { return _mm256_setzero_ps(); }
  static Reg Broadcast(float v) { return _mm256_set1_ps(v); }
  static Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg FromInt8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static Reg FromBf16(const uint16_t* p) {  // a bfloat16 is the high half of the float32 with the same value
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void Prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
  static Reg Fma(Reg x, Reg w, Reg acc) { return _mm256_fmadd_ps(x, w, acc); }
  static Reg Mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg Add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static void StoreFull(float* p, Reg v) { _mm256_storeu_ps(p, v); }
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

void PanelAvx2(const MatmulArgs& a, int64_t block_begin, int64_t block_end, float* scratch) {
  panel::Run<Avx2>(a, block_begin, block_end, scratch);
}

}  // namespace grok

#if defined(__clang__)
#pragma clang attribute pop
#endif
