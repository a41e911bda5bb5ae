// int8 activations, portable part: the rounding of the rows (shared by every path) and the scalar product, the
// reference the vector paths are held to (matmul.h says the operation order).
#include <cmath>

#include "matmul.h"

namespace grok {

void QuantizeRows(const float* x, const int64_t* rows, int64_t m, int64_t k, int64_t blocks, int8_t* q, float* d,
                  int32_t* c) {
  const int64_t kb = k / blocks, per_block = (kb + kQuantBlock - 1) / kQuantBlock, subs = blocks * per_block;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = rows[i];
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t s = 0; s < per_block; ++s) {
        const int64_t k0 = b * kb + s * kQuantBlock, sub = r * subs + b * per_block + s;
        const int64_t len = kb - s * kQuantBlock < kQuantBlock ? kb - s * kQuantBlock : kQuantBlock;
        const float* v = x + r * k + k0;
        float amax = 0.0f;
        for (int64_t t = 0; t < len; ++t) {
          const float a = std::fabs(v[t]);
          if (a > amax) amax = a;  // NaN never compares greater: it rounds to 0 below
        }
        const float step = amax / 127.0f;
        const float inverse = step > 0.0f && std::isfinite(step) ? 1.0f / step : 0.0f;
        int8_t* out = q + sub * kQuantBlock;
        int32_t sum = 0;
        for (int64_t t = 0; t < kQuantBlock; ++t) {
          float rounded = t < len ? std::nearbyint(v[t] * inverse) : 0.0f;
          if (!(rounded >= -127.0f)) rounded = rounded != rounded ? 0.0f : -127.0f;
          if (rounded > 127.0f) rounded = 127.0f;
          out[t] = static_cast<int8_t>(rounded);
          sum += out[t];
        }
        d[sub] = step;
        c[sub] = 128 * sum;
      }
    }
  }
}

void QuantScalar(const MatmulArgs& a, int64_t block_begin, int64_t block_end) {
  const QuantRows& qr = *a.quant;
  const int64_t kb = a.k / a.blocks;
  const int8_t* w = static_cast<const int8_t*>(a.w);
  for (int64_t j = block_begin; j < block_end; ++j) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t col = j * kLanes + lane;
      if (col >= a.n_out) break;
      for (int64_t i = 0; i < a.m; ++i) {
        const int64_t r = a.rows[i];
        float out = 0.0f;
        for (int64_t b = 0; b < a.blocks; ++b) {
          float acc = 0.0f;
          for (int64_t s = 0; s < qr.per_block; ++s) {
            const int64_t k0 = b * kb + s * kQuantBlock, sub = r * qr.subs + b * qr.per_block + s;
            const int64_t len = kb - s * kQuantBlock < kQuantBlock ? kb - s * kQuantBlock : kQuantBlock;
            const int8_t* q = qr.q + sub * kQuantBlock;
            int32_t sum = 0;
            for (int64_t t = 0; t < len; ++t) sum += static_cast<int32_t>(q[t]) * w[(j * a.k + k0 + t) * kLanes + lane];
            acc = std::fmaf(static_cast<float>(sum), qr.d[sub], acc);
          }
          acc = acc * a.scales[b * a.nb * kLanes + col];
          out = b == 0 ? acc : out + acc;
        }
        a.out[r * a.n_out + col] = out;
      }
    }
  }
}

}  // namespace grok
