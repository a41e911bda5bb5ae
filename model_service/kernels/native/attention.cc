// XLA FFI handler for paged attention over a block pool, one query token per row.
//
// grok_paged_attention(q f32 [R, Hq, D], pool_k, pool_v f32|bf16 [NBLK, Hkv, BS, D], tables s32 [S, L],
//                      seq s32 [R], limit s32 [R], rows pred [R]) -> f32 [R, Hq * D]
// Attributes: multiplier (f32), isa (0 best available, 1 scalar, 2 AVX2, 3 AVX-512), threads (0: XLA's pool).
// Row r (when rows[r]) attends with each query head h to kv head h / (Hq / Hkv) of sequence seq[r] at
// positions 0..limit[r] (position p is at block tables[seq[r], p / BS], offset p % BS): scores q.k * multiplier,
// capped 30 tanh(s / 30), softmax, weighted sum of the values. Unmarked rows are zero and cost nothing.
// A marked row needs 0 <= limit < L * BS and valid blocks up to its limit; anything else is an error.
//
// Work items are (rows of one sequence, a range of kv heads), sized so that their scores stay in L2 where that
// moves fewer bytes (VectorsPerItem): the rows of a prompt chunk share each key and value load, and an item reads
// its heads' adjacent slices of each block together. Each item is computed start to finish by one thread, and an
// item's arithmetic per row does not depend on the item's other rows (attention_body.h), so a row's bits are the
// same whatever R, the other rows, the mask, the row order, the grouping or the thread count.
//
// grok_attention_math(x f32 [N]) -> f32 [N], attributes fn (0 exp, 1 the cap 30 tanh(x / 30)), isa: the
// kernel's vectorised functions on their own, for the accuracy tests.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "attention.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace grok {
namespace attn {
namespace {

enum Isa : int64_t { kBest = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };
constexpr int64_t kVectorsPerHead = 384;      // query vectors per kv head in one item
constexpr int64_t kScratchBytes = 12 << 20;  // an item's scores (vectors x keys floats) at most
// An item's scores are written, rewritten as exponentials and read by the value pass: they stay in the core's L2
// (512 KB or more on the x86 CPUs this runs on) up to kCachedScoreBytes; past it each score costs about
// kSpillBytesPerScore of memory traffic. Splitting a prompt chunk's rows over more items keeps the scores cached
// but reads the keys and values (2 * D * element bytes per key) once per item: VectorsPerItem takes whichever
// moves fewer bytes. Measured on a 2-core AMD EPYC (Zen 4), medium config, 57 prompt rows at position 3,000 beside
// 7 decode rows: the step took 127-138 ms with items sized by kScratchBytes alone, 94-101 ms with targets of 256
// KB to 2 MB (512 KB: 95-97).
constexpr int64_t kCachedScoreBytes = 512 << 10;
constexpr int64_t kSpillBytesPerScore = 12;

bool Supported(int64_t isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512: return __builtin_cpu_supports("avx512f");
    default: return false;
  }
}

int64_t Resolve(int64_t isa) {
  if (isa != kBest) return isa;
  return Supported(kAvx512) ? kAvx512 : Supported(kAvx2) ? kAvx2 : kScalar;
}

using ItemFn = void (*)(const Call&, const Item&);

ItemFn ItemFor(int64_t isa) {
  switch (isa) {
    case kAvx512: return ItemAvx512;
    case kAvx2: return ItemAvx2;
    default: return ItemScalar;
  }
}

ffi::Error Invalid(const std::string& what) { return ffi::Error::InvalidArgument("grok_paged_attention: " + what); }

ffi::Error CheckIsa(int64_t isa) {
  if (isa < kBest || isa > kAvx512 || (isa != kBest && !Supported(isa)))
    return ffi::Error::InvalidArgument("grok attention: instruction set " + std::to_string(isa) +
                                       " is not available on this CPU");
  return ffi::Error::Success();
}

// Shared by the caller and the pool tasks (as the matmul's Work): a task that starts after every item is
// claimed returns at once, so the caller only waits for items some running thread is computing.
struct Work {
  Call call;
  ItemFn fn;
  std::vector<int64_t> rows;   // marked rows, grouped by sequence, limits ascending within a sequence
  std::vector<int32_t> limits;  // their limits
  std::vector<Item> items;      // in the order the threads take them
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      fn(call, items[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void Execute(std::shared_ptr<Work> work, int64_t workers, ffi::ThreadPool& pool) {
  const int64_t n = static_cast<int64_t>(work->items.size());
  const int64_t want = std::min(workers, n);
  for (int64_t t = 1; t < want; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

int64_t Stride(int64_t nkeys) { return (nkeys + 31) / 32 * 32; }  // floats per score row (attention_body.h)

// Query vectors per kv head in one item over `nkeys` keys of `kv_bytes` bytes each (a key and a value of one
// head): as many as keep the scores in L2, or the most (kVectorsPerHead, kScratchBytes of scores) where reading
// the keys and values for fewer vectors costs more than the scores' spill; at least one.
int64_t VectorsPerItem(int64_t nkeys, int64_t kv_bytes) {
  const int64_t row_bytes = Stride(nkeys) * static_cast<int64_t>(sizeof(float));
  const int64_t most = std::max<int64_t>(1, std::min(kVectorsPerHead, kScratchBytes / row_bytes));
  const int64_t cached = std::max<int64_t>(1, std::min(most, kCachedScoreBytes / row_bytes));
  // bytes per vector and key: kv_bytes / cached against kv_bytes / most + kSpillBytesPerScore
  return kv_bytes * (most - cached) <= kSpillBytesPerScore * cached * most ? cached : most;
}

// Rows of one sequence per item: they share each key and value load (a prompt chunk's rows), VectorsPerItem / G
// of them (at least one row).
int64_t RowsPerItem(int64_t g, int64_t nkeys, int64_t kv_bytes) {
  return std::max<int64_t>(1, VectorsPerItem(nkeys, kv_bytes) / g);
}

// Kv heads per item: as many as keep the item's scores in L2 (a block's heads are adjacent in the pool, so an item
// reading several reads longer contiguous runs), at least one, and no fewer items than threads while heads can be
// split.
int64_t HeadsPerItem(int64_t hkv, int64_t vectors, int64_t nkeys, int64_t groups, int64_t threads) {
  const int64_t stride = Stride(nkeys);
  const int64_t row_bytes = stride * static_cast<int64_t>(sizeof(float));
  const int64_t budget = std::max(kCachedScoreBytes, vectors * row_bytes);  // heads share no key or value load
  auto fits = [&](int64_t h) { return h * vectors * row_bytes <= budget; };
  int64_t heads = hkv;
  auto next = [&](int64_t h) {  // the next smaller divisor of hkv
    for (int64_t d = h - 1; d >= 1; --d)
      if (hkv % d == 0) return d;
    return int64_t{1};
  };
  while (heads > 1 && (!fits(heads) || groups * (hkv / heads) < threads)) heads = next(heads);
  return heads;
}

// The marked rows sorted by (sequence, limit, row), each sequence's run cut into groups of rows and the kv
// heads into ranges; the costliest sequences first, and within one sequence head range by head range, so the
// threads work on neighbouring groups of one head and share its keys in cache. None of this changes a row's
// arithmetic.
void Plan(Work& w, const int32_t* seq, const int32_t* limit, const bool* on, int64_t r_count, int64_t g,
          int64_t hkv, int64_t kv_bytes, int64_t threads) {
  std::vector<int64_t> order;
  for (int64_t r = 0; r < r_count; ++r)
    if (on[r]) order.push_back(r);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (seq[a] != seq[b]) return seq[a] < seq[b];
    if (limit[a] != limit[b]) return limit[a] < limit[b];
    return a < b;
  });
  w.rows = order;
  w.limits.resize(order.size());
  for (size_t i = 0; i < order.size(); ++i) w.limits[i] = limit[order[i]];
  const int64_t n = static_cast<int64_t>(order.size());
  struct Run {
    int64_t begin, end, cost, per;  // per: rows per item
  };
  std::vector<Run> runs;  // one per sequence: [begin, end) into w.rows
  int64_t groups = 0;
  for (int64_t i = 0; i < n;) {
    int64_t end = i, cost = 0;
    for (; end < n && seq[order[end]] == seq[order[i]]; ++end) cost += w.limits[end] + 1;
    const int64_t per = RowsPerItem(g, w.limits[end - 1] + 1, kv_bytes);
    runs.push_back(Run{i, end, cost, per});
    groups += (end - i + per - 1) / per;
    i = end;
  }
  std::stable_sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.cost > b.cost; });
  for (const Run& run : runs) {
    const int64_t rows = std::min(run.per, run.end - run.begin);
    const int64_t heads = HeadsPerItem(hkv, rows * g, w.limits[run.end - 1] + 1, groups, threads);
    for (int64_t h = 0; h < hkv; h += heads)
      for (int64_t b = run.begin; b < run.end; b += run.per) {
        const int64_t e = std::min(run.end, b + run.per);
        w.items.push_back(Item{w.rows.data() + b, w.limits.data() + b, e - b, seq[order[b]], h, heads});
      }
  }
}

// Every marked row names a sequence, a limit inside its table and only valid blocks up to that limit.
ffi::Error CheckRows(const int32_t* seq, const int32_t* limit, const bool* on, int64_t r_count,
                     const int32_t* tables, int64_t s_count, int64_t table_len, int64_t bs, int64_t nblk) {
  std::vector<int64_t> furthest(s_count, -1);
  for (int64_t r = 0; r < r_count; ++r) {
    if (!on[r]) continue;
    if (seq[r] < 0 || seq[r] >= s_count)
      return Invalid("row " + std::to_string(r) + " names sequence " + std::to_string(seq[r]) + " of " +
                     std::to_string(s_count));
    if (limit[r] < 0 || limit[r] >= table_len * bs)
      return Invalid("row " + std::to_string(r) + " has limit " + std::to_string(limit[r]) +
                     ": a computed row needs 0 <= limit < " + std::to_string(table_len * bs));
    furthest[seq[r]] = std::max<int64_t>(furthest[seq[r]], limit[r]);
  }
  for (int64_t s = 0; s < s_count; ++s)
    for (int64_t b = 0; furthest[s] >= 0 && b <= furthest[s] / bs; ++b) {
      const int32_t block = tables[s * table_len + b];
      if (block < 0 || block >= nblk)
        return Invalid("tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " + std::to_string(block) +
                       " is not a block of the pool (" + std::to_string(nblk) + ")");
    }
  return ffi::Error::Success();
}

ffi::Error CheckShapes(ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& tables,
                       int64_t r_count, int64_t seq_n, int64_t limit_n, int64_t rows_n, ffi::ResultBuffer<ffi::F32>& out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = out->dimensions();
  if (qd.size() != 3) return Invalid("q must be [R, Hq, D]");
  if (kd.size() != 4 || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()))
    return Invalid("pool_k and pool_v must both be [NBLK, Hkv, BS, D]");
  if (k.element_type() != v.element_type() ||
      (k.element_type() != ffi::DataType::F32 && k.element_type() != ffi::DataType::BF16))
    return Invalid("the pools must both be float32 or both bfloat16");
  if (kd[3] != qd[2]) return Invalid("q has D=" + std::to_string(qd[2]) + " but the pools D=" + std::to_string(kd[3]));
  if (kd[1] < 1 || qd[1] % kd[1])
    return Invalid("Hq=" + std::to_string(qd[1]) + " is not a multiple of Hkv=" + std::to_string(kd[1]));
  if (tables.dimensions().size() != 2) return Invalid("tables must be [S, L]");
  if (seq_n != r_count || limit_n != r_count || rows_n != r_count)
    return Invalid("seq, limit and rows need one entry per row (" + std::to_string(r_count) + ")");
  if (od.size() != 2 || od[0] != r_count || od[1] != qd[1] * qd[2]) return Invalid("the result must be [R, Hq * D]");
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer pool_k, ffi::AnyBuffer pool_v,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> limit,
                          ffi::Buffer<ffi::PRED> rows, ffi::ResultBuffer<ffi::F32> out, float multiplier, int64_t isa,
                          int64_t threads, ffi::ThreadPool pool) {
  if (ffi::Error e = CheckIsa(isa); e.failure()) return e;
  const int64_t r_count = q.dimensions().size() == 3 ? q.dimensions()[0] : -1;
  if (ffi::Error e = CheckShapes(q, pool_k, pool_v, tables, r_count, seq.element_count(), limit.element_count(),
                                 rows.element_count(), out);
      e.failure())
    return e;
  const auto qd = q.dimensions(), kd = pool_k.dimensions(), td = tables.dimensions();
  const int64_t hq = qd[1], d = qd[2], nblk = kd[0], hkv = kd[1], bs = kd[2];
  const bool* on = rows.typed_data();
  if (ffi::Error e = CheckRows(seq.typed_data(), limit.typed_data(), on, r_count, tables.typed_data(), td[0], td[1],
                               bs, nblk);
      e.failure())
    return e;
  float* o = out->typed_data();
  for (int64_t r = 0; r < r_count; ++r)
    if (!on[r]) std::fill(o + r * hq * d, o + (r + 1) * hq * d, 0.0f);
  auto work = std::make_shared<Work>();
  work->call = Call{q.typed_data(), pool_k.untyped_data(), pool_v.untyped_data(),
                    pool_k.element_type() == ffi::DataType::BF16, tables.typed_data(), o, hq, hkv, d, bs, td[1],
                    multiplier};
  work->fn = ItemFor(Resolve(isa));
  const int64_t workers = threads > 0 ? threads : std::max<int64_t>(1, pool.num_threads());
  const int64_t kv_bytes = 2 * d * (pool_k.element_type() == ffi::DataType::BF16 ? 2 : 4);  // a key and a value
  Plan(*work, seq.typed_data(), limit.typed_data(), on, r_count, hq / hkv, hkv, kv_bytes, workers);
  if (!work->items.empty()) Execute(work, workers, pool);
  return ffi::Error::Success();
}

ffi::Error Math(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t fn, int64_t isa) {
  if (ffi::Error e = CheckIsa(isa); e.failure()) return e;
  if (fn != 0 && fn != 1) return ffi::Error::InvalidArgument("grok_attention_math: fn is 0 (exp) or 1 (cap)");
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(y->element_count()) != n)
    return ffi::Error::InvalidArgument("grok_attention_math: the result needs the input's size");
  using Fn = void (*)(const float*, float*, int64_t);
  static const Fn kFns[2][4] = {{nullptr, ExpScalar, ExpAvx2, ExpAvx512}, {nullptr, CapScalar, CapAvx2, CapAvx512}};
  kFns[fn][Resolve(isa)](x.typed_data(), y->typed_data(), n);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace attn
}  // namespace grok

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokPagedAttention, grok::attn::PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("multiplier")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokAttentionMath, grok::attn::Math,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("fn")
                                  .Attr<int64_t>("isa"));
