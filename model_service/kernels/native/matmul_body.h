// The rows form of the vector kernel, written once over a small vector interface `V` (AVX-512: one register per 16-column
// block; AVX2: two). Included by one translation unit per instruction set, each compiled for its target.
//
// The listed rows (a.rows) are taken R (<= 4) at a time and column blocks G (<= 4) at a time, so one weight load feeds R fused
// multiply-adds and G x R independent accumulator chains hide the FMA latency. Neither R nor G changes the
// per-column operation order: acc = fma(x[k], w[k], acc) for k in order within a scale block, then
// acc * scale, then out + acc over blocks.
#include "matmul.h"

namespace grok {
namespace body {

template <class V, int R, int G>
inline void Tile(const MatmulArgs& a, int64_t row, int64_t block) {
  using Reg = typename V::Reg;
  const int64_t kb = a.k / a.blocks;
  Reg out[R][G][V::kPerBlock];
  for (int64_t b = 0; b < a.blocks; ++b) {
    Reg acc[R][G][V::kPerBlock];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < V::kPerBlock; ++h) acc[r][g][h] = V::Zero();
    for (int64_t k = b * kb; k < (b + 1) * kb; ++k) {
      Reg w[G][V::kPerBlock];
      for (int g = 0; g < G; ++g) {
        const int64_t offset = ((block + g) * a.k + k) * kLanes;
        for (int h = 0; h < V::kPerBlock; ++h) w[g][h] = V::LoadWeight(a, offset + h * V::kWidth);
      }
      for (int r = 0; r < R; ++r) {
        const Reg xr = V::Broadcast(a.x[a.rows[row + r] * a.k + k]);
        for (int g = 0; g < G; ++g)
          for (int h = 0; h < V::kPerBlock; ++h) acc[r][g][h] = V::Fma(xr, w[g][h], acc[r][g][h]);
      }
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

template <class V, int R>
inline void Rows(const MatmulArgs& a, int64_t row, int64_t block, int64_t groups) {
  switch (groups) {
    case 4: Tile<V, R, 4>(a, row, block); break;
    case 3: Tile<V, R, 3>(a, row, block); break;
    case 2: Tile<V, R, 2>(a, row, block); break;
    default: Tile<V, R, 1>(a, row, block); break;
  }
}

template <class V>
void Run(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  for (int64_t block = block_begin; block < block_end; block += kGroup) {
    const int64_t groups = block_end - block < kGroup ? block_end - block : kGroup;
    int64_t row = 0;
    for (; row + 4 <= a.m; row += 4) Rows<V, 4>(a, row, block, groups);
    switch (a.m - row) {
      case 3: Rows<V, 3>(a, row, block, groups); break;
      case 2: Rows<V, 2>(a, row, block, groups); break;
      case 1: Rows<V, 1>(a, row, block, groups); break;
      default: break;
    }
  }
}

}  // namespace body
}  // namespace grok
