// Attention of each query row over the keys its list names, read in place from the K/V tensors.
//
// The selected-key attention of DeepSeek Sparse Attention (DeepSeek-AI, "DeepSeek-V3.2", 2025) and of MoBA
// (Lu et al., "MoBA: Mixture of Block Attention for Long-Context LLMs", 2025). Blocks of query rows walk the keys
// window by window (run); per row and window its listed keys are multiplied by the row's query heads either with
// the heads in vector lanes, reading the keys where they lie (lanes_tile), or a tile at a time copied into a
// cache-resident buffer for the BLAS torch links, MKL's sgemm/dgemm (blas_tile); tiles merge by an online softmax
// (Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018), so no (rows x K x D) gather is
// ever materialized.
// Semantics are those of qkv.masks.topk (see qkv/backends/gather.py): -1 lists no key, a repeat counts once,
// an optional causal bound drops keys past row + offset, sinks add exp(sink) to each head's denominator.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "blas.h"

namespace {

constexpr int64_t kAhead = 8;  // keys prefetched ahead of the copy
constexpr int64_t kRows = 64;  // query rows walked together through the key windows
constexpr int64_t kWindowKeys = 4096;  // keys per window: 4 MB of 128-wide float32 keys and values, in L3

using qkv_blas::gemm;

// One tile of n listed keys for a group of G query heads, G a multiple of the vector width L: the heads lie in
// vector lanes, so a key's G scores are D vector FMAs of the transposed queries qt (D x G) with the key's
// channels broadcast, the online softmax runs lane-wise, and the output ot (Dv x G) takes D vector FMAs per key.
// Keys and values are read where they lie (k_row / v_row), four keys at a time. s: n x G scratch; m, l: G.
template <typename T, typename KRow, typename VRow>
void lanes_tile(const T* qt, const int64_t* keys, int64_t n, int64_t G, int64_t D, int64_t Dv, const KRow& k_row,
                const VRow& v_row, T* s, T* ot, T* m, T* l) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  constexpr int64_t U = 4;
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t t = 0; t < n; t += U) {
    const int64_t u = std::min(U, n - t);
    const T* kr[U];
    for (int64_t a = 0; a < U; ++a) kr[a] = k_row(keys[t + std::min(a, u - 1)]);
    for (int64_t a = 0; a < U && t + U + a < n; ++a) {  // the next keys, so that their loads overlap these FMAs
      const char* next = reinterpret_cast<const char*>(k_row(keys[t + U + a]));
      for (int64_t c = 0; c < int64_t(D * sizeof(T)); c += 64) __builtin_prefetch(next + c);
    }
    for (int64_t c = 0; c < G; c += L) {
      Vec a0(T(0)), a1(T(0)), a2(T(0)), a3(T(0));
      for (int64_t d = 0; d < D; ++d) {
        const Vec qv = Vec::loadu(qt + d * G + c);
        a0 = at::vec::fmadd(qv, Vec(kr[0][d]), a0);
        a1 = at::vec::fmadd(qv, Vec(kr[1][d]), a1);
        a2 = at::vec::fmadd(qv, Vec(kr[2][d]), a2);
        a3 = at::vec::fmadd(qv, Vec(kr[3][d]), a3);
      }
      const Vec acc[U] = {a0, a1, a2, a3};
      for (int64_t a = 0; a < u; ++a) acc[a].store(s + (t + a) * G + c);
    }
  }
  for (int64_t c = 0; c < G; c += L) {  // online softmax, lane-wise
    Vec mx(ninf);
    for (int64_t t = 0; t < n; ++t) mx = at::vec::maximum(mx, Vec::loadu(s + t * G + c));
    const Vec mold = Vec::loadu(m + c);
    const Vec mnew = at::vec::maximum(mold, mx);
    const Vec alpha = Vec::blendv((mold - mnew).exp(), Vec(T(0)), mold == Vec(ninf));
    Vec sum(T(0));
    const Vec none = mnew == Vec(ninf);  // every score so far -inf: they weigh 0 (not exp(-inf + inf) = NaN)
    for (int64_t t = 0; t < n; ++t) {
      const Vec e = Vec::blendv((Vec::loadu(s + t * G + c) - mnew).exp(), Vec(T(0)), none);
      e.store(s + t * G + c);
      sum = sum + e;
    }
    (Vec::loadu(l + c) * alpha + sum).store(l + c);
    mnew.store(m + c);
    for (int64_t d = 0; d < Dv; ++d) (Vec::loadu(ot + d * G + c) * alpha).store(ot + d * G + c);
  }
  for (int64_t t = 0; t < n; t += U) {
    const int64_t u = std::min(U, n - t);
    const T* vr[U];
    for (int64_t a = 0; a < U; ++a) vr[a] = v_row(keys[t + std::min(a, u - 1)]);
    for (int64_t a = 0; a < U && t + U + a < n; ++a) {
      const char* next = reinterpret_cast<const char*>(v_row(keys[t + U + a]));
      for (int64_t c = 0; c < int64_t(Dv * sizeof(T)); c += 64) __builtin_prefetch(next + c);
    }
    for (int64_t c = 0; c < G; c += L) {
      Vec p[U];  // a missing key (past n) gets probability 0 and reads the last real row
      for (int64_t a = 0; a < U; ++a) p[a] = a < u ? Vec::loadu(s + (t + a) * G + c) : Vec(T(0));
      for (int64_t d = 0; d < Dv; ++d) {
        Vec o = Vec::loadu(ot + d * G + c);
        o = at::vec::fmadd(p[0], Vec(vr[0][d]), o);
        o = at::vec::fmadd(p[1], Vec(vr[1][d]), o);
        o = at::vec::fmadd(p[2], Vec(vr[2][d]), o);
        o = at::vec::fmadd(p[3], Vec(vr[3][d]), o);
        o.store(ot + d * G + c);
      }
    }
  }
}

