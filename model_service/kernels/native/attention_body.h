// The attention kernel, written once over a small vector interface `V` (AVX-512: 16 lanes, AVX2: 8, the
// scalar path: 1). Included by one translation unit per instruction set, each compiled for its target.
//
// Row invariance by construction: every number a row's output depends on is computed by one fixed sequence
// of operations that depends only on that row's own query, its own keys/values and its limit, never on which
// other query vectors share a tile, how many rows the item holds or which lane a key lands in:
//   score s_j   = fma chain over d = 0..D-1 in order (q[d] * k_j[d]), then * multiplier, then the cap
//                 30 * tanh(s / 30) (Cap below: lane-wise, same code for every key, tail keys included);
//   max         = over j = 0..limit (exact whatever the order);
//   e_j         = Exp(s_j - max), lane-wise;
//   sum         = 16 partial sums, partial l adding the e_j with j % 16 == l in increasing j, then the fixed
//                 tree ((p0+p8)+(p4+p12))... (Tree16). The scalar and AVX2 paths keep the same 16 partials;
//   w_j         = e_j / sum;
//   out[d]      = fma chain over j = 0..limit in order (w_j * v_j[d]), starting from +0.
// Keys are vectorised over j in the score pass (the key tile is transposed so lane l holds key t0 + l) and
// values over d. Tiles of query vectors share each key/value load; a query vector never sees a key past its
// own limit in a sum (its tile runs jointly up to the tile's smallest limit, then each vector alone up to its
// own). Because each step above is the same elementwise operation in every path, the three instruction-set
// paths agree bit for bit as well (tests check both properties).
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"

