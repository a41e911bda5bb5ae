// float32 rows x packed weights -> float32, one function per instruction set (see matmul_body.h).
#ifndef GROK_KERNELS_MATMUL_H_
#define GROK_KERNELS_MATMUL_H_

#include <cstdint>

namespace grok {

constexpr int64_t kLanes = 16;  // columns per packed block: weights are stored [N/16, K, 16]
constexpr int64_t kGroup = 4;   // column blocks one call of a tile function computes together

// One product: out[r, n] = sum_b scale[b, n] * sum_{k in block b} x[r, k] * w[n / 16, k, n % 16] for the m
// rows r = rows[0..m) of x and out (the other rows of out are left to the caller).
struct MatmulArgs {
  const float* x;        // [rows of x, k]
  const void* w;         // int8 or float32 [nb, k, 16]
  const float* scales;   // [blocks, nb * 16], or nullptr (no scales, blocks == 1)
  float* out;            // [rows of x, n_out], n_out <= nb * 16
  const int64_t* rows;   // [m] the rows to compute, ascending
  int64_t m, k, nb, n_out, blocks;
  bool int8;             // weight element type: int8 (true) or float32
};

// Computes the columns of blocks [block_begin, block_end) for every row. The per-column sequence of
// operations is the same in every implementation, for any row count and any column range, so the result
// of one column of one row never depends on anything else (batch invariance by construction).
void MatmulScalar(const MatmulArgs& a, int64_t block_begin, int64_t block_end);
void MatmulAvx2(const MatmulArgs& a, int64_t block_begin, int64_t block_end);
void MatmulAvx512(const MatmulArgs& a, int64_t block_begin, int64_t block_end);

}  // namespace grok

#endif  // GROK_KERNELS_MATMUL_H_
