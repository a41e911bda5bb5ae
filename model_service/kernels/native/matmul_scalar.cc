// Portable path: the same per-column operation order as the vector paths (fused multiply-adds over k
// within a scale block, then one multiply by the block scale and one add per block), so it is bitwise
// identical to them.
#include <cmath>
#include <cstring>

#include "matmul.h"

namespace grok {

namespace {

inline float Value(const MatmulArgs& a, int64_t j, int64_t k, int64_t lane) {
  const int64_t i = (j * a.k + k) * kLanes + lane;
  switch (a.type) {
    case Weight::kInt8: return static_cast<float>(static_cast<const int8_t*>(a.w)[i]);
    case Weight::kBf16: {  // a bfloat16 is the high half of the float32 with the same value
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(a.w)[i]) << 16;
      float v;
      std::memcpy(&v, &bits, sizeof v);
      return v;
    }
    case Weight::kBf16In13: {  // the low byte and the dictionary's high byte (matmul.h)
      const uint8_t* g = static_cast<const uint8_t*>(a.w) + (j * (a.k / 4) + k / 4) * kGroup13Bytes;
      const int64_t p = Position13(k % 4, lane);
      const int nibble = p < 32 ? g[64 + p] & 15 : g[64 + p - 32] >> 4;
      const int fifth = (g[96 + p / 8] >> (p % 8)) & 1;
      const uint32_t bits = (static_cast<uint32_t>(a.dictionary[nibble | fifth << 4]) << 24) |
                            (static_cast<uint32_t>(g[p]) << 16);
      float v;
      std::memcpy(&v, &bits, sizeof v);
      return v;
    }
    default: return static_cast<const float*>(a.w)[i];
  }
}

}  // namespace

void MatmulScalar(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  const int64_t kb = a.k / a.blocks;
  for (int64_t j = block_begin; j < block_end; ++j) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t col = j * kLanes + lane;
      if (col >= a.n_out) break;
      for (int64_t i = 0; i < a.m; ++i) {
        const int64_t r = a.rows[i];
        const float* x = a.x + r * a.k;
        float out = 0.0f;
        for (int64_t b = 0; b < a.blocks; ++b) {
          float acc = 0.0f;
          for (int64_t k = b * kb; k < (b + 1) * kb; ++k) acc = std::fmaf(x[k], Value(a, j, k, lane), acc);
          if (a.scales != nullptr) acc = acc * a.scales[b * a.nb * kLanes + col];
          out = b == 0 ? acc : out + acc;
        }
        a.out[r * a.n_out + col] = out;
      }
    }
  }
}

}  // namespace grok
