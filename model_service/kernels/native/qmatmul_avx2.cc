// int8 activations, AVX2 path: pairs of values of k widened to int16 and multiplied with VPMADDWD (exact
// 32-bit sums), the float arithmetic the scalar path's (matmul.h), so the bits are the same. Compiled for
// avx2/fma only inside this file (never -march=native); chosen at run time when the CPU reports both.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#include <immintrin.h>

#include <cstdint>

#include "matmul.h"

namespace grok {
namespace {

inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

inline __m256i Pair(const int8_t* q) {  // q[0], q[1] as one int16 pair in every 32-bit lane
  return _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint16_t>(q[0]) |
                                                (static_cast<uint32_t>(static_cast<uint16_t>(q[1])) << 16)));
}

// Scale block b of column block `block` for rows[row .. row + R).
template <int R>
inline void Tile(const MatmulArgs& a, int64_t row, int64_t block, int64_t b) {
  const QuantRows& qr = *a.quant;
  const int64_t kb = a.k / a.blocks;
  const int8_t* w = static_cast<const int8_t*>(a.w);
  int64_t ids[R];
  for (int r = 0; r < R; ++r) ids[r] = a.rows[row + r];
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < qr.per_block; ++s) {
    const int64_t k0 = b * kb + s * kQuantBlock, len = Min(kQuantBlock, kb - s * kQuantBlock);
    const int64_t sub = b * qr.per_block + s;
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    for (int64_t t = 0; t < len; t += 2) {
      const int8_t* p = w + (block * a.k + k0 + t) * kLanes;
      const __m128i w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i w1 = len - t >= 2 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kLanes))
                                      : _mm_setzero_si128();
      const __m256i lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(w0, w1));  // columns 0-7: (k, k + 1) pairs
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(w0, w1));  // columns 8-15
      for (int r = 0; r < R; ++r) {
        const __m256i xv = Pair(qr.q + (ids[r] * qr.subs + sub) * kQuantBlock + t);
        sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(lo, xv));
        sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(hi, xv));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 step = _mm256_set1_ps(qr.d[ids[r] * qr.subs + sub]);
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), step, acc[r][h]);
    }
  }
  const int64_t col = block * kLanes;
  for (int r = 0; r < R; ++r) {
    float* o = a.out + ids[r] * a.n_out + col;
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_mul_ps(acc[r][h], _mm256_loadu_ps(a.scales + b * a.nb * kLanes + col + h * 8));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, v);
      for (int64_t i = 0; i < 8 && col + h * 8 + i < a.n_out; ++i) o[h * 8 + i] = b == 0 ? lanes[i] : o[h * 8 + i] + lanes[i];
    }
  }
}

}  // namespace

void QuantAvx2(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  for (int64_t block = block_begin; block < block_end; ++block) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      int64_t row = 0;
      for (; row + 2 <= a.m; row += 2) Tile<2>(a, row, block, b);
      if (row < a.m) Tile<1>(a, row, block, b);
    }
  }
}

}  // namespace grok

#if defined(__clang__)
#pragma clang attribute pop
#endif
