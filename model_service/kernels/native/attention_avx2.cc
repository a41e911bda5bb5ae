// AVX2 path of the attention kernel: 8 lanes (two registers make the 16 softmax partials), a 16-key score
// tile, 16-float value tiles. Compiled for avx2+fma only inside this file; chosen at run time.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attention_body.h"

namespace grok {
namespace attn {
namespace {

struct Avx2 {
  using Reg = __m256;
  using Mask = __m256;
  static constexpr int kW = 8;
  static constexpr int kScoreRegs = 2;
  static constexpr int kScoreQueries = 4;  // query vectors per score tile
  static constexpr int kValueAccs = 8;     // accumulator registers per value tile
  static constexpr int kValueRegs = 2;
  static constexpr int kTransposeW = 8;

  static __m256i First(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Reg Zero() { return _mm256_setzero_ps(); }
  static Reg Set1(float v) { return _mm256_set1_ps(v); }
  static Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg LoadN(const float* p, int64_t n) { return n >= kW ? Load(p) : _mm256_maskload_ps(p, First(n)); }
  static void Store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static void StoreN(float* p, Reg v, int64_t n) {
    if (n >= kW) {
      Store(p, v);
    } else {
      _mm256_maskstore_ps(p, First(n), v);
    }
  }
  static Reg LoadBf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Reg LoadBf16N(const uint16_t* p, int64_t n) {
    uint16_t tmp[kW] = {};
    std::memcpy(tmp, p, sizeof(uint16_t) * n);
    return LoadBf16(tmp);
  }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg Mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg Add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg Sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg Div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg Max(Reg a, Reg b) { return _mm256_max_ps(a, b); }  // a > b ? a : b, as the scalar path
  static Reg Min(Reg a, Reg b) { return _mm256_min_ps(a, b); }  // a < b ? a : b
  static Reg Abs(Reg a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static bool Any(Mask m) { return _mm256_movemask_ps(m) != 0; }
  static Mask Less(Reg a, Reg b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static Reg Select(Mask m, Reg a, Reg b) { return _mm256_blendv_ps(b, a, m); }
  static Reg MaskTail(Reg v, int64_t n, float fill) {
    return n >= kW ? v : _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(First(n)));
  }
  static Reg LoadAny(const float* p) { return Load(p); }
  static Reg LoadAny(const uint16_t* p) { return LoadBf16(p); }
  static Reg LoadPart(const float* p, int64_t n) { return _mm256_maskload_ps(p, First(n)); }
  static Reg LoadPart(const uint16_t* p, int64_t n) { return LoadBf16N(p, n); }

  // dst[(d0 + e) * ld + k] = rows[k][d0 + e] for k, e < 8.
  template <class T>
  static void Transpose(const T* const* rows, int64_t d0, float* dst, int64_t ld) {
    Reg r[8], t[8];
    for (int k = 0; k < 8; ++k) r[k] = LoadAny(rows[k] + d0);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // r[4i + e], 128-bit lane L: element 4L + e of keys 4i..4i+3
      const __m256d a = _mm256_castps_pd(t[4 * i]), b = _mm256_castps_pd(t[4 * i + 2]);
      const __m256d c = _mm256_castps_pd(t[4 * i + 1]), d = _mm256_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, b));
      r[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, b));
      r[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(c, d));
      r[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(c, d));
    }
    for (int e = 0; e < 4; ++e) {
      _mm256_storeu_ps(dst + (d0 + e) * ld, _mm256_permute2f128_ps(r[e], r[4 + e], 0x20));
      _mm256_storeu_ps(dst + (d0 + 4 + e) * ld, _mm256_permute2f128_ps(r[e], r[4 + e], 0x31));
    }
  }
  static Reg Pow2(Reg t, Reg magic) {
    const __m256i n = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  }
};

}  // namespace

void ItemAvx2(const Call& c, const Item& it) { body::AnyPool<Avx2>(c, it); }
void ExpAvx2(const float* x, float* y, int64_t n) { body::Elementwise<Avx2, false>(x, y, n); }
void CapAvx2(const float* x, float* y, int64_t n) { body::Elementwise<Avx2, true>(x, y, n); }

}  // namespace attn
}  // namespace grok

#if defined(__clang__)
#pragma clang attribute pop
#endif