// One tile of n listed keys for one query row on the BLAS path: the keys and values copied into kt / vt (a buffer
// that stays in cache), s = scale qg kt^T, an online-softmax update of (m, l) and o (G x Dv) += p vt.
template <typename T, typename KRow, typename VRow>
void blas_tile(const T* qg, const int64_t* keys, int64_t n, int64_t G, int64_t D, int64_t Dv, T scale,
               const KRow& k_row, const VRow& v_row, T* kt, T* vt, T* s, T* o, T* m, T* l) {
  using Vec = at::vec::Vectorized<T>;
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    if (t + kAhead < n) {  // the rows a few keys ahead, so that their loads overlap these copies
      const char* kr = reinterpret_cast<const char*>(k_row(keys[t + kAhead]));
      const char* vr = reinterpret_cast<const char*>(v_row(keys[t + kAhead]));
      for (int64_t c = 0; c < int64_t(D * sizeof(T)); c += 64) __builtin_prefetch(kr + c);
      for (int64_t c = 0; c < int64_t(Dv * sizeof(T)); c += 64) __builtin_prefetch(vr + c);
    }
    std::memcpy(kt + t * D, k_row(keys[t]), D * sizeof(T));
    std::memcpy(vt + t * Dv, v_row(keys[t]), Dv * sizeof(T));
  }
  // s (G x n, row-major) = scale * qg (G x D) kt^T: column-major s^T (n x G) = kt^T' (n x D) qg^T (D x G)
  gemm('T', 'N', int(n), int(G), int(D), scale, kt, int(D), qg, int(D), T(0), s, int(n));
  T lanes[Vec::size()];
  for (int64_t g = 0; g < G; ++g) {
    T* row = s + g * n;
    Vec vmx(ninf);
    int64_t t0 = 0;
    for (; t0 + Vec::size() <= n; t0 += Vec::size()) vmx = at::vec::maximum(vmx, Vec::loadu(row + t0));
    vmx.store(lanes);
    T mx = ninf;
    for (int64_t u = 0; u < Vec::size(); ++u) mx = std::isnan(lanes[u]) ? lanes[u] : std::max(mx, lanes[u]);
    for (; t0 < n; ++t0) mx = std::isnan(row[t0]) ? row[t0] : std::max(mx, row[t0]);
    const T mnew = std::isnan(mx) || std::isnan(m[g]) ? mx + m[g] : std::max(m[g], mx);  // a NaN score stays in m
    if (mnew == ninf) {  // every score so far -inf: they weigh 0, nothing changes
      std::fill(row, row + n, T(0));
      continue;
    }
    const T alpha = m[g] == ninf ? T(0) : std::exp(m[g] - mnew);
    const Vec vm(mnew);
    Vec acc(T(0));
    int64_t t = 0;
    for (; t + Vec::size() <= n; t += Vec::size()) {
      Vec e = (Vec::loadu(row + t) - vm).exp();
      e.store(row + t);
      acc = acc + e;
    }
    acc.store(lanes);
    T sum = 0;
    for (int64_t u = 0; u < Vec::size(); ++u) sum += lanes[u];
    for (; t < n; ++t) {
      row[t] = std::exp(row[t] - mnew);
      sum += row[t];
    }
    l[g] = l[g] * alpha + sum;
    m[g] = mnew;
    if (alpha != T(1)) {
      T* og = o + g * Dv;
      const Vec va(alpha);
      int64_t d = 0;
      for (; d + Vec::size() <= Dv; d += Vec::size()) (Vec::loadu(og + d) * va).store(og + d);
      for (; d < Dv; ++d) og[d] *= alpha;
    }
  }
  // o (G x Dv) += p (G x n) vt (n x Dv): column-major o^T (Dv x G) += vt^T (Dv x n) p^T (n x G)
  gemm('N', 'N', int(Dv), int(G), int(n), T(1), vt, int(Dv), s, int(n), T(1), o, int(Dv));
}

