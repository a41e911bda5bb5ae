// Portable path of the attention kernel: one lane, the same operations in the same order as the vector
// paths (std::fma for their fused multiply-adds, comparisons written as the SSE/AVX min/max define them),
// so its results are bitwise identical to theirs.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_body.h"

namespace grok {
namespace attn {
namespace {

struct Scalar {
  using Reg = float;
  using Mask = bool;
  static constexpr int kW = 1;
  static constexpr int kScoreRegs = 4;
  static constexpr int kScoreQueries = 4;  // query vectors per score tile
  static constexpr int kValueAccs = 8;     // accumulator registers per value tile
  static constexpr int kValueRegs = 2;
  static constexpr int kTransposeW = 0;  // the key tile is copied element by element

  static Reg Zero() { return 0.0f; }
  static Reg Set1(float v) { return v; }
  static Reg Load(const float* p) { return *p; }
  static Reg LoadN(const float* p, int64_t n) { return n >= 1 ? *p : 0.0f; }
  static void Store(float* p, Reg v) { *p = v; }
  static void StoreN(float* p, Reg v, int64_t n) {
    if (n >= 1) *p = v;
  }
  static Reg LoadBf16(const uint16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static Reg LoadBf16N(const uint16_t* p, int64_t n) { return n >= 1 ? LoadBf16(p) : 0.0f; }
  static Reg LoadAny(const float* p) { return *p; }
  static Reg LoadAny(const uint16_t* p) { return LoadBf16(p); }
  static Reg LoadPart(const float* p, int64_t n) { return n >= 1 ? *p : 0.0f; }
  static Reg LoadPart(const uint16_t* p, int64_t n) { return LoadBf16N(p, n); }
  static Reg Fma(Reg a, Reg b, Reg c) { return std::fma(a, b, c); }
  static Reg Mul(Reg a, Reg b) { return a * b; }
  static Reg Add(Reg a, Reg b) { return a + b; }
  static Reg Sub(Reg a, Reg b) { return a - b; }
  static Reg Div(Reg a, Reg b) { return a / b; }
  static Reg Max(Reg a, Reg b) { return a > b ? a : b; }
  static Reg Min(Reg a, Reg b) { return a < b ? a : b; }
  static Reg Abs(Reg a) { return std::fabs(a); }
  static bool Any(Mask m) { return m; }
  static Mask Less(Reg a, Reg b) { return a < b; }
  static Reg Select(Mask m, Reg a, Reg b) { return m ? a : b; }
  static Reg MaskTail(Reg v, int64_t n, float fill) { return n >= 1 ? v : fill; }
  static Reg Pow2(Reg t, Reg magic) {
    int32_t ti, mi;
    std::memcpy(&ti, &t, sizeof ti);
    std::memcpy(&mi, &magic, sizeof mi);
    const int32_t bits = (ti - mi + 127) * (1 << 23);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};

}  // namespace

void ItemScalar(const Call& c, const Item& it) { body::AnyPool<Scalar>(c, it); }
void ExpScalar(const float* x, float* y, int64_t n) { body::Elementwise<Scalar, false>(x, y, n); }
void CapScalar(const float* x, float* y, int64_t n) { body::Elementwise<Scalar, true>(x, y, n); }

}  // namespace attn
}  // namespace grok
