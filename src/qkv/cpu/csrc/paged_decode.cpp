// One decode step of attention over a paged KV cache: each row's query heads read the row's blocks where they lie
// in the pools (PagedAttention: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
// with PagedAttention", arXiv:2309.06180), a block at a time, merged by an online softmax (Milakov and
// Gimelshein 2018, "Online normalizer calculation for softmax").
//
// A work item is one (row, KV head): the G query heads of that KV head (grouped-query attention reads each KV head
// once) walk the row's table; a block whose slots the query may not see (empty, after the query, outside the
// window) is skipped unread. Keys are taken in spans of whole blocks (up to kSpan keys): the visible slots' scores
// are G dot products per key read from the pool in place (float32 with AVX-512: sixteen keys' dot products summed
// lane-wise by one tree of shuffles), then one softmax update per head and span, vectorized over its keys, and the
// values accumulated in a register tile of heads x head-dim vectors, each value vector loaded once per tile.
// Nothing is gathered, listed or padded: the bytes read are the visible keys and values. Pools in bfloat16 are read
// the same way and computed in float32: each visible piece's keys and values are widened into a per-thread float32
// buffer as they are reached (the query, the sums and the softmax in float32), and the output is rounded once.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kSpan = 128;  // keys per softmax update (whole blocks, or kSpan-key pieces of a longer block)
constexpr int64_t kMinWork = int64_t(1) << 16;  // multiply-adds a thread's share, at least

// sum_d a[d] b[d], two vector accumulators, then the lanes and the tail.
template <typename T>
inline T dot(const T* a, const T* b, int64_t D) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  Vec acc0(T(0)), acc1(T(0));
  int64_t d = 0;
  for (; d + 2 * L <= D; d += 2 * L) {
    acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + d + L), Vec::loadu(b + d + L), acc1);
  }
  for (; d + L <= D; d += L) acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
  T s = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, acc0 + acc1);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// s[t] = sum_d q[d] k[t][d] for the 16 keys k[t] = k + t * kst (D a multiple of 16), float32 with AVX-512:
// each key's 16-lane partial sums, then the 16 vectors summed lane-wise into one by a tree of cross-lane
// shuffles (45 operations for the 16 sums where reducing each vector apart takes about 160).
#if defined(CPU_CAPABILITY_AVX512)
inline void scores16(const float* q, const float* k, int64_t kst, int64_t D, float* s) {
  __m512 acc[16];
  for (int t = 0; t < 16; t += 4) {  // four keys at a time: four independent FMA chains
    // slot 4j + c of the tree's input comes out in lane 4c + j: feed key 4c + j there, so lane t holds key t
    const float* k0 = k + ((t % 4) * 4 + t / 4) * kst;
    const float* k1 = k + (((t + 1) % 4) * 4 + (t + 1) / 4) * kst;
    const float* k2 = k + (((t + 2) % 4) * 4 + (t + 2) / 4) * kst;
    const float* k3 = k + (((t + 3) % 4) * 4 + (t + 3) / 4) * kst;
    __m512 qv = _mm512_loadu_ps(q);
    __m512 a0 = _mm512_mul_ps(qv, _mm512_loadu_ps(k0)), a1 = _mm512_mul_ps(qv, _mm512_loadu_ps(k1));
    __m512 a2 = _mm512_mul_ps(qv, _mm512_loadu_ps(k2)), a3 = _mm512_mul_ps(qv, _mm512_loadu_ps(k3));
    for (int64_t d = 16; d < D; d += 16) {
      qv = _mm512_loadu_ps(q + d);
      a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + d), a0);
      a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + d), a1);
      a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + d), a2);
      a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + d), a3);
    }
    acc[t] = a0;
    acc[t + 1] = a1;
    acc[t + 2] = a2;
    acc[t + 3] = a3;
  }
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // 128-bit chunks 0-1: halves of acc[2i] summed, 2-3: of acc[2i + 1]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // chunk c: four partial sums of acc[4i + c]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // chunk c: two partial sums of acc[8i + c] then two of acc[8i + 4 + c]
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44), _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  // chunk c, lane j: the sum of acc[4j + c]
  _mm512_storeu_ps(s, _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD)));
}
constexpr bool kScores16 = true;
#else
inline void scores16(const float*, const float*, int64_t, int64_t, float*) {}
constexpr bool kScores16 = false;
#endif

