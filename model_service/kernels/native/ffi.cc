// XLA FFI handlers for the packed products and the Python module that hands them to jax.ffi.
//
// grok_int8_matmul(x f32 [M, K], w s8 [NB, K, 16], scales f32 [B, NB*16], rows pred [M]) -> f32 [M, N]
//   (attribute activations: 0 float32, 1 int8: the rows rounded to int8 first, an opt-in; see matmul.h)
// grok_f32_matmul (x f32 [M, K], w f32 [NB, K, 16], rows pred [M])                      -> f32 [M, N]
// grok_bf16_matmul(x f32 [M, K], w bf16 [NB, K, 16], rows pred [M])                     -> f32 [M, N]
// Attributes: isa (0 best available, 1 scalar, 2 AVX2, 3 AVX-512), threads (0: XLA's intra-op pool size),
// form (0: by the number of marked rows, 1 rows, 2 panel; see matmul.h). The forms and the instruction sets
// give the same bits, so the choice is only about speed.
// Only the rows whose `rows` entry is true are computed (the others are zero): a decode step's free slots
// and the rows that did not pick an expert cost nothing. Work is split over column blocks only, so each
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
    case kAvx512: return __builtin_cpu_supports("avx512f");
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

// Where `form` is 0, float32 weights take the panel form from this many marked rows on, everything else the
// rows form. Measured on a 2-core AMD EPYC (Zen 4, AVX-512), benchmarks/kernels.py --grok: the rows form
// keeps 4 column blocks of the weight in L2 while every group of 4 rows passes over it, and this CPU
// converts int8 and bfloat16 beside its FMAs at no cost, so it runs at 82-91 GFLOP/s per core (about the
// float32 FMA peak) from 4 rows on; only float32 blocks (1.5 MB per 4 blocks at K = 6,144) outgrow L2 and
// are read again from memory per 4 rows, where reading them once for every row (the panel form) wins.
constexpr int64_t kPanelMinRows = 8;

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
  if (QuantUsesAvx512(isa)) return QuantAvx512;
  if (isa >= kAvx2 && Supported(kAvx2)) return NoScratch<QuantAvx2>;
  return NoScratch<QuantScalar>;
}

constexpr int64_t kChunkBlocks = 2 * kGroup;  // column blocks per unit of work handed to a thread

// Shared by the caller and the pool tasks; a task that starts after all chunks are claimed returns at once,
// so the caller only ever waits for chunks some running thread is computing.
struct Work {
  MatmulArgs args;
  Kernel kernel;
  int64_t scratch;  // floats of per-thread scratch the kernel needs (0: none)
  int64_t chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    int64_t c = next.fetch_add(1);
    if (c >= chunks) return;
    std::vector<float> buffer(static_cast<size_t>(scratch));
    for (; c < chunks; c = next.fetch_add(1)) {
      const int64_t begin = c * kChunkBlocks;
      kernel(args, begin, std::min(begin + kChunkBlocks, args.nb), buffer.data());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void Execute(const MatmulArgs& args, Kernel kernel, int64_t scratch, int64_t threads, ffi::ThreadPool& pool) {
  auto work = std::make_shared<Work>();
  work->args = args;
  work->kernel = kernel;
  work->scratch = scratch;
  work->chunks = (args.nb + kChunkBlocks - 1) / kChunkBlocks;
  const int64_t available = std::max<int64_t>(1, pool.num_threads());
  const int64_t want = std::min(threads > 0 ? threads : available, work->chunks);
  for (int64_t t = 1; t < want; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
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
    } else {
      std::fill(out->typed_data() + r * n_out, out->typed_data() + (r + 1) * n_out, 0.0f);
    }
  }
  if (ids.empty()) return ffi::Error::Success();
  const int64_t count = static_cast<int64_t>(ids.size());
  MatmulArgs args{x.typed_data(), w, scales, out->typed_data(), ids.data(), count, k, nb, n_out, blocks, type};
  const int64_t isa = o.isa == kBest ? Best() : o.isa;
  if (o.activations == 1) {
    const int64_t kb = k / blocks, per_block = (kb + kQuantBlock - 1) / kQuantBlock, subs = blocks * per_block;
    std::vector<int8_t> q(static_cast<size_t>(m * subs * kQuantBlock));
    std::vector<float> d(static_cast<size_t>(m * subs));
    std::vector<int32_t> c(static_cast<size_t>(m * subs));
    QuantizeFor(isa)(x.typed_data(), ids.data(), count, k, blocks, q.data(), d.data(), c.data());
    const QuantRows quant{q.data(), d.data(), c.data(), subs, per_block};
    args.quant = &quant;
    Execute(args, QuantKernelFor(isa), QuantScratch(k, blocks), o.threads, pool);
    return ffi::Error::Success();
  }
  const bool panel = isa != kScalar && (o.form == kPanel ||
                                        (o.form == kAuto && type == Weight::kF32 && count >= kPanelMinRows));
  Execute(args, KernelFor(isa, panel), panel ? PanelScratch(count) : 0, o.threads, pool);
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scales,
                      ffi::Buffer<ffi::PRED> rows, ffi::ResultBuffer<ffi::F32> out, int64_t isa, int64_t threads,
                      int64_t form, int64_t activations, ffi::ThreadPool pool) {
  if (activations != 0 && activations != 1)
    return ffi::Error::InvalidArgument("grok_int8_matmul: activations is 0 (float32) or 1 (int8), got " +
                                       std::to_string(activations));
  const auto wd = w.dimensions(), sd = scales.dimensions();
  if (wd.size() != 3 || wd[2] != kLanes || sd.size() != 2 || sd[1] != wd[0] * kLanes)
    return ffi::Error::InvalidArgument("grok_int8_matmul: want w [NB, K, 16] and scales [B, NB*16]");
  return Run(x, w.typed_data(), wd[0], wd[1], scales.typed_data(), sd[0], Weight::kInt8, rows, out,
             {isa, threads, form, activations}, pool);
}

// The unscaled weights (the router, the embedding table) in float32 or bfloat16.
template <ffi::DataType T>
ffi::Error PlainMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w, ffi::Buffer<ffi::PRED> rows,
                       ffi::ResultBuffer<ffi::F32> out, int64_t isa, int64_t threads, int64_t form,
                       ffi::ThreadPool pool) {
  const auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != kLanes)
    return ffi::Error::InvalidArgument("grok matmul: want a plain weight [NB, K, 16]");
  const Weight type = T == ffi::DataType::BF16 ? Weight::kBf16 : Weight::kF32;
  return Run(x, w.untyped_data(), wd[0], wd[1], nullptr, 1, type, rows, out, {isa, threads, form}, pool);
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
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DECLARE_HANDLER_SYMBOL(GrokNucleusThreshold);  // nucleus.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(GrokPagedAttention);    // attention.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(GrokAttentionMath);     // attention.cc

namespace {

PyObject* Handlers(PyObject*, PyObject*) {
  return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N}", "grok_int8_matmul",
                       PyCapsule_New(reinterpret_cast<void*>(GrokInt8Matmul), nullptr, nullptr),
                       "grok_f32_matmul", PyCapsule_New(reinterpret_cast<void*>(GrokF32Matmul), nullptr, nullptr),
                       "grok_bf16_matmul", PyCapsule_New(reinterpret_cast<void*>(GrokBf16Matmul), nullptr, nullptr),
                       "grok_nucleus_threshold",
                       PyCapsule_New(reinterpret_cast<void*>(GrokNucleusThreshold), nullptr, nullptr),
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
