// XLA FFI handler for the nucleus (top-p) threshold: one call finds, per row, the logit the sampler cuts at.
//
// grok_nucleus_threshold(logits f32 [..., V], probs f32 [..., V], top_p f32 [...]) -> f32 [...]
// Per row: the smallest logit v of the row with S(v) >= 1 - top_p, where S(v) is the probability mass of the
// elements whose logit is <= v (probs is the row's softmax, computed by XLA). This is the threshold of the
// reference's rule (sort ascending, cumulative sum, first index reaching 1 - top_p) and of the XLA binary
// search in sampling.py, which this call replaces on large vocabularies.
//
// Logits are ordered by their order-preserving uint32 image (the XLA search's order), and the threshold's
// image is found by a radix select in three passes (11, 11 and 10 bits): each pass builds a histogram of
// probability mass (float64) over the elements sharing the prefix found so far and keeps the first bucket
// where the mass below it plus its own reaches the target. Sums run in a fixed order, so a row's result
// depends on nothing but the row. Edge cases follow the XLA search: target <= 0 gives the row's minimum,
// a target the row's total mass never reaches (float rounding) gives its maximum; NaNs give some value.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace grok {
namespace {

constexpr uint32_t kSign = 0x80000000u;
constexpr int kWays = 4;  // sub-histograms: consecutive elements in one bucket do not wait on each other's add
constexpr int kMaxBuckets = 1 << 11;

struct Pass {
  int shift;  // the pass's digit is (key >> shift) & (buckets - 1)
  int bits;
};
constexpr Pass kPasses[3] = {{21, 11}, {10, 11}, {0, 10}};

// Monotone in the float value: negative floats (sign set) are inverted, positive ones get the sign bit.
inline uint32_t KeyOf(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits >= kSign ? ~bits : bits | kSign;
}

inline float FloatOf(uint32_t key) {
  const uint32_t bits = key >= kSign ? key ^ kSign : ~key;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

struct Entry {
  uint32_t key;
  float prob;
};

// Mass per digit of the pass, summed in kWays interleaved sub-histograms merged in a fixed order.
struct Histogram {
  double ways[kWays][kMaxBuckets];
  double mass[kMaxBuckets];

  void Clear(int buckets) {
    for (auto& way : ways) std::memset(way, 0, sizeof(double) * buckets);
  }
  void Merge(int buckets) {
    static_assert(kWays == 4, "the merge below adds exactly kWays sub-histograms");
    for (int b = 0; b < buckets; ++b) mass[b] = ((ways[0][b] + ways[1][b]) + ways[2][b]) + ways[3][b];
  }
  // The first bucket where below + mass up to it reaches target (below becomes the mass before it); -1 if none.
  int Find(int buckets, double target, double& below) const {
    double cumulative = below;
    for (int b = 0; b < buckets; ++b) {
      const double next = cumulative + mass[b];
      if (next >= target) {
        below = cumulative;
        return b;
      }
      cumulative = next;
    }
    return -1;
  }
};

// Pass 1 over the whole row: mass per top digit.
void FirstPass(const float* logits, const float* probs, int64_t n, Histogram& h) {
  const int shift = kPasses[0].shift;
  h.Clear(1 << kPasses[0].bits);
  const int64_t whole = n - n % kWays;
  for (int64_t i = 0; i < whole; i += kWays)
    for (int w = 0; w < kWays; ++w) h.ways[w][KeyOf(logits[i + w]) >> shift] += probs[i + w];
  for (int64_t i = whole; i < n; ++i) h.ways[0][KeyOf(logits[i]) >> shift] += probs[i];
  h.Merge(1 << kPasses[0].bits);
}

// Later passes over the compacted entries sharing the prefix: mass per digit `pass`.
void LaterPass(const Entry* entries, int64_t n, int pass, Histogram& h) {
  const int shift = kPasses[pass].shift, buckets = 1 << kPasses[pass].bits;
  const uint32_t digit_mask = buckets - 1;
  h.Clear(buckets);
  for (int64_t i = 0; i < n; ++i) h.ways[i % kWays][(entries[i].key >> shift) & digit_mask] += entries[i].prob;
  h.Merge(buckets);
}

// Keeps the entries whose key has `prefix` above bit `shift` (in place, order kept); returns their count.
int64_t Compact(Entry* entries, int64_t n, int shift, uint32_t prefix) {
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    entries[kept] = entries[i];
    kept += (entries[i].key >> shift) == prefix;
  }
  return kept;
}

// The largest key among the entries (the answer when a pass finds no bucket reaching the target).
uint32_t MaxKey(const Entry* entries, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = entries[i].key > top ? entries[i].key : top;
  return top;
}

// The row's elements whose top digit is `prefix`, in row order. Blocks are tested first in a loop the compiler
// vectorises, and only blocks holding a match are copied, without branches (a branch per element mispredicts
// on flat rows, where a few percent of the elements match at random places).
int64_t Gather(const float* logits, const float* probs, int64_t n, uint32_t prefix, std::vector<Entry>& entries) {
  constexpr int64_t kBlock = 16;
  const uint32_t base = prefix << kPasses[0].shift;
  if (static_cast<int64_t>(entries.size()) < n) entries.resize(n);
  Entry* out = entries.data();
  int64_t kept = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    uint32_t keys[kBlock];
    uint32_t any = 0;
    for (int64_t j = 0; j < len; ++j) {
      keys[j] = KeyOf(logits[start + j]);
      any |= (keys[j] - base) >> kPasses[0].shift == 0;
    }
    if (!any) continue;
    for (int64_t j = 0; j < len; ++j) {
      out[kept] = {keys[j], probs[start + j]};  // kept <= start + j < n: always in bounds
      kept += (keys[j] - base) >> kPasses[0].shift == 0;
    }
  }
  return kept;
}