// o[g, c0 : c0 + CB L] = alpha[g] o[g, ..] + sum_u p[g, u] v_u[c0 : ..] for the GB heads g0 .. g0 + GB: a tile
// of GB x CB vector accumulators held in registers while the keys stream by, each value vector loaded once.
template <typename T, int GB, int CB>
void values_tile(const T* p, int64_t ps, const T* alpha, const T* const* vrows, int64_t n, int64_t c0, T* o,
                 int64_t Dv) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  Vec acc[GB][CB];
  for (int g = 0; g < GB; ++g)
    for (int k = 0; k < CB; ++k) acc[g][k] = Vec::loadu(o + g * Dv + c0 + k * L) * Vec(alpha[g]);
  for (int64_t u = 0; u < n; ++u) {
    Vec v[CB];
    for (int k = 0; k < CB; ++k) v[k] = Vec::loadu(vrows[u] + c0 + k * L);
    for (int g = 0; g < GB; ++g) {
      const Vec pg(p[g * ps + u]);
      for (int k = 0; k < CB; ++k) acc[g][k] = at::vec::fmadd(pg, v[k], acc[g][k]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int k = 0; k < CB; ++k) acc[g][k].store(o + g * Dv + c0 + k * L);
}

template <typename T, int GB>
void values_heads(const T* p, int64_t ps, const T* alpha, const T* const* vrows, int64_t n, T* o, int64_t Dv) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  int64_t c = 0;
  for (; c + 4 * L <= Dv; c += 4 * L) values_tile<T, GB, 4>(p, ps, alpha, vrows, n, c, o, Dv);
  for (; c + L <= Dv; c += L) values_tile<T, GB, 1>(p, ps, alpha, vrows, n, c, o, Dv);
  for (; c < Dv; ++c) {  // the head dim's tail
    for (int g = 0; g < GB; ++g) {
      T acc = o[g * Dv + c] * alpha[g];
      for (int64_t u = 0; u < n; ++u) acc += p[g * ps + u] * vrows[u][c];
      o[g * Dv + c] = acc;
    }
  }
}

// The values of a span for every head: heads four at a time (the tile's rows), then the rest.
template <typename T>
void values(const T* p, int64_t ps, const T* alpha, const T* const* vrows, int64_t n, int64_t G, int64_t Dv, T* o) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) values_heads<T, 4>(p + g * ps, ps, alpha + g, vrows, n, o + g * Dv, Dv);
  switch (G - g) {
    case 3: values_heads<T, 3>(p + g * ps, ps, alpha + g, vrows, n, o + g * Dv, Dv); break;
    case 2: values_heads<T, 2>(p + g * ps, ps, alpha + g, vrows, n, o + g * Dv, Dv); break;
    case 1: values_heads<T, 1>(p + g * ps, ps, alpha + g, vrows, n, o + g * Dv, Dv); break;
    default: break;
  }
}

// rows x D values of src (row stride st) widened to float32, contiguous, into dst.
inline void widen_rows(const at::BFloat16* src, int64_t st, int64_t rows, int64_t D, float* dst) {
  using bVec = at::vec::Vectorized<at::BFloat16>;
  constexpr int64_t L = bVec::size(), H = at::vec::Vectorized<float>::size();
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* a = src + r * st;
    float* o = dst + r * D;
    int64_t d = 0;
    for (; d + L <= D; d += L) {
      auto [lo, hi] = at::vec::convert_bfloat16_float(bVec::loadu(a + d));
      lo.store(o + d);
      hi.store(o + d + H);
    }
    for (; d < D; ++d) o[d] = static_cast<float>(a[d]);
  }
}

