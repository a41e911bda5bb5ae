// AVX2 + FMA path: two 8-float registers per packed column block. Compiled for avx2/fma only inside this
// file (never -march=native); chosen at run time when the CPU reports both.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#include <immintrin.h>

#include <cstring>

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
  static constexpr int kRowTile13 = 6;  // rows per tile for a kBf16In13 weight (unpacked once a tile)
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
  // One group of a kBf16In13 weight (matmul.h) -> out [4][16] float32, as the AVX-512 path does it, in two halves
  // of 32 positions (columns 0-7 and 8-15 of each k): the fifth bits become a byte mask by spreading each
  // byte of them over 8 bytes and testing one bit in each.
  static void Unpack13(const uint8_t* g, const uint8_t* dictionary, float* out) {
    const __m256i first = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dictionary)));
    const __m256i second =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dictionary + 16)));
    const __m256i parts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 64));
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
                                         1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int half = 0; half < 2; ++half) {
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32 * half));
      const __m256i index = _mm256_and_si256(half == 0 ? parts : _mm256_srli_epi16(parts, 4), nibble);
      int32_t fifth;
      std::memcpy(&fifth, g + 96 + 4 * half, sizeof fifth);
      const __m256i set = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(fifth), spread), bit);
      const __m256i high = _mm256_blendv_epi8(_mm256_shuffle_epi8(first, index), _mm256_shuffle_epi8(second, index),
                                              _mm256_cmpeq_epi8(set, bit));
      const __m256i words0 = _mm256_unpacklo_epi8(low, high), words1 = _mm256_unpackhi_epi8(low, high);
      float* o = out + 8 * half;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_slli_epi32(words0, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_and_si256(words0, odd));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32), _mm256_slli_epi32(words1, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 48), _mm256_and_si256(words1, odd));
    }
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