uint32_t MinKey(const float* logits, int64_t n) {
  uint32_t low = 0xFFFFFFFFu;
  for (int64_t i = 0; i < n; ++i) low = std::min(low, KeyOf(logits[i]));
  return low;
}

uint32_t MaxKey(const float* logits, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, KeyOf(logits[i]));
  return top;
}

// Scratch reused across calls on one thread (the entries of the first pass's bucket; the histograms).
struct Scratch {
  std::vector<Entry> entries;
  Histogram histogram;
};

float RowThreshold(const float* logits, const float* probs, int64_t n, float top_p, Scratch& s) {
  if (n == 0) return std::numeric_limits<float>::quiet_NaN();
  const float target32 = 1.0f - top_p;  // float32, as XLA computes `1 - top_p`
  if (target32 <= 0.0f) return FloatOf(MinKey(logits, n));
  const double target = target32;
  Histogram& h = s.histogram;
  FirstPass(logits, probs, n, h);
  double below = 0.0;
  const int first = h.Find(1 << kPasses[0].bits, target, below);
  if (first < 0) return FloatOf(MaxKey(logits, n));  // the row's mass (rounded) never reaches it, or NaN
  uint32_t prefix = static_cast<uint32_t>(first);
  int64_t count = Gather(logits, probs, n, prefix, s.entries);
  for (int pass = 1; pass < 3; ++pass) {
    if (pass == 2) count = Compact(s.entries.data(), count, kPasses[1].shift, prefix);
    LaterPass(s.entries.data(), count, pass, h);
    const int digit = h.Find(1 << kPasses[pass].bits, target, below);
    // Summed in another order, the prefix's buckets can fall a rounding short of what the coarser pass saw:
    // then no finer bucket reaches the target, as with a row that never does, and the prefix's largest key
    // is kept.
    if (digit < 0) return FloatOf(MaxKey(s.entries.data(), count));
    prefix = (prefix << kPasses[pass].bits) | static_cast<uint32_t>(digit);
  }
  return FloatOf(prefix);
}

ffi::Error NucleusThreshold(ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> top_p,
                            ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = logits.dimensions(), pdims = probs.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("grok_nucleus_threshold: logits must have rank >= 1");
  if (pdims.size() != dims.size() || !std::equal(dims.begin(), dims.end(), pdims.begin()))
    return ffi::Error::InvalidArgument("grok_nucleus_threshold: probs must have the logits' shape");
  const int64_t v = dims.back();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < dims.size(); ++d) rows *= dims[d];
  if (static_cast<int64_t>(top_p.element_count()) != rows || static_cast<int64_t>(out->element_count()) != rows)
    return ffi::Error::InvalidArgument("grok_nucleus_threshold: top_p and the result need one value per row (" +
                                       std::to_string(rows) + ")");
  thread_local Scratch scratch;
  const float* l = logits.typed_data();
  const float* p = probs.typed_data();
  for (int64_t r = 0; r < rows; ++r)
    out->typed_data()[r] = RowThreshold(l + r * v, p + r * v, v, top_p.typed_data()[r], scratch);
  return ffi::Error::Success();
}

