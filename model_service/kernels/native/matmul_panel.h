// The panel form of the vector kernel (many rows meet a matrix), written once over the vector interface `V`
// of matmul_body.h plus two tile sizes: V::kPanelRows rows x V::kPanelGroup column blocks of accumulators.
//
// Where the rows form converts every weight element once per 4 rows, here a panel of G column blocks x
// kPanelSlice values of K is converted to float32 once into a buffer that stays in L1/L2, and every row runs its
// chains over it, R rows at a time (R x G independent chains hide the FMA latency; each panel load feeds R
// FMAs). The chains are interrupted between slices: the accumulators are stored to a per-thread buffer and
// reloaded, which is exact, so each output element still sees exactly the rows form's operations:
// acc = fma(x[k], w[k], acc) from zero for k in order within a scale block, then acc * scale, then
// out + that over blocks in order. float32 weights need no conversion: the tiles read them in place.
#ifndef GROK_KERNELS_MATMUL_PANEL_H_
#define GROK_KERNELS_MATMUL_PANEL_H_

// No standard-library templates here (nor std::min): an inline function instantiated in a file compiled for
// AVX-512 could be the copy the linker keeps for every file, and run on a CPU without AVX-512.
#include "matmul.h"

namespace grok {
namespace panel {

static inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }  // internal to each file

// R rows x G blocks over one slice: k0 is the slice's first k, w[g] its first value of block g (16 values
// per k), acc the R rows' accumulators ([R][stride] floats, G * 16 used per row). With `next` (the stored
// weights of the next slice, block g's at next[g], `step` bytes per k), the tile asks for them meanwhile:
// converting a panel does no arithmetic, so without this the panels would wait for memory between bursts
// of arithmetic instead of reading it while computing.
template <class V, int R, int G>
inline void Tile(const float* const* x, int64_t k0, int64_t len, const float* const* w, float* acc,
                 int64_t stride, bool fresh, const char* const* next = nullptr, int64_t step = 0) {
  using Reg = typename V::Reg;
  constexpr int P = V::kPerBlock;
  Reg c[R][G][P];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < P; ++h)
        c[r][g][h] = fresh ? V::Zero() : V::Load(acc + r * stride + g * kLanes + h * V::kWidth);
  for (int64_t k = 0; k < len; ++k) {
    if (next != nullptr && (k * step) % 64 == 0)
      for (int g = 0; g < G; ++g) V::Prefetch(next[g] + k * step);
    Reg wr[G][P];
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < P; ++h) wr[g][h] = V::Load(w[g] + k * kLanes + h * V::kWidth);
    for (int r = 0; r < R; ++r) {
      const Reg xr = V::Broadcast(x[r][k0 + k]);
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < P; ++h) c[r][g][h] = V::Fma(xr, wr[g][h], c[r][g][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < P; ++h) V::StoreFull(acc + r * stride + g * kLanes + h * V::kWidth, c[r][g][h]);
}

// Tile<V, N, G> for the n (< R) rows left over after the full tiles, chosen at run time.
template <class V, int G, int N>
inline void Rest(int64_t n, const float* const* x, int64_t k0, int64_t len, const float* const* w, float* acc,
                 int64_t stride, bool fresh) {
  if constexpr (N >= 1) {
    if (n == N) {
      Tile<V, N, G>(x, k0, len, w, acc, stride, fresh);
    } else {
      Rest<V, G, N - 1>(n, x, k0, len, w, acc, stride, fresh);
    }
  }
}

// Every listed row over one slice, R rows at a time and the remainder in one smaller tile; the first tile
// prefetches the next slice's stored weights (`next`, `step` bytes per k) when they need converting.
template <class V, int G>
void Slice(const MatmulArgs& a, int64_t k0, int64_t len, const float* const* w, float* acc, bool fresh,
           const char* const* next, int64_t step) {
  constexpr int R = V::kPanelRows;
  constexpr int64_t stride = V::kPanelGroup * kLanes;
  const float* x[R];
  for (int64_t i = 0; i < a.m; i += R) {
    const int64_t n = Min(R, a.m - i);
    for (int64_t r = 0; r < n; ++r) x[r] = a.x + a.rows[i + r] * a.k;
    if (n == R) {
      Tile<V, R, G>(x, k0, len, w, acc + i * stride, stride, fresh, i == 0 ? next : nullptr, step);
    } else {
      Rest<V, G, R - 1>(n, x, k0, len, w, acc + i * stride, stride, fresh);
    }
  }
}

// The weight values of blocks [block, block + g) over k0 .. k0 + len as float32 panels (one per block, 16
// values per k): float32 weights in place, the others converted into `panel`.
template <class V>
void Convert(const MatmulArgs& a, int64_t block, int g, int64_t k0, int64_t len, float* panel, const float** w) {
  for (int j = 0; j < g; ++j) {
    const int64_t start = ((block + j) * a.k + k0) * kLanes;
    if (a.type == Weight::kF32) {
      w[j] = static_cast<const float*>(a.w) + start;
      continue;
    }
    float* dst = panel + j * len * kLanes;
    if (a.type == Weight::kInt8) {
      const int8_t* src = static_cast<const int8_t*>(a.w) + start;
      for (int64_t i = 0; i < len * kLanes; i += V::kWidth) V::StoreFull(dst + i, V::FromInt8(src + i));
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(a.w) + start;
      for (int64_t i = 0; i < len * kLanes; i += V::kWidth) V::StoreFull(dst + i, V::FromBf16(src + i));
    }
    w[j] = dst;
  }
}

template <class V, int G>
void Slices(const MatmulArgs& a, int64_t block, int64_t b, float* panel, float* acc) {
  const int64_t kb = a.k / a.blocks;
  for (int64_t k0 = b * kb; k0 < (b + 1) * kb; k0 += kPanelSlice) {
    const int64_t len = Min(kPanelSlice, (b + 1) * kb - k0);
    const float* w[G];
    Convert<V>(a, block, G, k0, len, panel, w);
    const int64_t bytes = a.type == Weight::kInt8 ? 1 : 2;  // float32 weights are read in place, in order
    const char* next[G];
    for (int j = 0; j < G; ++j)
      next[j] = static_cast<const char*>(a.w) + ((block + j) * a.k + Min(k0 + len, a.k - 1)) * kLanes * bytes;
    // The last slice of K has no next slice in its blocks (the next group's first one is left to the cache).
    const bool prefetch = a.type != Weight::kF32 && k0 + len < a.k;
    Slice<V, G>(a, k0, len, w, acc, k0 == b * kb, prefetch ? next : nullptr, kLanes * bytes);
  }
}

// Scale block b's accumulators into the running sums, exactly as the rows form does.
template <class V>
void Scale(const MatmulArgs& a, int64_t block, int g, int64_t b, const float* acc, float* sums) {
  constexpr int64_t stride = V::kPanelGroup * kLanes;
  for (int64_t i = 0; i < a.m; ++i)
    for (int64_t c = 0; c < g * kLanes; c += V::kWidth) {
      typename V::Reg v = V::Load(acc + i * stride + c);
      if (a.scales != nullptr) v = V::Mul(v, V::Load(a.scales + b * a.nb * kLanes + block * kLanes + c));
      V::StoreFull(sums + i * stride + c, b == 0 ? v : V::Add(V::Load(sums + i * stride + c), v));
    }
}

// Slices<V, G> for a group of g (<= G) blocks (fewer only at the end of a thread's column range).
template <class V, int G>
inline void Groups(int g, const MatmulArgs& a, int64_t block, int64_t b, float* panel, float* acc) {
  if constexpr (G >= 1) {
    if (g == G) {
      Slices<V, G>(a, block, b, panel, acc);
    } else {
      Groups<V, G - 1>(g, a, block, b, panel, acc);
    }
  }
}

template <class V>
void Run(const MatmulArgs& a, int64_t block_begin, int64_t block_end, float* scratch) {
  static_assert(V::kPanelGroup <= kPanelMaxGroup, "PanelScratch must cover the buffers");
  constexpr int G = V::kPanelGroup;
  constexpr int64_t stride = G * kLanes;
  float* panel = scratch;
  float* acc = panel + G * kPanelSlice * kLanes;
  float* sums = acc + a.m * stride;
  for (int64_t block = block_begin; block < block_end; block += G) {
    const int g = static_cast<int>(Min(G, block_end - block));
    for (int64_t b = 0; b < a.blocks; ++b) {
      Groups<V, G>(g, a, block, b, panel, acc);
      Scale<V>(a, block, g, b, acc, sums);
    }
    for (int64_t i = 0; i < a.m; ++i)
      for (int64_t c = 0; c < g * kLanes; c += V::kWidth) {
        const int64_t col = block * kLanes + c;
        V::Store(a.out + a.rows[i] * a.n_out + col, V::Load(sums + i * stride + c), a.n_out - col);
      }
  }
}

}  // namespace panel
}  // namespace grok

#endif  // GROK_KERNELS_MATMUL_PANEL_H_
