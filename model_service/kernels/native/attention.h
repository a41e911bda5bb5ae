// Paged attention over a block pool, one work item at a time, one function per instruction set
// (see attention_body.h for the arithmetic and why it is row-invariant).
#ifndef GROK_KERNELS_ATTENTION_H_
#define GROK_KERNELS_ATTENTION_H_

#include <cstdint>

namespace grok {
namespace attn {

// The whole call: q [R, Hq, D] float32, pools [NBLK, Hkv, BS, D] float32 or bfloat16 (uint16 bits),
// tables [S, L] int32, out [R, Hq * D] float32. Validated by the handler before any item runs.
struct Call {
  const float* q;
  const void* pool_k;
  const void* pool_v;
  bool bf16;              // pool element type: bfloat16 (true) or float32
  const int32_t* tables;  // [S, L]
  float* out;
  int64_t hq, hkv, d, bs, table_len;
  float multiplier;
};

// One work item: `count` rows of one sequence (`rows`, ascending limit) against kv heads head..head+heads,
// i.e. the heads * count * G query vectors (kv head, row, g) with G = Hq / Hkv. Every output element of these
// query heads of these rows is written by this item alone.
struct Item {
  const int64_t* rows;    // [count] row indices into q / out
  const int32_t* limits;  // [count] the rows' limits (ascending), each >= 0
  int64_t count;
  int64_t seq;            // the rows' sequence (row of tables)
  int64_t head;           // first kv head
  int64_t heads;          // number of kv heads
};

void ItemScalar(const Call& c, const Item& it);
void ItemAvx2(const Call& c, const Item& it);
void ItemAvx512(const Call& c, const Item& it);

// The vectorised elementwise functions on their own, for the accuracy tests (n floats in, n out).
void ExpScalar(const float* x, float* y, int64_t n);
void ExpAvx2(const float* x, float* y, int64_t n);
void ExpAvx512(const float* x, float* y, int64_t n);
void CapScalar(const float* x, float* y, int64_t n);  // 30 * tanh(x / 30)
void CapAvx2(const float* x, float* y, int64_t n);
void CapAvx512(const float* x, float* y, int64_t n);

}  // namespace attn
}  // namespace grok

#endif  // GROK_KERNELS_ATTENTION_H_
