// AVX-512 path: one 16-float register per packed column block. Compiled for avx512f and avx512bw only inside
// this file (never -march=native); chosen at run time when the CPU reports both.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx2,fma")
#endif
#include <immintrin.h>

#include <cstring>

#include "matmul_body.h"
#include "matmul_panel.h"

namespace grok {
namespace {

struct Avx512 {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRegs = 32;  // vector registers
  static constexpr int kPerBlock = 1;
  static constexpr int kRowTile = 4;  // rows per tile of the rows form (matmul_body.h)
  static constexpr int kRowTile13 = 8;  // rows per tile for a kBf16In13 weight (unpacked once a tile)
  static constexpr int kPanelRows = 6;   // 6 x 4 accumulators + 4 weights + 1 broadcast of 32 registers
  static constexpr int kPanelGroup = 4;
  static Reg Zero() { return _mm512_setzero_ps(); }
  static Reg Broadcast(float v) { return _mm512_set1_ps(v); }
  static Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg FromInt8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static Reg FromBf16(const uint16_t* p) {  // a bfloat16 is the high half of the float32 with the same value
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // One group of a kBf16In13 weight (matmul.h) -> out [4][16] float32: the indexes' 4-bit parts look up both
  // halves of the dictionary (VPSHUFB), the fifth bits pick one, and unpacking the low bytes with the high ones
  // gives 32 bfloat16 words per register, whose even and odd words are 16 float32 each.
  static void Unpack13(const uint8_t* g, const uint8_t* dictionary, float* out) {
    const __m512i first = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dictionary)));
    const __m512i second = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dictionary + 16)));
    const __m512i low = _mm512_loadu_si512(g);
    // The 32 bytes of index parts in both halves; the upper half shifted down 4 bits: positions 32-63.
    const __m512i parts = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 64)));
    const __m512i index = _mm512_and_si512(_mm512_mask_srli_epi16(parts, 0xffff0000u, parts, 4), _mm512_set1_epi8(15));
    uint64_t fifth;
    std::memcpy(&fifth, g + 96, sizeof fifth);
    const __m512i high = _mm512_mask_blend_epi8(fifth, _mm512_shuffle_epi8(first, index),
                                                _mm512_shuffle_epi8(second, index));
    const __m512i words0 = _mm512_unpacklo_epi8(low, high), words1 = _mm512_unpackhi_epi8(low, high);
    const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    _mm512_storeu_si512(out, _mm512_slli_epi32(words0, 16));
    _mm512_storeu_si512(out + 16, _mm512_and_si512(words0, odd));
    _mm512_storeu_si512(out + 32, _mm512_slli_epi32(words1, 16));
    _mm512_storeu_si512(out + 48, _mm512_and_si512(words1, odd));
  }
  static void Prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
  static Reg Fma(Reg x, Reg w, Reg acc) { return _mm512_fmadd_ps(x, w, acc); }
  static Reg Mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg Add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static void StoreFull(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static void Store(float* p, Reg v, int64_t valid) {
    if (valid >= kWidth) {
      _mm512_storeu_ps(p, v);
    } else if (valid > 0) {
      _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << valid) - 1u), v);
    }
  }
};

}  // namespace

void MatmulAvx512(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  body::Run<Avx512>(a, block_begin, block_end);
}

void PanelAvx512(const MatmulArgs& a, int64_t block_begin, int64_t block_end, float* scratch) {
  panel::Run<Avx512>(a, block_begin, block_end, scratch);
}

}  // namespace grok

#if defined(__clang__)
#pragma clang attribute pop
#endif
