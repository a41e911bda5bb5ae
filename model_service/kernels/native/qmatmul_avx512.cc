// int8 activations, AVX-512 VNNI path: VPDPBUSD adds 4 int8 products per 32-bit lane, 64 per instruction (four
// times the multiply-adds of a float32 FMA). Compiled for these extensions only inside this file (never
// -march=native); chosen at run time when the CPU reports avx512f, avx512bw, avx512vbmi and avx512vnni.
//
// A packed weight stores 4 consecutive values of k as 4 x 16 bytes (one per column); VPERMB turns them into 16
// lanes of 4 (column-major, as VPDPBUSD reads them) and XOR 0x80 makes them unsigned (w + 128), so each lane
// sums (w + 128) * q: the sub-block's 128 * sum(q), precomputed per row, is subtracted once. The integer sums
// are exact, and the float arithmetic is the scalar path's (matmul.h), so the bits are the same.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma")
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "matmul.h"

namespace grok {
namespace {

constexpr int kRows = 4;   // rows per tile: 4 x 4 integer and 4 x 4 float accumulators, 4 weights, 1 broadcast
constexpr int kGroupQ = 4;  // column blocks per tile

inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

inline __m512i Transpose() {  // byte i of the result = byte (i % 4) * 16 + i / 4 of the source
  alignas(64) int8_t idx[64];
  for (int i = 0; i < 64; ++i) idx[i] = static_cast<int8_t>((i % 4) * 16 + i / 4);
  return _mm512_load_si512(idx);
}

// Four values of k of a column block's 16 columns as stored, turned and flipped for VPDPBUSD.
inline __m512i Turn(__m512i raw, __m512i transpose) {
  return _mm512_xor_si512(_mm512_permutexvar_epi8(transpose, raw), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Four values of k of column block `block` (len - t of them valid), turned and flipped for VPDPBUSD.
inline __m512i Turned(const int8_t* w, const MatmulArgs& a, int64_t block, int64_t k, int64_t valid,
                      __m512i transpose) {
  const int8_t* p = w + (block * a.k + k) * kLanes;
  // A short last step reads only its own values of k (the activations past them are zero).
  const __m512i raw = valid >= 4 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << (16 * valid)) - 1ull, p);
  return Turn(raw, transpose);
}

// sum[r][g] += the integer dot of row r's four activations at xs[r] + t with the turned weights wv[g].
template <int R, int G>
__attribute__((always_inline)) inline void Dot(const int8_t* const (&xs)[R], int64_t t, const __m512i (&wv)[G],
                                               __m512i (&sum)[R][G]) {
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, xs[r] + t, sizeof four);
    const __m512i xv = _mm512_set1_epi32(four);
    for (int g = 0; g < G; ++g) sum[r][g] = _mm512_dpbusd_epi32(sum[r][g], wv[g], xv);
  }
}

// acc[r][g] += (the exact integer sum of sub-block `sub`, K from k0, `len` values, for row ids[r] and column block
// block + g) * the row's step: one fused multiply-add per lane (the weights turned as they are read).
template <int R, int G>
inline void SubBlock(const MatmulArgs& a, const int64_t* ids, int64_t block, int64_t k0, int64_t len, int64_t sub,
                     __m512i transpose, __m512 (&acc)[R][G]) {
  const QuantRows& qr = *a.quant;
  const int8_t* w = static_cast<const int8_t*>(a.w);
  __m512i sum[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) sum[r][g] = _mm512_setzero_si512();
  const int8_t* xs[R];
  for (int r = 0; r < R; ++r) xs[r] = qr.q + (ids[r] * qr.subs + sub) * kQuantBlock;
  const auto step = [&](int64_t t, int64_t valid) __attribute__((always_inline)) {
    __m512i wv[G];
    for (int g = 0; g < G; ++g) wv[g] = Turned(w, a, block + g, k0 + t, valid, transpose);
    Dot<R, G>(xs, t, wv, sum);
  };
  if (len == kQuantBlock) {  // a whole sub-block: a fixed trip count the compiler unrolls (no copies of sums)
#pragma GCC unroll 8
    for (int64_t t = 0; t < kQuantBlock; t += 4) step(t, 4);
  } else {
    for (int64_t t = 0; t < len; t += 4) step(t, len - t);
  }
  for (int r = 0; r < R; ++r) {
    const __m512i offset = _mm512_set1_epi32(qr.c[ids[r] * qr.subs + sub]);
    const __m512 d = _mm512_set1_ps(qr.d[ids[r] * qr.subs + sub]);
    for (int g = 0; g < G; ++g)
      acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r][g], offset)), d, acc[r][g]);
  }
}

