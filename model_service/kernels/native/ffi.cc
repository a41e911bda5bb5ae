// XLA FFI handlers for the packed products and the Python module that hands them to jax.ffi.
//
// grok_int8_matmul(x f32 [M, K], w s8 [NB, K, 16], scales f32 [B, NB*16], rows pred [M]) -> f32 [M, N]
//   (attribute activations: 0 float32, 1 int8: the rows rounded to int8 first, an opt-in; see matmul.h)
// grok_f32_matmul (x f32 [M, K], w f32 [NB, K, 16], rows pred [M])                      -> f32 [M, N]
// grok_grouped_int8_matmul(x f32 [M, K], which s32 [M], rows pred [M], w_0..w_{W-1} s8 [NB, K, 16] or stacks
//   [E_i, NB, K, 16], scales_0..scales_{W-1} f32 [B, NB*16] or [E_i, B, NB*16]) -> f32 [M, N]: row r times weight
//   which[r], the matrices numbered through the buffers in order (attributes as above)
// grok_bf16_matmul(x f32 [M, K], w bf16 [NB, K, 16], rows pred [M])                     -> f32 [M, N]
// grok_bf16_in_13_matmul(x f32 [M, K], w u8 [NB, K/4, 104], dictionary u8 [32], rows pred [M]) -> f32 [M, N]
//   (bfloat16 held in 13 bits a value, see matmul.h; the same bits as grok_bf16_matmul of the same values)
// Attributes: isa (0 best available, 1 scalar, 2 AVX2, 3 AVX-512), threads (0: XLA's intra-op pool size),
// form (0: by the number of marked rows, 1 rows, 2 panel; see matmul.h), fill (not on the grouped target: 1 the
// rows not marked come out zero, 0 they are left as they are). The forms and the instruction sets
// give the same bits, so the choice is only about speed. The plain targets (f32, bf16) also take `multiplier`
// (float32): each computed element is multiplied by it once, after its sum, as a float32 multiply after the
// product would (the unembedding's output multiplier, applied to the computed rows only).
// Only the rows whose `rows` entry is true are computed (the others are zero, or with fill=0 left as they are:
// the head's free slots, whose [V] rows nobody reads): a decode step's free slots and the rows that did not pick
// an expert cost nothing. Work is split over column blocks only, so each
// output element is computed by one thread in one fixed order whatever the thread count or the other rows.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace grok {
namespace {

enum Isa : int64_t { kBest = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

bool Supported(int64_t isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    default: return false;
  }
}

int64_t Best() { return Supported(kAvx512) ? kAvx512 : Supported(kAvx2) ? kAvx2 : kScalar; }

// The int8-activation product's AVX-512 path needs VNNI (and VBMI's byte permute) beyond avx512f; where they are
// missing the AVX2 path computes it (the same bits).
bool QuantUsesAvx512(int64_t isa) {  // AVX-512 asked for, and the CPU has what this path needs
  return isa == kAvx512 && Supported(kAvx512) && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni");
}

enum Form : int64_t { kAuto = 0, kRows = 1, kPanel = 2 };

// Where `form` is 0, float32 weights take the panel form from this many marked rows on; int8 and bfloat16
// weights always the rows form. Measured on a 2-core AMD EPYC (Zen 4, AVX-512), benchmarks/kernels.py --grok: the
// rows form keeps 4 column blocks of the weight in L2 while every group of 4 rows passes over it, and this CPU
// converts int8 and bfloat16 beside its FMAs at no cost, so it runs at 82-91 GFLOP/s per core (about the float32
// FMA peak) from 4 rows on; only float32 blocks (1.5 MB per 4 blocks at K = 6,144) outgrow L2 and are read again
// from memory per 4 rows, where reading them once for every row (the panel form) wins.
constexpr int64_t kPanelMinRows = 8;
// On AVX2 the rows form takes 6 rows a tile (matmul_body.h): measured on a 2-core AMD EPYC (Zen 3, AVX2), both
// cores, alternating call by call, int8 K 6,144 x N 8,192: rows 142-160 vs panel 128-154 GFLOP/s at 32 and 64
// rows, 191 vs 176 at 128, 161 vs 155 at 256; the medium shapes (K 512 / 2,736) within 0.91-1.02x of each other
// from 32 to 128 rows. (With 4-row tiles the panel form won from 48 rows.)

// The form `auto` takes for `rows` marked rows of a weight of `type` on instruction set `isa`.
bool AutoPanel(int64_t isa, Weight type, int64_t rows) {
  if (isa == kScalar) return false;
  return type == Weight::kF32 && rows >= kPanelMinRows;
}

using Kernel = void (*)(const MatmulArgs&, int64_t, int64_t, float*);

template <void (*F)(const MatmulArgs&, int64_t, int64_t)>
void NoScratch(const MatmulArgs& a, int64_t begin, int64_t end, float*) { F(a, begin, end); }

// The scalar path has one form: it is the reference the vector paths are held to.
Kernel KernelFor(int64_t isa, bool panel) {
  switch (isa) {
    case kAvx512: return panel ? PanelAvx512 : NoScratch<MatmulAvx512>;
    case kAvx2: return panel ? PanelAvx2 : NoScratch<MatmulAvx2>;
    default: return NoScratch<MatmulScalar>;
  }
}


// The int8-activation path: rows rounded and multiplied by the same instruction set.
using QuantizeFn = void (*)(const float*, const int64_t*, int64_t, int64_t, int64_t, int8_t*, float*, int32_t*);
QuantizeFn QuantizeFor(int64_t isa) {
  return QuantUsesAvx512(isa) ? QuantizeRowsAvx512 : QuantizeRows;
}

Kernel QuantKernelFor(int64_t isa) {
  if (QuantUsesAvx512(isa)) return NoScratch<QuantAvx512>;
  if (isa >= kAvx2 && Supported(kAvx2)) return NoScratch<QuantAvx2>;
  return NoScratch<QuantScalar>;
}

constexpr int64_t kChunkBlocks = 2 * kGroup;  // column blocks per unit of work handed to a thread

// One product of a call: its arguments and kernel (a grouped call has one per weight).
struct Part {
  MatmulArgs args;
  Kernel kernel;
  float multiplier = 1.0f;  // each computed element times this, once, after the kernel wrote it
};

// Columns [block_begin, block_end) of the computed rows times `multiplier`, while the kernel's output for them
// is still in cache: one float32 multiply per element, as `out * multiplier` after the product would do.
void Multiply(const MatmulArgs& a, int64_t block_begin, int64_t block_end, float multiplier) {
  const int64_t begin = block_begin * kLanes, end = std::min(block_end * kLanes, a.n_out);
  for (int64_t i = 0; i < a.m; ++i) {
    float* row = a.out + a.rows[i] * a.n_out;
    for (int64_t c = begin; c < end; ++c) row[c] *= multiplier;
  }
}

// Shared by the caller and the pool tasks; a task that starts after all chunks are claimed returns at once,
// so the caller only ever waits for chunks some running thread is computing. A chunk is kChunkBlocks column
// blocks of one part; the parts' chunks are numbered one after another.
struct Work {
  std::vector<Part> parts;
  std::vector<int64_t> first;  // [parts] the number of the first chunk of each part
  int64_t scratch = 0;  // floats of per-thread scratch the kernels need (0: none)
  int64_t chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Add(const MatmulArgs& args, Kernel kernel, float multiplier = 1.0f) {
    parts.push_back({args, kernel, multiplier});
    first.push_back(chunks);
    chunks += (args.nb + kChunkBlocks - 1) / kChunkBlocks;
  }