// T: the arithmetic (float or double); S: the pools' storage (T, or bfloat16 with T float).
template <typename T, typename S = T>
void run(const at::Tensor& q, const at::Tensor& kpool, const at::Tensor& vpool, const at::Tensor& tables,
         const at::Tensor& kv_pos, const at::Tensor& q_pos, double scale, int64_t window, bool causal,
         const T* sinks, at::Tensor& out, at::Tensor& lse) {
  constexpr bool kWiden = !std::is_same_v<S, T>;
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t P = kpool.size(0), Hkv = kpool.size(1), Tb = kpool.size(2), Dv = vpool.size(3);
  const int64_t NB = tables.size(1), G = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  const S* kp = kpool.data_ptr<S>();
  const S* vp = vpool.data_ptr<S>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* pos = kv_pos.data_ptr<int64_t>();
  const int64_t* qps = q_pos.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  T* lp = lse.data_ptr<T>();
  const int64_t qsb = q.stride(0), qsh = q.stride(1), psb = kv_pos.stride(0), qpsb = q_pos.stride(0);
  const int64_t ksp = kpool.stride(0), ksh = kpool.stride(1), kst = kpool.stride(2);
  const int64_t vsp = vpool.stride(0), vsh = vpool.stride(1), vst = vpool.stride(2);
  const T ninf = -std::numeric_limits<T>::infinity();
  // Keys are taken a span at a time (up to kSpan, whole blocks or pieces of a longer one): their scores, then one
  // softmax update per head for the span and the span's values, so the update's fixed cost (maxima,
  // exponentials, rescaling) is paid once per span rather than per block.
  const int64_t span = kSpan;
  // A KV head's work is its G queries against up to NB * Tb keys; shares of less than kMinWork multiply-adds stay
  // on the calling thread (a short cache's step is not worth a parallel region, which on a busy CPU waits for a
  // descheduled worker).
  const int64_t work = std::max<int64_t>(1, G * NB * Tb * (D + Dv));
  at::parallel_for(0, B * Hkv, std::max<int64_t>(1, kMinWork / work), [&](int64_t begin, int64_t end) {
    std::vector<T> qs(G * D), o(G * Dv), s(G * span), m(G), l(G), alpha(G);
    std::vector<const T*> vrows(span);
    std::vector<T> kwide(kWiden ? kSpan * D : 0), vwide(kWiden ? span * Dv : 0);  // widened keys, values
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv, qpos = qps[b * qpsb];
      auto visible = [&](int64_t p) {
        return p >= 0 && qpos >= 0 && (!causal || p <= qpos) && (window <= 0 || qpos - p < window);
      };
      for (int64_t g = 0; g < G; ++g) {
        const T* src = qp + b * qsb + (h * G + g) * qsh;
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = T(scale) * src[d];
      }
      std::fill(o.begin(), o.end(), T(0));
      std::fill(m.begin(), m.end(), ninf);
      std::fill(l.begin(), l.end(), T(0));
      int64_t n = 0;  // keys in the span so far
      auto flush = [&]() {  // the online-softmax update of every head by the span's n keys
        for (int64_t g = 0; g < G; ++g) {
          T* sg = s.data() + g * span;
          alpha[g] = qkv_paged::online_update<T>(sg, n, m[g], l[g]);
        }
        values<T>(s.data(), span, alpha.data(), vrows.data(), n, G, Dv, o.data());
        n = 0;
      };
      const int64_t* row_pos = pos + b * psb;
      for (int64_t piece = 0, pieces = (Tb + kSpan - 1) / kSpan; piece < NB * pieces; ++piece) {
        const int64_t j = piece / pieces, lo = (piece % pieces) * kSpan, hi = std::min(Tb, lo + kSpan);  // slots
        const int64_t* pj = row_pos + j * Tb;
        int64_t first = hi, last = -1;
        for (int64_t t = lo; t < hi; ++t) {
          if (visible(pj[t])) {
            first = std::min(first, t);
            last = t;
          }
        }
        if (last < 0) continue;  // nothing visible: the slots are not read
        const int64_t blk = tab[b * NB + j];
        const int64_t cnt = last - first + 1;
        if (n + cnt > span) flush();
        const T* kb;  // slot first + i's key at kb + i * ks, its value at vb + i * vs
        const T* vb;
        int64_t ks = kst, vs = vst;
        if constexpr (kWiden) {  // the piece's slots first..last, widened: keys for now, values until the flush
          widen_rows(kp + blk * ksp + h * ksh + first * kst, kst, cnt, D, kwide.data());
          widen_rows(vp + blk * vsp + h * vsh + first * vst, vst, cnt, Dv, vwide.data() + n * Dv);
          kb = kwide.data();
          vb = vwide.data() + n * Dv;
          ks = D;
          vs = Dv;
        } else {
          kb = kp + blk * ksp + h * ksh + first * kst;
          vb = vp + blk * vsp + h * vsh + first * vst;
        }
        int64_t t0 = first;  // scores of the slots first..last
        if constexpr (std::is_same_v<T, float>) {
          if (kScores16 && D % 16 == 0) {
            for (; t0 + 16 <= last + 1; t0 += 16) {
              for (int64_t g = 0; g < G; ++g) scores16(qs.data() + g * D, kb + (t0 - first) * ks, ks, D, s.data() + g * span + n + t0 - first);
            }
          }
        }
        for (int64_t t = t0; t <= last; ++t) {
          for (int64_t g = 0; g < G; ++g) s[g * span + n + t - first] = dot<T>(qs.data() + g * D, kb + (t - first) * ks, D);
        }
        for (int64_t t = first; t <= last; ++t) {  // slots between that the query may not see (a window's edge)
          if (!visible(pj[t])) {
            for (int64_t g = 0; g < G; ++g) s[g * span + n + t - first] = ninf;
          }
          vrows[n + t - first] = vb + (t - first) * vs;
        }
        n += cnt;
      }
      if (n) flush();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        qkv_paged::finish_row<T>(o.data() + g * Dv, Dv, m[g], l[g], sinks == nullptr ? nullptr : sinks + hq,
                                 op + (b * Hq + hq) * Dv, lp + b * Hq + hq);
      }
    }
  });
}

}  // namespace