// The first `whole` sub-blocks of scale block b (each kQuantBlock values of K): SubBlock's sums and float steps
// for all of them, with each row's and each weight stream's pointers formed once per tile and each sum starting
// at minus its offset (the same integers), so the loop holds only loads, turns and VPDPBUSD.
template <int R, int G>
inline void Whole(const MatmulArgs& a, const int64_t* ids, int64_t block, int64_t b, int64_t whole,
                  __m512i transpose, __m512 (&acc)[R][G]) {
  const QuantRows& qr = *a.quant;
  const int64_t kb = a.k / a.blocks;
  const int8_t* xs[R];
  const float* ds[R];
  const int32_t* cs[R];
  for (int r = 0; r < R; ++r) {
    const int64_t base = ids[r] * qr.subs + b * qr.per_block;
    xs[r] = qr.q + base * kQuantBlock;
    ds[r] = qr.d + base;
    cs[r] = qr.c + base;
  }
  const int8_t* ws[G];
  for (int g = 0; g < G; ++g)
    ws[g] = static_cast<const int8_t*>(a.w) + ((block + g) * a.k + b * kb) * kLanes;
  for (int64_t s = 0; s < whole; ++s) {
    __m512i sum[R][G];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(-cs[r][s]);
      for (int g = 0; g < G; ++g) sum[r][g] = start;
    }
#pragma GCC unroll 8
    for (int64_t t = 0; t < kQuantBlock; t += 4) {
      __m512i wv[G];
      for (int g = 0; g < G; ++g) wv[g] = Turn(_mm512_loadu_si512(ws[g] + (s * kQuantBlock + t) * kLanes), transpose);
      Dot<R, G>(xs, s * kQuantBlock + t, wv, sum);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(ds[r][s]);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][g]), d, acc[r][g]);
    }
  }
}

inline __mmask16 Valid(const MatmulArgs& a, int64_t col) {  // the columns of a block that exist
  const int64_t valid = a.n_out - col;
  return valid >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1u);
}

// Scale block b of column blocks [block, block + G) for rows[row .. row + R): out = (b == 0 ? 0 + : out +) ...
template <int R, int G>
inline void Tile(const MatmulArgs& a, int64_t row, int64_t block, int64_t b, __m512i transpose) {
  const QuantRows& qr = *a.quant;
  const int64_t kb = a.k / a.blocks;
  int64_t ids[R];
  for (int r = 0; r < R; ++r) ids[r] = a.rows[row + r];
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const int64_t whole = kb / kQuantBlock;  // a shorter last sub-block, if any, takes SubBlock's masked loads
  Whole<R, G>(a, ids, block, b, whole, transpose, acc);
  if (whole < qr.per_block)
    SubBlock<R, G>(a, ids, block, b * kb + whole * kQuantBlock, kb - whole * kQuantBlock, b * qr.per_block + whole,
                   transpose, acc);
  for (int g = 0; g < G; ++g) {
    const int64_t col = (block + g) * kLanes;
    const __mmask16 mask = Valid(a, col);
    const __m512 scale = _mm512_loadu_ps(a.scales + b * a.nb * kLanes + col);
    for (int r = 0; r < R; ++r) {
      float* o = a.out + ids[r] * a.n_out + col;
      __m512 v = _mm512_mul_ps(acc[r][g], scale);
      if (b > 0) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), v);
      _mm512_mask_storeu_ps(o, mask, v);
    }
  }
}

// Scale blocks of at most one sub-block each (the int8 table's, 32 values of K): all of them for rows[row .. row
// + R) and column blocks [block, block + G), the running sum over blocks kept in registers (the same operations
// as Tile's, without storing and reloading `out` after every 32 values of K).
template <int R, int G>
inline void SmallBlocks(const MatmulArgs& a, int64_t row, int64_t block, __m512i transpose) {
  const int64_t kb = a.k / a.blocks;
  int64_t ids[R];
  for (int r = 0; r < R; ++r) ids[r] = a.rows[row + r];
  __m512 out[R][G];
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    SubBlock<R, G>(a, ids, block, b * kb, kb, b, transpose, acc);
    for (int g = 0; g < G; ++g) {
      const __m512 scale = _mm512_loadu_ps(a.scales + b * a.nb * kLanes + (block + g) * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_mul_ps(acc[r][g], scale);
        out[r][g] = b == 0 ? v : _mm512_add_ps(out[r][g], v);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t col = (block + g) * kLanes;
    const __mmask16 mask = Valid(a, col);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.out + ids[r] * a.n_out + col, mask, out[r][g]);
  }
}

template <int G>
inline void SmallBlocksRows(const MatmulArgs& a, int64_t block, __m512i transpose) {
  int64_t row = 0;
  for (; a.m - row > 4; row += 4) SmallBlocks<4, G>(a, row, block, transpose);
  switch (a.m - row) {
    case 4: SmallBlocks<4, G>(a, row, block, transpose); break;
    case 3: SmallBlocks<3, G>(a, row, block, transpose); break;
    case 2: SmallBlocks<2, G>(a, row, block, transpose); break;
    case 1: SmallBlocks<1, G>(a, row, block, transpose); break;
    default: break;
  }
}

