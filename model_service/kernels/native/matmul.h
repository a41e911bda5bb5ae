// float32 rows x packed weights -> float32, two forms per instruction set (see matmul_body.h, matmul_panel.h).
#ifndef GROK_KERNELS_MATMUL_H_
#define GROK_KERNELS_MATMUL_H_

#include <cstdint>

namespace grok {

constexpr int64_t kLanes = 16;  // columns per packed block: weights are stored [N/16, K, 16]
constexpr int64_t kGroup = 4;   // column blocks one call of a tile function computes together

// The element type of a packed weight. Every type converts to float32 exactly (int8 and bfloat16 are subsets
// of float32), so the product's arithmetic is the same for all of them.
//
// kBf16In13 is bfloat16 stored in 13 bits a value, exactly: a value's low byte, and a 5-bit index into a
// dictionary of at most 32 high bytes (sign and 7 of the 8 exponent bits; a table of normally distributed values
// uses about 30). The weight is [NB, K / 4, kGroup13Bytes]: per column block, per 4 values of k, 64 values in
// kGroup13Bytes bytes: 64 low bytes, 32 bytes of 4-bit index parts (byte j: position j in its low half, position
// j + 32 in its high half), 8 bytes of the indexes' fifth bits (bit p of the little-endian 64 bits: position p).
// Position Position13(t, c) holds k = 4 g + t of column c (the order the AVX-512 unpacking yields).
enum class Weight : int { kInt8, kF32, kBf16, kBf16In13 };
constexpr int64_t kGroup13Bytes = 104;
constexpr int64_t kDictionary13 = 32;  // dictionary entries (high bytes)
constexpr int64_t Position13(int64_t t, int64_t c) {
  return 16 * (c / 4) + 2 * (c % 4) + (t % 2) + 8 * (t / 2);
}

struct QuantRows;  // activations rounded to int8 (below)

// One product: out[r, n] = sum_b scale[b, n] * sum_{k in block b} x[r, k] * w[n / 16, k, n % 16] for the m
// rows r = rows[0..m) of x and out (the other rows of out are left to the caller).
struct MatmulArgs {
  const float* x;        // [rows of x, k]
  const void* w;         // int8, float32 or bfloat16 [nb, k, 16]
  const float* scales;   // [blocks, nb * 16], or nullptr (no scales, blocks == 1)
  float* out;            // [rows of x, n_out], n_out <= nb * 16
  const int64_t* rows;   // [m] the rows to compute, ascending
  int64_t m, k, nb, n_out, blocks;
  Weight type;
  const QuantRows* quant = nullptr;  // the int8 product (Quant*): the rows' int8 activations
  const uint8_t* dictionary = nullptr;  // kBf16In13: the kDictionary13 high bytes
};

// Both forms compute the columns of blocks [block_begin, block_end) for every listed row with the same
// per-element sequence of operations (fused multiply-adds over k in order from zero within a scale block,
// then one multiply by the block's scale, then one add per block in order), in every implementation, for
// any row count and any column range, so the result of one column of one row never depends on anything
// else (batch invariance by construction) and the two forms give the same bits.
//
// Rows form (few rows meet a matrix, bound by reading the weight; int8 and bfloat16 weights at any row count):
// each weight element is loaded and converted once per tile of up to 4 rows (AVX-512) or 6 (AVX2). kBf16In13
// weights take this form only (4 values of k of G column blocks unpacked to float32 at a time, per tile of up
// to 8 rows on AVX-512).
void MatmulScalar(const MatmulArgs& a, int64_t block_begin, int64_t block_end);
void MatmulAvx2(const MatmulArgs& a, int64_t block_begin, int64_t block_end);
void MatmulAvx512(const MatmulArgs& a, int64_t block_begin, int64_t block_end);

// Panel form (many rows meet a matrix, bound by arithmetic): a panel of a few column blocks x a slice of K
// is converted to float32 once into a cache-resident buffer and reused by every row; the accumulators
// live in memory between slices (a float32 store and load are exact, so the chains are unchanged).
// `scratch` holds PanelScratch(a.m) floats for the calling thread alone.
constexpr int64_t kPanelSlice = 256;   // values of K per panel: 4 blocks x 256 x 16 float32 = 64 KB (L2)
constexpr int64_t kPanelMaxGroup = 4;  // column blocks per panel, at most
constexpr int64_t PanelScratch(int64_t m) { return kPanelMaxGroup * kLanes * (kPanelSlice + 2 * m); }
void PanelAvx2(const MatmulArgs& a, int64_t block_begin, int64_t block_end, float* scratch);
void PanelAvx512(const MatmulArgs& a, int64_t block_begin, int64_t block_end, float* scratch);

// int8 activations (an opt-in that changes results; llama.cpp's Q8_0 activations): each listed row of x is cut
// into sub-blocks of kQuantBlock values of K inside each scale block (the last one of a scale block shorter),
// and each sub-block is rounded to int8 with one step d = max|x| / 127: q = nearbyint(x * (1 / d)), clamped to
// [-127, 127] (QuantizeRows, one implementation for every path). The products then take, per output element,
//   acc = fma(float(sum_t q[t] * w[t]), d, acc) over the sub-blocks of a scale block in order (the integer sum
//   is exact, so how a path forms it does not matter), then acc * scale, then out + that over blocks in order,
// so every instruction set gives the same bits and a row's result depends only on that row.
constexpr int64_t kQuantBlock = 32;
struct QuantRows {
  const int8_t* q;   // [rows of x, subs, kQuantBlock], zero past a short sub-block's end
  const float* d;    // [rows of x, subs] the step of each sub-block
  const int32_t* c;  // [rows of x, subs] 128 * the sub-block's sum of q (the VNNI path's offset)
  int64_t subs;      // sub-blocks per row: blocks * per_block
  int64_t per_block; // sub-blocks per scale block: ceil(k / blocks / kQuantBlock)
};
void QuantizeRows(const float* x, const int64_t* rows, int64_t m, int64_t k, int64_t blocks, int8_t* q, float* d,
                  int32_t* c);
void QuantizeRowsAvx512(const float* x, const int64_t* rows, int64_t m, int64_t k, int64_t blocks, int8_t* q,
                        float* d, int32_t* c);  // the same bytes, with the AVX-512 product
void QuantScalar(const MatmulArgs& a, int64_t block_begin, int64_t block_end);
void QuantAvx2(const MatmulArgs& a, int64_t block_begin, int64_t block_end);
// The AVX-512 path needs VNNI and VBMI.
void QuantAvx512(const MatmulArgs& a, int64_t block_begin, int64_t block_end);

}  // namespace grok

#endif  // GROK_KERNELS_MATMUL_H_