namespace grok {
namespace attn {
namespace {  // each instruction set's translation unit keeps its own copy (no cross-target ODR merging)
namespace body {

constexpr int kParts = 16;        // partial sums of the softmax denominator (fixed for every path)
constexpr int64_t kStride = 32;   // score rows are padded to a multiple of this (>= every path's key tile)
constexpr int64_t kChunk = 64;    // keys per value chunk: their rows stay in cache across the query tiles
constexpr int kMaxTile = 8;       // at most this many query vectors share one key or value load

// exp(x) = 2^n * e^r, n = round(x / ln 2), |r| <= ln2 / 2, e^r by its Taylor series to degree 7 (truncation
// < 6e-9 relative). x is clamped to [-87, 88] so 2^n stays a normal float; softmax only asks for x <= 0.
template <class V>
inline typename V::Reg Exp(typename V::Reg x) {
  using Reg = typename V::Reg;
  const Reg magic = V::Set1(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer held in the low bits
  x = V::Min(V::Max(x, V::Set1(-87.0f)), V::Set1(88.0f));
  const Reg t = V::Add(V::Mul(x, V::Set1(1.44269504088896341f)), magic);
  const Reg n = V::Sub(t, magic);
  Reg r = V::Fma(n, V::Set1(-0.693359375f), x);  // ln 2 split: the high part has few bits, so n * hi is exact
  r = V::Fma(n, V::Set1(2.12194440e-4f), r);
  Reg p = V::Set1(1.0f / 5040.0f);
  p = V::Fma(p, r, V::Set1(1.0f / 720.0f));
  p = V::Fma(p, r, V::Set1(1.0f / 120.0f));
  p = V::Fma(p, r, V::Set1(1.0f / 24.0f));
  p = V::Fma(p, r, V::Set1(1.0f / 6.0f));
  p = V::Fma(p, r, V::Set1(0.5f));
  p = V::Fma(p, r, V::Set1(1.0f));
  p = V::Fma(p, r, V::Set1(1.0f));
  return V::Mul(p, V::Pow2(t, magic));
}

// 30 * tanh(x / 30). |y| < 0.55: y + y^3 P(y^2), P fitted here by weighted least squares (float32 error
// < 0.8 ulp); otherwise (1 - e) / (1 + e) with e = exp(-2|y|) <= 0.34 (no cancellation), signed.
template <class V>
inline typename V::Reg Cap(typename V::Reg x) {
  using Reg = typename V::Reg;
  const Reg y = V::Div(x, V::Set1(30.0f));
  const Reg a = V::Abs(y);
  const Reg z = V::Mul(y, y);
  Reg p = V::Set1(-0.006295950151979923f);
  p = V::Fma(p, z, V::Set1(0.021088143810629845f));
  p = V::Fma(p, z, V::Set1(-0.053856655955314636f));
  p = V::Fma(p, z, V::Set1(0.13332632184028625f));
  p = V::Fma(p, z, V::Set1(-0.33333319425582886f));
  Reg t = V::Fma(V::Mul(y, z), p, y);
  const auto large = V::Less(V::Set1(0.55f), a);  // false for NaN: NaN stays NaN through the polynomial
  if (V::Any(large)) {  // each lane's value is the same whether or not its neighbours took this branch
    const Reg e = Exp<V>(V::Mul(a, V::Set1(-2.0f)));
    const Reg big = V::Div(V::Sub(V::Set1(1.0f), e), V::Add(V::Set1(1.0f), e));
    t = V::Select(large, V::Select(V::Less(y, V::Zero()), V::Sub(V::Zero(), big), big), t);
  }
  return V::Mul(t, V::Set1(30.0f));
}

inline float Tree16(float* p) {
  for (int step = kParts / 2; step >= 1; step /= 2)
    for (int i = 0; i < step; ++i) p[i] = p[i] + p[i + step];
  return p[0];
}

// Per-thread buffers, grown to the largest item seen (one set per instruction set and pool type).
template <class T>
struct Scratch {
  std::vector<const float*> qp;  // per query vector i = (kv head, row, g) row-major: its query,
  std::vector<float*> op;        // its output,
  std::vector<int64_t> lim;      // its limit (ascending within each kv head's vectors),
  std::vector<float> top, sum;   // its softmax maximum and denominator
  std::vector<float> tops;       // [nq, kW]: lane maxima of its scores so far
  std::vector<float> scores;     // [nq, stride]: scores, then exp(s - top), then weights
  std::vector<float> kt;         // [D, kTile]: the current key tile, transposed
  std::vector<const T*> rows;    // [max(kTile, kChunk)] key rows of the tile / value rows of the chunk
  std::vector<T> zeros;          // [D]: stands in for the key rows past the item's last key
};

template <class V, class T>
struct Kernel {
  using Reg = typename V::Reg;
  static constexpr int kW = V::kW;
  static constexpr int kTile = V::kScoreRegs * kW;  // keys per score tile
  static constexpr int kDTile = V::kValueRegs * kW;  // output floats per value tile

  const Call& c;
  const Item& it;
  Scratch<T>& x;
  int64_t nv, nq, nkeys, stride;  // vectors per head, in all (nv * heads), keys, score row stride
  const T* pk;
  const T* pv;
  const int32_t* table;

  // out[i] = the row of key position first + i in `pool` for `head`, i < count (positions from `nkeys` on get
  // `past`). One division per call, not one per key: a 64-bit division costs more than a key's arithmetic.
  void Rows(const T* pool, int64_t head, int64_t first, int64_t count, const T** out, const T* past) const {
    int64_t block = first / c.bs, offset = first % c.bs;
    for (int64_t i = 0; i < count; ++i) {
      out[i] = first + i < nkeys ? pool + ((table[block] * c.hkv + head) * c.bs + offset) * c.d : past;
      if (++offset == c.bs) {
        offset = 0;
        ++block;
      }
    }
  }

  static float ToFloat(T v) {
    if constexpr (sizeof(T) == 2) {
      const uint32_t bits = static_cast<uint32_t>(v) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    } else {
      return v;
    }
  }
  static float HMax(Reg m) {
    float lanes[kW];
    V::Store(lanes, m);
    float top = lanes[0];
    for (int l = 1; l < kW; ++l) top = lanes[l] > top ? lanes[l] : top;
    return top;
  }

  // kt[d][jj] = key t0 + jj, element d (zeros past the item's keys: finite, never in a row's sums). Pure data
  // movement: the in-register transposes only make it cheaper.
  void TransposeTile(int64_t head, int64_t t0) {
    const T** rows = x.rows.data();
    Rows(pk, head, t0, kTile, rows, x.zeros.data());
    float* dst = x.kt.data();
    if constexpr (V::kTransposeW > 0) {
      if (c.d % V::kTransposeW == 0) {
        for (int64_t kb = 0; kb < kTile; kb += V::kTransposeW)
          for (int64_t d0 = 0; d0 < c.d; d0 += V::kTransposeW) V::Transpose(rows + kb, d0, dst + kb, kTile);
        return;
      }
    }
    for (int64_t jj = 0; jj < kTile; ++jj)
      for (int64_t d = 0; d < c.d; ++d) dst[d * kTile + jj] = ToFloat(rows[jj][d]);
  }

  // Scores of keys t0..t0+kTile for vectors i..i+NQ, and each vector's running maximum over its own keys.
  template <int NQ>
  void ScoreTile(int64_t i, int64_t t0) {
    Reg acc[NQ][V::kScoreRegs];
    for (int q = 0; q < NQ; ++q)
      for (int u = 0; u < V::kScoreRegs; ++u) acc[q][u] = V::Zero();
    const float* kd = x.kt.data();
    const float* qs[NQ];
    for (int q = 0; q < NQ; ++q) qs[q] = x.qp[i + q];
    for (int64_t d = 0; d < c.d; ++d, kd += kTile) {
      Reg k[V::kScoreRegs];
      for (int u = 0; u < V::kScoreRegs; ++u) k[u] = V::Load(kd + u * kW);
      for (int q = 0; q < NQ; ++q) {
        const Reg b = V::Set1(qs[q][d]);
        for (int u = 0; u < V::kScoreRegs; ++u) acc[q][u] = V::Fma(b, k[u], acc[q][u]);
      }
    }
    const Reg mult = V::Set1(c.multiplier);
    for (int q = 0; q < NQ; ++q) {
      float* top = x.tops.data() + (i + q) * kW;  // lane maxima, exact in any order
      Reg m = V::Load(top);
      for (int u = 0; u < V::kScoreRegs; ++u) {
        const Reg sc = Cap<V>(V::Mul(acc[q][u], mult));
        V::Store(x.scores.data() + (i + q) * stride + t0 + u * kW, sc);
        const int64_t seen = x.lim[i + q] + 1 - (t0 + u * kW);
        if (seen > 0) m = V::Max(V::MaskTail(sc, seen, -std::numeric_limits<float>::infinity()), m);
      }
      V::Store(top, m);
    }
  }

  // Tile by tile over the keys, every head of the item in turn: a block's heads are adjacent in the pool, so
  // the item reads one contiguous run per block instead of a strided slice of it.
  void Scores() {
    for (int64_t i = 0; i < nq * kW; ++i) x.tops[i] = -std::numeric_limits<float>::infinity();
    int64_t first = 0;  // a head's vectors below it see no key of the tile (limits ascend within a head)
    for (int64_t t0 = 0; t0 < nkeys; t0 += kTile) {
      while (x.lim[first] < t0) ++first;
      for (int64_t hh = 0; hh < it.heads; ++hh) {
        TransposeTile(it.head + hh, t0);
        for (int64_t i = hh * nv + first; i < (hh + 1) * nv; i += V::kScoreQueries) {
          const int64_t n = (hh + 1) * nv - i;
          switch (n < V::kScoreQueries ? n : V::kScoreQueries) {
            case 1: ScoreTile<1>(i, t0); break;
            case 2: ScoreTile<2>(i, t0); break;
            case 3: ScoreTile<3>(i, t0); break;
            case 4: ScoreTile<4>(i, t0); break;
            case 5: ScoreTile<(V::kScoreQueries >= 5 ? 5 : 1)>(i, t0); break;
            case 6: ScoreTile<(V::kScoreQueries >= 6 ? 6 : 1)>(i, t0); break;
            case 7: ScoreTile<(V::kScoreQueries >= 7 ? 7 : 1)>(i, t0); break;
            default: ScoreTile<V::kScoreQueries>(i, t0); break;
          }
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i) x.top[i] = HMax(V::Load(x.tops.data() + i * kW));
  }

  // Vector i's scores -> exp(s - top) in place over keys 0..lim[i], and their sum in the fixed 16-part order.
  void Exponentials(int64_t i) {
    constexpr int kRegs = kParts / kW;
    float* s = x.scores.data() + i * stride;
    const int64_t n = x.lim[i] + 1;
    Reg sum[kRegs];
    for (int u = 0; u < kRegs; ++u) sum[u] = V::Zero();
    const Reg top = V::Set1(x.top[i]);
    for (int64_t j0 = 0; j0 < n; j0 += kParts)
      for (int u = 0; u < kRegs; ++u) {
        const int64_t base = j0 + u * kW;
        if (base >= n) continue;
        const Reg e = V::MaskTail(Exp<V>(V::Sub(V::Load(s + base), top)), n - base, 0.0f);
        V::Store(s + base, e);
        sum[u] = V::Add(sum[u], e);
      }
    float parts[kParts];
    for (int u = 0; u < kRegs; ++u) V::Store(parts + u * kW, sum[u]);
    x.sum[i] = Tree16(parts);
  }

  // out[q] += sum_{j in [ja, jb)} w_q[j] v_j over the NR value registers at offset dc, for the NQ vectors.
  // kPart: the last register holds only `tail` < kW floats (masked loads, no branch in the loop, so the
  // accumulators stay in registers).
  template <int NQ, int NR, bool kPart>
  void ValueTile(const int64_t* qs, int64_t c0, int64_t ja, int64_t jb, int64_t dc, int64_t tail) {
    Reg acc[NQ][NR];
    const float* w[NQ];
    for (int q = 0; q < NQ; ++q) {
      w[q] = x.scores.data() + qs[q] * stride;
      for (int r = 0; r < NR; ++r) acc[q][r] = V::LoadN(x.op[qs[q]] + dc + r * kW, r + 1 < NR ? kW : tail);
    }
    const T* const* vrows = x.rows.data() - c0;
    for (int64_t j = ja; j < jb; ++j) {
      const T* row = vrows[j] + dc;
      Reg v[NR];
      for (int r = 0; r < NR; ++r) {
        if (kPart && r + 1 == NR) {
          v[r] = V::LoadPart(row + r * kW, tail);
        } else {
          v[r] = V::LoadAny(row + r * kW);
        }
      }
      for (int q = 0; q < NQ; ++q) {
        const Reg wj = V::Set1(w[q][j]);
        for (int r = 0; r < NR; ++r) acc[q][r] = V::Fma(wj, v[r], acc[q][r]);
      }
    }
    for (int q = 0; q < NQ; ++q)
      for (int r = 0; r < NR; ++r) V::StoreN(x.op[qs[q]] + dc + r * kW, acc[q][r], r + 1 < NR ? kW : tail);
  }

  template <int NQ, int NR>
  void ValueRegs(const int64_t* qs, int64_t c0, int64_t ja, int64_t jb, int64_t dc) {
    const int64_t tail = c.d - dc - (NR - 1) * kW;  // valid floats of the last register
    if (tail < kW) {
      ValueTile<NQ, NR, true>(qs, c0, ja, jb, dc, tail);
    } else {
      ValueTile<NQ, NR, false>(qs, c0, ja, jb, dc, kW);
    }
  }

  template <int NQ>
  void Values(const int64_t* qs, int64_t c0, int64_t ja, int64_t jb) {
    for (int64_t dc = 0; dc < c.d; dc += kDTile) {
      const int64_t regs = (c.d - dc + kW - 1) / kW;
      switch (regs >= V::kValueRegs ? V::kValueRegs : regs) {
        case 1: ValueRegs<NQ, 1>(qs, c0, ja, jb, dc); break;
        case 2: ValueRegs<NQ, (V::kValueRegs >= 2 ? 2 : 1)>(qs, c0, ja, jb, dc); break;
        case 3: ValueRegs<NQ, (V::kValueRegs >= 3 ? 3 : 1)>(qs, c0, ja, jb, dc); break;
        default: ValueRegs<NQ, V::kValueRegs>(qs, c0, ja, jb, dc); break;
      }
    }
  }

  void Outputs() {
    // Query vectors per value tile: about V::kValueAccs accumulators (value registers x vectors).
    const int64_t regs = (c.d + kW - 1) / kW < V::kValueRegs ? (c.d + kW - 1) / kW : V::kValueRegs;
    const int64_t tile = V::kValueAccs / regs < kMaxTile ? V::kValueAccs / regs : kMaxTile;
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t d = 0; d < c.d; ++d) x.op[i][d] = 0.0f;
    int64_t first = 0;
    for (int64_t c0 = 0; c0 < nkeys; c0 += kChunk) {
      const int64_t c1 = c0 + kChunk < nkeys ? c0 + kChunk : nkeys;
      while (x.lim[first] < c0) ++first;
      for (int64_t hh = 0; hh < it.heads; ++hh) {
        Rows(pv, it.head + hh, c0, c1 - c0, x.rows.data(), x.zeros.data());
        for (int64_t i = hh * nv + first; i < (hh + 1) * nv; ++i) {  // w_j = e_j / sum, while in cache
          float* s = x.scores.data() + i * stride;
          const int64_t end = x.lim[i] + 1 < c1 ? x.lim[i] + 1 : c1;
          const Reg total = V::Set1(x.sum[i]);
          for (int64_t base = c0; base < end; base += kW) V::Store(s + base, V::Div(V::Load(s + base), total));
        }
        for (int64_t i = hh * nv + first; i < (hh + 1) * nv; i += tile) {
          const int64_t n = (hh + 1) * nv - i < tile ? (hh + 1) * nv - i : tile;
          ValueTiles(i, n, c0, c1);
        }
      }
    }
  }

  // Vectors i..i+n (limits ascending) over the keys of chunk [c0, c1) each of them sees.
  void ValueTiles(int64_t i, int64_t n, int64_t c0, int64_t c1) {
    int64_t qs[kMaxTile];
    for (int q = 0; q < kMaxTile; ++q) qs[q] = i + q;
    const int64_t joint = x.lim[i] + 1 < c1 ? x.lim[i] + 1 : c1;  // lim[i] is the tile's smallest limit
    if (c0 < joint) {
      switch (n) {
        case 1: Values<1>(qs, c0, c0, joint); break;
        case 2: Values<2>(qs, c0, c0, joint); break;
        case 3: Values<3>(qs, c0, c0, joint); break;
        case 4: Values<4>(qs, c0, c0, joint); break;
        case 5: Values<5>(qs, c0, c0, joint); break;
        case 6: Values<6>(qs, c0, c0, joint); break;
        case 7: Values<7>(qs, c0, c0, joint); break;
        default: Values<8>(qs, c0, c0, joint); break;
      }
    }
    const int64_t from = c0 > x.lim[i] + 1 ? c0 : x.lim[i] + 1;
    for (int64_t q = 0; q < n; ++q) {  // the rest of each vector's own keys in this chunk, alone
      const int64_t to = x.lim[i + q] + 1 < c1 ? x.lim[i + q] + 1 : c1;
      if (from < to) Values<1>(qs + q, c0, from, to);
    }
  }

  void Run() {
    Scores();
    for (int64_t i = 0; i < nq; ++i) Exponentials(i);
    Outputs();
  }
};

template <class V, class T>
void RunItem(const Call& c, const Item& it) {
  thread_local Scratch<T> x;
  const int64_t g = c.hq / c.hkv, nv = it.count * g, nq = nv * it.heads;
  const int64_t nkeys = it.limits[it.count - 1] + 1;
  const int64_t stride = (nkeys + kStride - 1) / kStride * kStride;
  x.qp.resize(nq);
  x.op.resize(nq);
  x.lim.resize(nq);
  x.top.resize(nq);
  x.tops.resize(nq * V::kW);
  x.sum.resize(nq);
  for (int64_t hh = 0; hh < it.heads; ++hh)  // vector (hh, r, h): query head (it.head + hh) * G + h of row r
    for (int64_t r = 0; r < it.count; ++r)
      for (int64_t h = 0; h < g; ++h) {
        const int64_t i = hh * nv + r * g + h, head = (it.head + hh) * g + h;
        x.qp[i] = c.q + (it.rows[r] * c.hq + head) * c.d;
        x.op[i] = c.out + (it.rows[r] * c.hq + head) * c.d;
        x.lim[i] = it.limits[r];
      }
  if (static_cast<int64_t>(x.scores.size()) < nq * stride) x.scores.resize(nq * stride);
  x.kt.resize(c.d * Kernel<V, T>::kTile);
  x.rows.resize(kChunk > Kernel<V, T>::kTile ? kChunk : Kernel<V, T>::kTile);
  x.zeros.assign(c.d, T{});
  Kernel<V, T> k{c, it, x, nv, nq, nkeys, stride, static_cast<const T*>(c.pool_k), static_cast<const T*>(c.pool_v),
                 c.tables + it.seq * c.table_len};
  k.Run();
}

template <class V>
void AnyPool(const Call& c, const Item& it) {
  if (c.bf16) {
    RunItem<V, uint16_t>(c, it);
  } else {
    RunItem<V, float>(c, it);
  }
}

template <class V, bool kCap>
void Elementwise(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += V::kW) {
    const int64_t valid = n - i < V::kW ? n - i : V::kW;
    const typename V::Reg v = V::LoadN(x + i, valid);
    V::StoreN(y + i, kCap ? Cap<V>(v) : Exp<V>(v), valid);
  }
}

}  // namespace body
}  // namespace
}  // namespace attn
}  // namespace grok