// One row of grok_values_above: the count of values > floor (the first `cap` of their indices written, ascending), and
// the largest value in `top` (NaN if the row holds one).
int64_t RowAbove(const float* x, int64_t v, float floor, int32_t* out, int64_t cap, float& top) {
  int64_t kept = 0, i = 0;
  float high = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__SSE2__)
  // Eight values a step in SSE2 (every x86-64 CPU has it): one comparison mask, and only its set bits are walked.
  const __m128 f = _mm_set1_ps(floor);
  __m128 high4 = _mm_set1_ps(high), nan4 = _mm_setzero_ps();
  for (; i + 8 <= v; i += 8) {
    const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
    high4 = _mm_max_ps(high4, _mm_max_ps(a, b));  // a NaN is caught by the unordered test below
    nan4 = _mm_or_ps(nan4, _mm_cmpunord_ps(a, b));
    unsigned m = static_cast<unsigned>(_mm_movemask_ps(_mm_cmpgt_ps(a, f)) | (_mm_movemask_ps(_mm_cmpgt_ps(b, f)) << 4));
    for (; m != 0; m &= m - 1, ++kept)
      if (kept < cap) out[kept] = static_cast<int32_t>(i + __builtin_ctz(m));
  }
  float lanes[4];
  _mm_storeu_ps(lanes, high4);
  for (const float lane : lanes) high = lane > high ? lane : high;
  nan = _mm_movemask_ps(nan4) != 0;
#endif
  for (; i < v; ++i) {
    nan |= x[i] != x[i];
    high = x[i] > high ? x[i] : high;
    if (x[i] > floor && kept++ < cap) out[kept - 1] = static_cast<int32_t>(i);
  }
  top = nan ? std::numeric_limits<float>::quiet_NaN() : high;
  return kept;
}

// grok_values_above(values f32 [..., V]; attr floor) -> (indices i32 [..., C], count i32 [...], top f32 [...]):
// per row, the ascending indices of the values > floor (the first C of them; the rest of `indices` is unspecified),
// how many there are (all of them, so count > C says the list is cut), and the row's largest value (NaN if the row
// holds one). The sampler draws among the values its filters kept (everything else is -1e10) with these.
ffi::Error ValuesAbove(ffi::Buffer<ffi::F32> values, float floor, ffi::ResultBuffer<ffi::S32> indices,
                       ffi::ResultBuffer<ffi::S32> count, ffi::ResultBuffer<ffi::F32> top) {
  const auto dims = values.dimensions(), idims = indices->dimensions();
  if (dims.size() < 1 || idims.size() != dims.size() || !std::equal(dims.begin(), dims.end() - 1, idims.begin()))
    return ffi::Error::InvalidArgument("grok_values_above: indices must be [..., C] over values [..., V]");
  const int64_t v = dims.back(), cap = idims.back();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < dims.size(); ++d) rows *= dims[d];
  if (cap < 1 || static_cast<int64_t>(count->element_count()) != rows ||
      static_cast<int64_t>(top->element_count()) != rows)
    return ffi::Error::InvalidArgument("grok_values_above: want C >= 1 and one count and one top per row (" +
                                       std::to_string(rows) + ")");
  if (v >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("grok_values_above: V must fit int32");
  for (int64_t r = 0; r < rows; ++r) {
    float high;
    const int64_t kept = RowAbove(values.typed_data() + r * v, v, floor, indices->typed_data() + r * cap, cap, high);
    count->typed_data()[r] = static_cast<int32_t>(std::min<int64_t>(kept, std::numeric_limits<int32_t>::max()));
    top->typed_data()[r] = high;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace grok

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokNucleusThreshold, grok::NucleusThreshold,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokValuesAbove, grok::ValuesAbove,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("floor")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