// q (B, Hq, D); k_pool (P, Hkv, T, D), v_pool (P, Hkv, T, Dv) with unit last strides; tables (B, NB) int64;
// kv_pos (B, NB * T) int64, -1 where empty, q_pos (B,) int64 (a row of either may be broadcast, stride 0); a slot
// is visible to a query at position >= 0 when filled, not after it if causal, inside the window (<= 0: none);
// sinks (Hq,) or None -> out (B, Hq, Dv), lse (B, Hq), in q's dtype: float32, float64 or bfloat16 (float32 inside). A (B, Hkv, S, D) cache is the pool of B blocks of S slots
// with tables [[0], [1], ...].
std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                     const at::Tensor& tables, const at::Tensor& kv_pos, const at::Tensor& q_pos,
                                     double scale, int64_t window, bool causal,
                                     const c10::optional<at::Tensor>& sinks) {
  const at::Tensor z = qkv_paged::check_args("paged_decode", q, k_pool, v_pool, tables, kv_pos, q_pos, sinks);
  const int64_t B = q.size(0);
  if (q.scalar_type() == at::kBFloat16) {  // bfloat16 pools, float32 arithmetic, the results rounded once
    const at::Tensor qf = q.to(at::kFloat), zf = z.defined() ? z.to(at::kFloat) : z;
    auto out = at::empty({B, q.size(1), v_pool.size(3)}, qf.options());
    auto lse = at::empty({B, q.size(1)}, qf.options());
    run<float, at::BFloat16>(qf, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal,
                             zf.defined() ? zf.data_ptr<float>() : nullptr, out, lse);
    return {out.to(at::kBFloat16), lse.to(at::kBFloat16)};
  }
  auto out = at::empty({B, q.size(1), v_pool.size(3)}, q.options());
  auto lse = at::empty({B, q.size(1)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal,
                  z.defined() ? z.data_ptr<scalar_t>() : nullptr, out, lse);
  });
  return {out, lse};
}
