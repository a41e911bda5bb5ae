// AVX-512 path of the attention kernel: 16 lanes, a 32-key score tile, 64-float value tiles. Compiled for
// avx512f only inside this file (never -march=native); chosen at run time when the CPU reports avx512f.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx2,fma")
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attention_body.h"

namespace grok {
namespace attn {
namespace {

struct Avx512 {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int kW = 16;
  static constexpr int kScoreRegs = 2;
  static constexpr int kScoreQueries = 8;  // query vectors per score tile
  static constexpr int kValueAccs = 16;     // accumulator registers per value tile
  static constexpr int kValueRegs = 4;
  static constexpr int kTransposeW = 16;

  static Mask First(int64_t n) { return static_cast<Mask>((1u << n) - 1u); }
  static Reg Zero() { return _mm512_setzero_ps(); }
  static Reg Set1(float v) { return _mm512_set1_ps(v); }
  static Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg LoadN(const float* p, int64_t n) { return n >= kW ? Load(p) : _mm512_maskz_loadu_ps(First(n), p); }
  static void Store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static void StoreN(float* p, Reg v, int64_t n) {
    if (n >= kW) {
      Store(p, v);
    } else {
      _mm512_mask_storeu_ps(p, First(n), v);
    }
  }
  // bfloat16 is the high half of a float32: widening is exact.
  static Reg LoadBf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Reg LoadBf16N(const uint16_t* p, int64_t n) {
    uint16_t tmp[kW] = {};
    std::memcpy(tmp, p, sizeof(uint16_t) * n);
    return LoadBf16(tmp);
  }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg Mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg Add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg Sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg Div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg Max(Reg a, Reg b) { return _mm512_max_ps(a, b); }  // a > b ? a : b, as the scalar path
  static Reg Min(Reg a, Reg b) { return _mm512_min_ps(a, b); }  // a < b ? a : b
  static Reg Abs(Reg a) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
  }
  static bool Any(Mask m) { return m != 0; }
  static Mask Less(Reg a, Reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static Reg Select(Mask m, Reg a, Reg b) { return _mm512_mask_blend_ps(m, b, a); }
  static Reg MaskTail(Reg v, int64_t n, float fill) {
    return n >= kW ? v : _mm512_mask_blend_ps(First(n), _mm512_set1_ps(fill), v);
  }
  static Reg LoadAny(const float* p) { return Load(p); }
  static Reg LoadAny(const uint16_t* p) { return LoadBf16(p); }
  static Reg LoadPart(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(First(n), p); }
  static Reg LoadPart(const uint16_t* p, int64_t n) { return LoadBf16N(p, n); }

  // dst[(d0 + e) * ld + k] = rows[k][d0 + e] for k, e < 16: four rounds of in-register shuffles.
  template <class T>
  static void Transpose(const T* const* rows, int64_t d0, float* dst, int64_t ld) {
    Reg r[16], t[16];
    for (int k = 0; k < 16; ++k) r[k] = LoadAny(rows[k] + d0);
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + e], 128-bit lane L: element 4L + e of keys 4i..4i+3
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
      const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int e = 0; e < 4; ++e) {  // gather 128-bit lane L of r[e], r[4+e], r[8+e], r[12+e]: element 4L + e
      const Reg u0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), u1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
      const Reg w0 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
      const Reg w1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
      _mm512_storeu_ps(dst + (d0 + e) * ld, _mm512_shuffle_f32x4(u0, w0, 0x88));
      _mm512_storeu_ps(dst + (d0 + 4 + e) * ld, _mm512_shuffle_f32x4(u1, w1, 0x88));
      _mm512_storeu_ps(dst + (d0 + 8 + e) * ld, _mm512_shuffle_f32x4(u0, w0, 0xDD));
      _mm512_storeu_ps(dst + (d0 + 12 + e) * ld, _mm512_shuffle_f32x4(u1, w1, 0xDD));
    }
  }
  // t = magic + n exactly (n integer, |n| <= 127): its low bits are n; 2^n is (n + 127) << 23.
  static Reg Pow2(Reg t, Reg magic) {
    const __m512i n = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(magic));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
  }
};

}  // namespace

void ItemAvx512(const Call& c, const Item& it) { body::AnyPool<Avx512>(c, it); }
void ExpAvx512(const float* x, float* y, int64_t n) { body::Elementwise<Avx512, false>(x, y, n); }
void CapAvx512(const float* x, float* y, int64_t n) { body::Elementwise<Avx512, true>(x, y, n); }

}  // namespace attn
}  // namespace grok

#if defined(__clang__)
#pragma clang attribute pop
#endif