// Every row, tiles of kRows rows x G column blocks (one broadcast of a row's activations feeds G blocks, one turned
// weight kRows rows; the weights are turned again for each tile, cheaper on Zen 4 than turning them once into a
// panel and reading that back: 357 against 300 G multiply-adds a second at 64 rows, both cores).
template <int G>
inline void Tiles(const MatmulArgs& a, int64_t block, int64_t b, __m512i transpose) {
  static_assert(kRows == 4, "the remainder cases below run tiles of up to 4 rows");
  int64_t row = 0;
  for (; a.m - row > kRows; row += kRows) Tile<kRows, G>(a, row, block, b, transpose);
  switch (a.m - row) {
    case 4: Tile<4, G>(a, row, block, b, transpose); break;
    case 3: Tile<3, G>(a, row, block, b, transpose); break;
    case 2: Tile<2, G>(a, row, block, b, transpose); break;
    case 1: Tile<1, G>(a, row, block, b, transpose); break;
    default: break;
  }
}

}  // namespace

// QuantizeRows (qmatmul_scalar.cc) in 16 lanes: the same maximum (exact in any order; NaN ignored as there),
// the same scalar step and inverse, round half to even (VRNDSCALEPS), NaN to 0, the same clamp: the same bytes.
void QuantizeRowsAvx512(const float* x, const int64_t* rows, int64_t m, int64_t k, int64_t blocks, int8_t* q,
                        float* d, int32_t* c) {
  const int64_t kb = k / blocks, per_block = (kb + kQuantBlock - 1) / kQuantBlock, subs = blocks * per_block;
  const __m512 low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = rows[i];
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t s = 0; s < per_block; ++s) {
        const int64_t k0 = b * kb + s * kQuantBlock, sub = r * subs + b * per_block + s;
        const int64_t len = Min(kQuantBlock, kb - s * kQuantBlock);
        const float* v = x + r * k + k0;
        __m512 half[2];
        __m512 top = _mm512_setzero_ps();
        for (int h = 0; h < 2; ++h) {
          const int64_t valid = len - 16 * h;
          const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xffff)
                                 : valid > 0 ? static_cast<__mmask16>((1u << valid) - 1u) : static_cast<__mmask16>(0);
          half[h] = _mm512_maskz_loadu_ps(mask, v + 16 * h);
          top = _mm512_max_ps(_mm512_abs_ps(half[h]), top);  // a NaN lane keeps `top`
        }
        const float amax = _mm512_reduce_max_ps(top);
        const float step = amax / 127.0f;
        const float inverse = step > 0.0f && step - step == 0.0f ? 1.0f / step : 0.0f;  // finite and positive
        const __m512 inv = _mm512_set1_ps(inverse);
        int8_t* out = q + sub * kQuantBlock;
        __m512i total = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(half[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          rounded = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(rounded, rounded, _CMP_ORD_Q), rounded);  // NaN -> 0
          rounded = _mm512_min_ps(_mm512_max_ps(rounded, low), high);
          const __m512i ints = _mm512_cvtps_epi32(rounded);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), _mm512_cvtepi32_epi8(ints));
          total = _mm512_add_epi32(total, ints);
        }
        d[sub] = step;
        c[sub] = 128 * _mm512_reduce_add_epi32(total);
      }
    }
  }
}

// kGroupQ column blocks at a time; within them one scale block at a time for every row (the blocks' slice of the
// weight stays in L2 while the row tiles pass over it; the partial sums over scale blocks wait in `out`, exactly).
void QuantAvx512(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  const __m512i transpose = Transpose();
  if (a.quant->per_block == 1 && a.k / a.blocks <= kQuantBlock) {  // many small scale blocks (an int8 table)
    for (int64_t block = block_begin; block < block_end; block += 2) {
      if (block_end - block >= 2) {
        SmallBlocksRows<2>(a, block, transpose);
      } else {
        SmallBlocksRows<1>(a, block, transpose);
      }
    }
    return;
  }
  for (int64_t block = block_begin; block < block_end; block += kGroupQ) {
    const int64_t groups = block_end - block < kGroupQ ? block_end - block : kGroupQ;
    for (int64_t b = 0; b < a.blocks; ++b) {
      switch (groups) {
        case 4: Tiles<4>(a, block, b, transpose); break;
        case 3: Tiles<3>(a, block, b, transpose); break;
        case 2: Tiles<2>(a, block, b, transpose); break;
        default: Tiles<1>(a, block, b, transpose); break;
      }
    }
  }
}

}  // namespace grok

#if defined(__clang__)
#pragma clang attribute pop
#endif
