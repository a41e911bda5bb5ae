// The rows form of the vector kernel, written once over a small vector interface `V` (AVX-512: one register per 16-column
// block; AVX2: two). Included by one translation unit per instruction set, each compiled for its target.
//
// The listed rows (a.rows) are taken R = V::kRowTile at a time (AVX-512: 4, AVX2: 6; the rest in one smaller tile) and
// column blocks G (<= 4, fewer where the registers would not hold them) at a time, so one weight load feeds R fused
// multiply-adds and G x R independent accumulator chains hide the FMA latency. A tile of more than 4 rows broadcasts
// each row's activation just before that row's multiply-adds, so that its R x G x kPerBlock accumulators, the
// converted weights and one broadcast fit the registers (AVX2: 6 rows x one block = 12 chains in 16 registers,
// where 4-row tiles held 8). Neither R nor G changes the per-column operation order: acc = fma(x[k], w[k], acc) for
// k in order within a scale block, then acc * scale, then out + acc over blocks.
#include "matmul.h"

namespace grok {
namespace body {

// The weight's values at element i converted to float32 (exact for every type), for a type fixed at compile time
// so the inner loop has no branch on it.
template <class V, Weight T>
inline typename V::Reg Load(const void* w, int64_t i) {
  if constexpr (T == Weight::kInt8) return V::FromInt8(static_cast<const int8_t*>(w) + i);
  if constexpr (T == Weight::kBf16) return V::FromBf16(static_cast<const uint16_t*>(w) + i);
  if constexpr (T == Weight::kF32) return V::Load(static_cast<const float*>(w) + i);
}

// The most column blocks an R-row tile takes at once: its R x G x kPerBlock accumulators, one block's converted
// weight (kPerBlock registers) and the R broadcasts (a tile of more than 4 rows: all G blocks' weights and one
// broadcast) must fit in the V::kRegs vector registers with one to spare. A tile that does not fit spills
// accumulators to the stack, and each spilled chain then waits on a store and a load every k (on AVX2's 16
// registers a 1-row x 4-block tile ran at half speed that way).
template <class V>
constexpr int MaxGroup(int rows) {
  for (int g = kGroup; g > 1; --g)
    if (rows > 4 ? rows * g * V::kPerBlock + g * V::kPerBlock + 1 <= V::kRegs - 1
                 : rows * g * V::kPerBlock + V::kPerBlock + rows <= V::kRegs - 1)
      return g;
  return 1;
}

template <class V, Weight T, int R, int G>
inline void Tile(const MatmulArgs& a, int64_t row, int64_t block) {
  using Reg = typename V::Reg;
  const int64_t kb = a.k / a.blocks;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.x + a.rows[row + r] * a.k;
  Reg out[R][G][V::kPerBlock];
  for (int64_t b = 0; b < a.blocks; ++b) {
    Reg acc[R][G][V::kPerBlock];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < V::kPerBlock; ++h) acc[r][g][h] = V::Zero();
    // One value of k: weight(g, h) gives register h of column block block + g at that k.
    const auto step = [&](int64_t k, const auto& weight) __attribute__((always_inline)) {
      if constexpr (R > 4) {  // the block's weights once, then row by row: one broadcast live at a time
        Reg w[G][V::kPerBlock];
        for (int g = 0; g < G; ++g)
          for (int h = 0; h < V::kPerBlock; ++h) w[g][h] = weight(g, h);
        for (int r = 0; r < R; ++r) {
          const Reg xr = V::Broadcast(x[r][k]);
          for (int g = 0; g < G; ++g)
            for (int h = 0; h < V::kPerBlock; ++h) acc[r][g][h] = V::Fma(xr, w[g][h], acc[r][g][h]);
        }
      } else {
        Reg xr[R];
        for (int r = 0; r < R; ++r) xr[r] = V::Broadcast(x[r][k]);
        for (int g = 0; g < G; ++g)
          for (int h = 0; h < V::kPerBlock; ++h) {
            const Reg w = weight(g, h);
            for (int r = 0; r < R; ++r) acc[r][g][h] = V::Fma(xr[r], w, acc[r][g][h]);
          }
      }
    };
    if constexpr (T == Weight::kBf16In13) {  // 4 values of k unpacked to float32 at a time (kb % 4 == 0)
      alignas(64) float unpacked[G][4 * kLanes];
      const uint8_t* w = static_cast<const uint8_t*>(a.w);
      for (int64_t k = b * kb; k < (b + 1) * kb; k += 4) {
        for (int g = 0; g < G; ++g)
          V::Unpack13(w + ((block + g) * (a.k / 4) + k / 4) * kGroup13Bytes, a.dictionary, unpacked[g]);
        for (int64_t t = 0; t < 4; ++t)
          step(k + t, [&](int g, int h) __attribute__((always_inline)) {
            return V::Load(unpacked[g] + t * kLanes + h * V::kWidth);
          });
      }
    } else {
      for (int64_t k = b * kb; k < (b + 1) * kb; ++k)
        step(k, [&](int g, int h) __attribute__((always_inline)) {
          return Load<V, T>(a.w, ((block + g) * a.k + k) * kLanes + h * V::kWidth);
        });
    }
    for (int g = 0; g < G; ++g) {
      for (int h = 0; h < V::kPerBlock; ++h) {
        Reg s = V::Zero();
        if (a.scales != nullptr) s = V::Load(a.scales + b * a.nb * kLanes + (block + g) * kLanes + h * V::kWidth);
        for (int r = 0; r < R; ++r) {
          Reg v = a.scales != nullptr ? V::Mul(acc[r][g][h], s) : acc[r][g][h];
          out[r][g][h] = b == 0 ? v : V::Add(out[r][g][h], v);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < V::kPerBlock; ++h) {
        const int64_t col = (block + g) * kLanes + h * V::kWidth;
        V::Store(a.out + a.rows[row + r] * a.n_out + col, out[r][g][h], a.n_out - col);
      }
}

// R rows over `groups` (<= kGroup) column blocks from `block`, at most MaxGroup<V>(R) blocks per tile.
template <class V, Weight T, int R>
inline void Rows(const MatmulArgs& a, int64_t row, int64_t block, int64_t groups) {
  constexpr int64_t cap = MaxGroup<V>(R);
  for (int64_t g0 = 0; g0 < groups; g0 += cap) {
    switch (groups - g0 < cap ? groups - g0 : cap) {
      case 4: Tile<V, T, R, 4>(a, row, block + g0); break;
      case 3: Tile<V, T, R, 3>(a, row, block + g0); break;
      case 2: Tile<V, T, R, 2>(a, row, block + g0); break;
      default: Tile<V, T, R, 1>(a, row, block + g0); break;
    }
  }
}

template <class V, Weight T>
void RunTyped(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  for (int64_t block = block_begin; block < block_end; block += kGroup) {
    const int64_t groups = block_end - block < kGroup ? block_end - block : kGroup;
    // A kBf16In13 weight is unpacked once per tile of rows: taller tiles unpack it fewer times.
    constexpr int R = T == Weight::kBf16In13 ? V::kRowTile13 : V::kRowTile;
    static_assert(R == 4 || R == 6 || R == 8, "the remainder below takes up to 7 rows");
    int64_t row = 0;
    for (; row + R <= a.m; row += R) Rows<V, T, R>(a, row, block, groups);
    switch (a.m - row) {
      case 7: if constexpr (R > 7) Rows<V, T, 7>(a, row, block, groups); break;
      case 6: if constexpr (R > 6) Rows<V, T, 6>(a, row, block, groups); break;
      case 5: if constexpr (R > 5) Rows<V, T, 5>(a, row, block, groups); break;
      case 4: if constexpr (R > 4) Rows<V, T, 4>(a, row, block, groups); break;
      case 3: Rows<V, T, 3>(a, row, block, groups); break;
      case 2: Rows<V, T, 2>(a, row, block, groups); break;
      case 1: Rows<V, T, 1>(a, row, block, groups); break;
      default: break;
    }
  }
}

template <class V>
void Run(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  switch (a.type) {
    case Weight::kInt8: RunTyped<V, Weight::kInt8>(a, block_begin, block_end); break;
    case Weight::kBf16: RunTyped<V, Weight::kBf16>(a, block_begin, block_end); break;
    case Weight::kF32: RunTyped<V, Weight::kF32>(a, block_begin, block_end); break;
    case Weight::kBf16In13: RunTyped<V, Weight::kBf16In13>(a, block_begin, block_end); break;
  }
}

}  // namespace body
}  // namespace grok