  void Drain() {
    int64_t c = next.fetch_add(1);
    if (c >= chunks) return;
    std::vector<float> buffer(static_cast<size_t>(scratch));
    size_t p = 0;
    for (; c < chunks; c = next.fetch_add(1)) {
      while (p + 1 < parts.size() && first[p + 1] <= c) ++p;  // chunks are claimed in increasing order
      const Part& part = parts[p];
      const int64_t begin = (c - first[p]) * kChunkBlocks;
      const int64_t end = std::min(begin + kChunkBlocks, part.args.nb);
      part.kernel(part.args, begin, end, buffer.data());
      if (part.multiplier != 1.0f) Multiply(part.args, begin, end, part.multiplier);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void Execute(std::shared_ptr<Work> work, int64_t threads, ffi::ThreadPool& pool) {
  if (work->chunks == 0) return;
  const int64_t available = std::max<int64_t>(1, pool.num_threads());
  const int64_t want = std::min(threads > 0 ? threads : available, work->chunks);
  for (int64_t t = 1; t < want; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
}

void Execute(const MatmulArgs& args, Kernel kernel, int64_t scratch, int64_t threads, ffi::ThreadPool& pool,
             float multiplier = 1.0f) {
  auto work = std::make_shared<Work>();
  work->Add(args, kernel, multiplier);
  work->scratch = scratch;
  Execute(work, threads, pool);
}

ffi::Error Check(int64_t isa, int64_t form, int64_t m, int64_t k, int64_t wk, int64_t n_out, int64_t nb, int64_t blocks) {
  if (isa < kBest || isa > kAvx512 || (isa != kBest && !Supported(isa)))
    return ffi::Error::InvalidArgument("grok matmul: instruction set " + std::to_string(isa) +
                                       " is not available on this CPU");
  if (form < kAuto || form > kPanel)
    return ffi::Error::InvalidArgument("grok matmul: unknown form " + std::to_string(form));
  if (k != wk) return ffi::Error::InvalidArgument("grok matmul: x has K=" + std::to_string(k) +
                                                  " but the weight has K=" + std::to_string(wk));
  if (n_out > nb * kLanes || m < 0)
    return ffi::Error::InvalidArgument("grok matmul: output has more columns than the packed weight");
  if (blocks < 1 || k % blocks)
    return ffi::Error::InvalidArgument("grok matmul: K=" + std::to_string(k) + " is not a multiple of the " +
                                       std::to_string(blocks) + " scale blocks");
  return ffi::Error::Success();
}

struct Options {
  int64_t isa, threads, form;
  int64_t activations = 0;  // 1: int8 (int8 weights only)
  int64_t fill = 1;         // 0: rows not computed are left as they are (the caller never reads them)
  float multiplier = 1.0f;  // each computed element times this after its sum (the plain targets)
  const uint8_t* dictionary = nullptr;  // a kBf16In13 weight's high bytes
};

ffi::Error Run(ffi::Buffer<ffi::F32> x, const void* w, int64_t nb, int64_t wk, const float* scales,
               int64_t blocks, Weight type, ffi::Buffer<ffi::PRED> rows, ffi::ResultBuffer<ffi::F32> out,
               Options o, ffi::ThreadPool& pool) {
  const auto xd = x.dimensions();
  const int64_t m = xd[0], k = xd[1], n_out = out->dimensions()[1];
  if (ffi::Error e = Check(o.isa, o.form, m, k, wk, n_out, nb, blocks); e.failure()) return e;
  if (rows.element_count() != m)
    return ffi::Error::InvalidArgument("grok matmul: the row mask has " + std::to_string(rows.element_count()) +
                                       " entries for " + std::to_string(m) + " rows");
  if (m == 0 || n_out == 0) return ffi::Error::Success();
  std::vector<int64_t> ids;
  ids.reserve(m);
  const bool* on = rows.typed_data();
  for (int64_t r = 0; r < m; ++r) {
    if (on[r]) {
      ids.push_back(r);
    } else if (o.fill) {
      std::fill(out->typed_data() + r * n_out, out->typed_data() + (r + 1) * n_out, 0.0f);
    }
  }
  if (ids.empty()) return ffi::Error::Success();
  const int64_t count = static_cast<int64_t>(ids.size());
  MatmulArgs args{x.typed_data(), w, scales, out->typed_data(), ids.data(), count, k, nb, n_out, blocks, type};
  args.dictionary = o.dictionary;
  const int64_t isa = o.isa == kBest ? Best() : o.isa;
  if (o.activations == 1) {
    const int64_t kb = k / blocks, per_block = (kb + kQuantBlock - 1) / kQuantBlock, subs = blocks * per_block;
    std::vector<int8_t> q(static_cast<size_t>(m * subs * kQuantBlock));
    std::vector<float> d(static_cast<size_t>(m * subs));
    std::vector<int32_t> c(static_cast<size_t>(m * subs));
    QuantizeFor(isa)(x.typed_data(), ids.data(), count, k, blocks, q.data(), d.data(), c.data());
    const QuantRows quant{q.data(), d.data(), c.data(), subs, per_block};
    args.quant = &quant;
    Execute(args, QuantKernelFor(isa), 0, o.threads, pool);
    return ffi::Error::Success();
  }
  const bool panel = isa != kScalar && type != Weight::kBf16In13 &&
                     (o.form == kPanel || (o.form == kAuto && AutoPanel(isa, type, count)));
  Execute(args, KernelFor(isa, panel), panel ? PanelScratch(count) : 0, o.threads, pool, o.multiplier);
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scales,
                      ffi::Buffer<ffi::PRED> rows, ffi::ResultBuffer<ffi::F32> out, int64_t isa, int64_t threads,
                      int64_t form, int64_t activations, int64_t fill, ffi::ThreadPool pool) {
  if (activations != 0 && activations != 1)
    return ffi::Error::InvalidArgument("grok_int8_matmul: activations is 0 (float32) or 1 (int8), got " +
                                       std::to_string(activations));
  const auto wd = w.dimensions(), sd = scales.dimensions();
  if (wd.size() != 3 || wd[2] != kLanes || sd.size() != 2 || sd[1] != wd[0] * kLanes)
    return ffi::Error::InvalidArgument("grok_int8_matmul: want w [NB, K, 16] and scales [B, NB*16]");
  return Run(x, w.typed_data(), wd[0], wd[1], scales.typed_data(), sd[0], Weight::kInt8, rows, out,
             {isa, threads, form, activations, fill}, pool);
}

// The unscaled weights (the router, the embedding table) in float32 or bfloat16.
template <ffi::DataType T>
ffi::Error PlainMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w, ffi::Buffer<ffi::PRED> rows,
                       ffi::ResultBuffer<ffi::F32> out, int64_t isa, int64_t threads, int64_t form, int64_t fill,
                       float multiplier, ffi::ThreadPool pool) {
  const auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != kLanes)
    return ffi::Error::InvalidArgument("grok matmul: want a plain weight [NB, K, 16]");
  const Weight type = T == ffi::DataType::BF16 ? Weight::kBf16 : Weight::kF32;
  return Run(x, w.untyped_data(), wd[0], wd[1], nullptr, 1, type, rows, out,
             {isa, threads, form, 0, fill, multiplier}, pool);
}

// The embedding table in bfloat16 held in 13 bits a value (matmul.h): w [NB, K / 4, 104], its dictionary of 32 high
// bytes. The rows form only (a `form` of panel computes it in the rows form: the same bits).
ffi::Error Bf16In13Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::U8> dictionary,
                          ffi::Buffer<ffi::PRED> rows, ffi::ResultBuffer<ffi::F32> out, int64_t isa, int64_t threads,
                          int64_t form, int64_t fill, float multiplier, ffi::ThreadPool pool) {
  const auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != kGroup13Bytes || dictionary.element_count() != kDictionary13)
    return ffi::Error::InvalidArgument("grok_bf16_in_13_matmul: want w [NB, K / 4, 104] and a dictionary of 32 bytes");
  return Run(x, w.untyped_data(), wd[0], 4 * wd[1], nullptr, 1, Weight::kBf16In13, rows, out,
             {isa, threads, form, 0, fill, multiplier, dictionary.typed_data()}, pool);
}

// Row r of x times weight which[r] of the E given (an MoE layer's experts: each row is a (token, expert) pair),
// in one call: the used weights' column blocks are shared out among the threads together, so one row meeting
// two experts keeps both cores reading. Each row's bits are those of grok_int8_matmul with that weight.
// A buffer holds one matrix or a stack of them (a layer's experts in one buffer: a call with fewer buffers
// costs its program less to launch); matrix e of a stack starts e matrices into it.
ffi::Error GroupedInt8Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> which, ffi::Buffer<ffi::PRED> rows,
                             ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::F32> out, int64_t isa,
                             int64_t threads, int64_t form, int64_t activations, ffi::ThreadPool pool) {
  if (activations != 0 && activations != 1)
    return ffi::Error::InvalidArgument("grok_grouped_int8_matmul: activations is 0 (float32) or 1 (int8), got " +
                                       std::to_string(activations));
  if (weights.size() < 2 || weights.size() % 2)
    return ffi::Error::InvalidArgument("grok_grouped_int8_matmul: want W weight buffers then their W scales");
  const int64_t buffers = static_cast<int64_t>(weights.size() / 2);
  const auto xd = x.dimensions();
  const int64_t m = xd[0], k = xd[1], n_out = out->dimensions()[1];
  if (which.element_count() != m || rows.element_count() != m)
    return ffi::Error::InvalidArgument("grok_grouped_int8_matmul: want one weight index and one row flag per row");
  std::vector<const int8_t*> ws;
  std::vector<const float*> ss;
  int64_t nb = 0, wk = 0, blocks = 0;
  for (int64_t i = 0; i < buffers; ++i) {
    auto w = weights.get<ffi::Buffer<ffi::S8>>(i);
    auto sc = weights.get<ffi::Buffer<ffi::F32>>(buffers + i);
    if (!w || !sc) return ffi::Error::InvalidArgument("grok_grouped_int8_matmul: weights are int8, scales float32");
    const auto wd = w->dimensions(), sd = sc->dimensions();
    const bool stack = wd.size() == 4;  // [E_i, NB, K, 16] with scales [E_i, B, NB*16]
    const size_t lead = stack ? 1 : 0;
    if (wd.size() != 3 + lead || sd.size() != 2 + lead || wd[lead + 2] != kLanes ||
        sd[lead + 1] != wd[lead] * kLanes || (stack && sd[0] != wd[0]))
      return ffi::Error::InvalidArgument("grok_grouped_int8_matmul: want each w [NB, K, 16] with scales [B, NB*16], "
                                         "or a stack w [E, NB, K, 16] with scales [E, B, NB*16]");
    if (i == 0) {
      nb = wd[lead], wk = wd[lead + 1], blocks = sd[lead];
    } else if (wd[lead] != nb || wd[lead + 1] != wk || sd[lead] != blocks) {
      return ffi::Error::InvalidArgument("grok_grouped_int8_matmul: the weights differ in shape");
    }
    const int64_t count = stack ? wd[0] : 1;
    for (int64_t e = 0; e < count; ++e) {
      ws.push_back(w->typed_data() + e * nb * wk * kLanes);
      ss.push_back(sc->typed_data() + e * blocks * nb * kLanes);
    }
  }
  const int64_t experts = static_cast<int64_t>(ws.size());
  if (ffi::Error e = Check(isa, form, m, k, wk, n_out, nb, blocks); e.failure()) return e;
  std::vector<std::vector<int64_t>> ids(experts);
  std::vector<int64_t> all;
  const bool* on = rows.typed_data();
  const int32_t* pick = which.typed_data();
  float* o = out->typed_data();
  for (int64_t r = 0; r < m; ++r) {
    if (!on[r]) {
      std::fill(o + r * n_out, o + (r + 1) * n_out, 0.0f);
    } else if (pick[r] < 0 || pick[r] >= experts) {
      return ffi::Error::InvalidArgument("grok_grouped_int8_matmul: row " + std::to_string(r) + " names weight " +
                                         std::to_string(pick[r]) + " of " + std::to_string(experts));
    } else {
      ids[pick[r]].push_back(r);
      all.push_back(r);
    }
  }
  if (all.empty() || n_out == 0) return ffi::Error::Success();
  const int64_t best = isa == kBest ? Best() : isa;
  const int64_t kb = k / blocks, per_block = (kb + kQuantBlock - 1) / kQuantBlock, subs = blocks * per_block;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> c;
  QuantRows quant{};
  if (activations == 1) {
    q.resize(static_cast<size_t>(m * subs * kQuantBlock));
    d.resize(static_cast<size_t>(m * subs));
    c.resize(static_cast<size_t>(m * subs));
    QuantizeFor(best)(x.typed_data(), all.data(), static_cast<int64_t>(all.size()), k, blocks, q.data(), d.data(),
                      c.data());
    quant = {q.data(), d.data(), c.data(), subs, per_block};
  }
  auto work = std::make_shared<Work>();
  for (int64_t e = 0; e < experts; ++e) {
    if (ids[e].empty()) continue;
    const int64_t count = static_cast<int64_t>(ids[e].size());
    MatmulArgs args{x.typed_data(), ws[e], ss[e], o, ids[e].data(), count, k, nb, n_out, blocks, Weight::kInt8};
    if (activations == 1) {
      args.quant = &quant;
      work->Add(args, QuantKernelFor(best));
    } else {
      const bool panel = best != kScalar &&
                         (form == kPanel || (form == kAuto && AutoPanel(best, Weight::kInt8, count)));
      work->Add(args, KernelFor(best, panel));
      if (panel) work->scratch = std::max(work->scratch, PanelScratch(count));
    }
  }
  Execute(work, threads, pool);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace grok

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokInt8Matmul, grok::Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("form")
                                  .Attr<int64_t>("activations")
                                  .Attr<int64_t>("fill")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokGroupedInt8Matmul, grok::GroupedInt8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("form")
                                  .Attr<int64_t>("activations")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokF32Matmul, grok::PlainMatmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("form")
                                  .Attr<int64_t>("fill")
                                  .Attr<float>("multiplier")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokBf16Matmul, grok::PlainMatmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("form")
                                  .Attr<int64_t>("fill")
                                  .Attr<float>("multiplier")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrokBf16In13Matmul, grok::Bf16In13Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("form")
                                  .Attr<int64_t>("fill")
                                  .Attr<float>("multiplier")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DECLARE_HANDLER_SYMBOL(GrokNucleusThreshold);  // nucleus.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(GrokValuesAbove);       // nucleus.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(GrokPagedAttention);    // attention.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(GrokAttentionMath);     // attention.cc

namespace {

PyObject* Handlers(PyObject*, PyObject*) {
  return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "grok_int8_matmul",
                       PyCapsule_New(reinterpret_cast<void*>(GrokInt8Matmul), nullptr, nullptr),
                       "grok_grouped_int8_matmul",
                       PyCapsule_New(reinterpret_cast<void*>(GrokGroupedInt8Matmul), nullptr, nullptr),
                       "grok_f32_matmul", PyCapsule_New(reinterpret_cast<void*>(GrokF32Matmul), nullptr, nullptr),
                       "grok_bf16_matmul", PyCapsule_New(reinterpret_cast<void*>(GrokBf16Matmul), nullptr, nullptr),
                       "grok_bf16_in_13_matmul",
                       PyCapsule_New(reinterpret_cast<void*>(GrokBf16In13Matmul), nullptr, nullptr),
                       "grok_nucleus_threshold",
                       PyCapsule_New(reinterpret_cast<void*>(GrokNucleusThreshold), nullptr, nullptr),
                       "grok_values_above", PyCapsule_New(reinterpret_cast<void*>(GrokValuesAbove), nullptr, nullptr),
                       "grok_paged_attention", PyCapsule_New(reinterpret_cast<void*>(GrokPagedAttention), nullptr, nullptr),
                       "grok_attention_math", PyCapsule_New(reinterpret_cast<void*>(GrokAttentionMath), nullptr, nullptr));
}

PyObject* SupportedIsas(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  const char* names[] = {"", "scalar", "avx2", "avx512"};
  for (int64_t isa = grok::kScalar; isa <= grok::kAvx512; ++isa)
    if (grok::Supported(isa)) {
      PyObject* name = PyUnicode_FromString(names[isa]);
      PyList_Append(out, name);
      Py_DECREF(name);
    }
  return out;
}

PyObject* Int8Accelerated(PyObject*, PyObject*) {
  return PyBool_FromLong(grok::QuantUsesAvx512(grok::kAvx512));
}

PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "FFI handler capsules by target name."},
    {"supported_isas", SupportedIsas, METH_NOARGS, "Instruction-set paths this CPU can run, slowest first."},
    {"int8_accelerated", Int8Accelerated, METH_NOARGS,
     "Whether int8 rows take the AVX-512 VNNI path on this CPU (elsewhere they are no faster than float32)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", "grok-serve CPU kernels (XLA FFI).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native() { return PyModule_Create(&kModule); }