// The work: per (batch row, list head) a block of up to kRows consecutive query rows. Each row's listed keys are
// filtered (-1, past the causal bound, repeats), then bucketed by key window (kWindowKeys keys); the block then
// walks the windows in order and, within a window, every row's keys there. Rows of a block list keys from the same
// stretch of K/V at about the same time, so a key two rows list is read from cache the second time: the reads
// from memory fall by up to the rows' overlap (R K / Nk: 4x for 64 rows of 2,048 keys over 32K).
template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx, double scale,
         bool causal, int64_t offset, const T* sinks, int64_t tile, at::Tensor& out, at::Tensor& lse) {
  using Vec = at::vec::Vectorized<T>;
  const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Dv = v.size(3);
  const int64_t Nk = k.size(2);
  const int64_t Bi = idx.size(0), Hi = idx.size(1), K = idx.size(3);
  const bool shared = Hi == 1;
  const int64_t Hx = shared ? Hkv : Hq, G = shared ? Hq / Hkv : 1, rep = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  T* lp = lse.data_ptr<T>();
  const int64_t qsb = q.stride(0), qsh = q.stride(1), qsn = q.stride(2);
  const int64_t ksb = k.stride(0), ksh = k.stride(1), ksn = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vsn = v.stride(2);
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t R = std::max<int64_t>(1, std::min(Nq, kRows)), blocks = (Nq + R - 1) / R;
  const int64_t windows = std::max<int64_t>(1, (Nk + kWindowKeys - 1) / kWindowKeys);
  // Query heads sharing a list fill whole vectors: one key's scores for all of them are vector FMAs over D
  // (lanes_tile), with no copy of the keys and no BLAS packing; other groups take the BLAS products.
  const bool lanes = G % Vec::size() == 0;
  at::parallel_for(0, B * Hx * blocks, 1, [&](int64_t begin, int64_t end) {
    const qkv_blas::SequentialBlas one_thread;
    std::vector<T> kt(lanes ? 0 : tile * D), vt(lanes ? 0 : tile * Dv), s(G * tile);
    std::vector<T> qg(R * G * D), o(R * G * Dv), m(R * G), l(R * G);
    std::vector<int64_t> picked(K), keys(R * K), start(R * (windows + 1)), cursor(windows);
    std::vector<uint64_t> seen((Nk + 63) / 64, 0);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t blk = w % blocks, hx = (w / blocks) % Hx, b = w / (blocks * Hx);
      const int64_t i0 = blk * R, rows = std::min(R, Nq - i0);
      const int64_t h0 = shared ? hx * G : hx, kvh = shared ? hx : hx / rep;
      const T* kb = kp + b * ksb + kvh * ksh;
      const T* vb = vp + b * vsb + kvh * vsh;
      auto k_row = [&](int64_t j) { return kb + j * ksn; };
      auto v_row = [&](int64_t j) { return vb + j * vsn; };
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        T* qr = qg.data() + r * G * D;
        for (int64_t g = 0; g < G; ++g) {
          const T* src = qp + b * qsb + (h0 + g) * qsh + i * qsn;
          if (lanes) {  // transposed, scale folded in: qr[d * G + g] = scale * q[g, d]
            for (int64_t d = 0; d < D; ++d) qr[d * G + g] = T(scale) * src[d];
          } else {  // the group's query rows, contiguous for the GEMM
            std::memcpy(qr + g * D, src, D * sizeof(T));
          }
        }
        // this row's keys: -1, keys past the causal bound and repeats dropped, then bucketed by window
        const int64_t* list = ip + (((Bi == 1 ? 0 : b) * Hi + (shared ? 0 : hx)) * Nq + i) * K;
        const int64_t last = causal ? std::min(Nk - 1, i + offset) : Nk - 1;
        int64_t n = 0;
        int64_t* st = start.data() + r * (windows + 1);
        std::fill(st, st + windows + 1, 0);
        for (int64_t p2 = 0; p2 < K; ++p2) {
          const int64_t j = list[p2];
          if (j < 0 || j > last) continue;
          uint64_t& word = seen[j >> 6];
          const uint64_t bit = uint64_t(1) << (j & 63);
          if (word & bit) continue;  // a repeat counts once
          word |= bit;
          picked[n++] = j;
          ++st[j / kWindowKeys + 1];
        }
        for (int64_t t = 0; t < n; ++t) seen[picked[t] >> 6] = 0;  // forget this row's keys
        for (int64_t x = 0; x < windows; ++x) st[x + 1] += st[x];
        std::copy(st, st + windows, cursor.begin());
        for (int64_t t = 0; t < n; ++t) keys[r * K + cursor[picked[t] / kWindowKeys]++] = picked[t];
      }
      std::fill(o.begin(), o.begin() + rows * G * Dv, T(0));
      std::fill(m.begin(), m.begin() + rows * G, ninf);
      std::fill(l.begin(), l.begin() + rows * G, T(0));
      for (int64_t x = 0; x < windows; ++x) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t* st = start.data() + r * (windows + 1);
          for (int64_t a = st[x]; a < st[x + 1]; a += tile) {
            const int64_t n = std::min(tile, st[x + 1] - a);
            const int64_t* ks = keys.data() + r * K + a;
            T* or_ = o.data() + r * G * Dv;
            if (lanes) {
              lanes_tile<T>(qg.data() + r * G * D, ks, n, G, D, Dv, k_row, v_row, s.data(), or_, m.data() + r * G,
                            l.data() + r * G);
            } else {
              blas_tile<T>(qg.data() + r * G * D, ks, n, G, D, Dv, T(scale), k_row, v_row, kt.data(), vt.data(),
                           s.data(), or_, m.data() + r * G, l.data() + r * G);
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const T* orow = o.data() + r * G * Dv;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = h0 + g;
          const T mg = m[r * G + g], lg = l[r * G + g];
          T mt = mg, lt = lg, f = T(1);
          if (sinks != nullptr) {  // a NaN sink must reach lt: std::max would keep the other operand
            const T z = sinks[h];
            mt = std::isnan(z) ? z : std::max(mg, z);
            f = mg == ninf ? T(0) : std::exp(mg - mt);
            lt = lg * f + (z == ninf ? T(0) : std::exp(z - mt));  // a -inf sink adds nothing
          }
          T* dst = op + ((b * Hq + h) * Nq + i) * Dv;
          if (std::isnan(mt) || mt == -ninf || std::isnan(lt)) {  // a NaN or +inf score: never the empty marker
            std::fill(dst, dst + Dv, std::numeric_limits<T>::quiet_NaN());  // lse as the reference: +inf, else NaN
            lp[(b * Hq + h) * Nq + i] = mt == -ninf ? mt : std::numeric_limits<T>::quiet_NaN();
          } else if (lt > T(0)) {
            const T c = f / lt;
            if (lanes) {
              for (int64_t d = 0; d < Dv; ++d) dst[d] = orow[d * G + g] * c;
            } else {
              for (int64_t d = 0; d < Dv; ++d) dst[d] = orow[g * Dv + d] * c;
            }
            lp[(b * Hq + h) * Nq + i] = mt + std::log(lt);
          } else {
            std::fill(dst, dst + Dv, T(0));
            lp[(b * Hq + h) * Nq + i] = ninf;
          }
        }
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> gather_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& idx, double scale, bool causal, int64_t offset,
                                         const c10::optional<at::Tensor>& sinks, int64_t tile) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && idx.device().is_cpu(),
              "gather_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && idx.dim() == 4, "gather_attention: 4-D inputs");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "gather_attention: q, k, v of one dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "gather_attention: unit last stride");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous(), "gather_attention: contiguous int64 lists");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && (idx.size(1) == 1 || idx.size(1) == q.size(1)),
              "gather_attention: heads (Hkv >= 1, Hq % Hkv == 0, lists shared or per query head)");
  TORCH_CHECK(idx.size(0) == 1 || idx.size(0) == q.size(0), "gather_attention: list batch");
  TORCH_CHECK(idx.size(2) == q.size(2), "gather_attention: one list per query row");
  TORCH_CHECK(tile > 0, "gather_attention: tile > 0");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "gather_attention: batch");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2) && k.size(3) == q.size(3),
              "gather_attention: k (.., D) and v agree with q");
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor z;
  if (sinks.has_value()) {
    z = sinks->to(q.scalar_type()).contiguous();
    TORCH_CHECK(z.numel() == q.size(1), "gather_attention: one sink per query head");
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gather_attention", [&] {
    run<scalar_t>(q, k, v, idx, scale, causal, offset, z.defined() ? z.data_ptr<scalar_t>() : nullptr, tile, out,
                  lse);
  });
  return {out, lse};
}
