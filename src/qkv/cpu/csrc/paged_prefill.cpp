// Attention of a step of several queries per row (a prompt chunk) over a paged KV cache, read from the block pools
// where the keys lie (PagedAttention: Kwon et al. 2023, arXiv:2309.06180), in spans of keys merged by an online
// softmax as in FlashAttention (Dao et al. 2022, arXiv:2205.14135): no view is gathered, no mask is built, and
// keys no query of a tile may see are never read.
//
// A work item is one (row, KV head, tile of the row's queries): the tile's G x n queries (the G query heads of the
// KV head, grouped-query attention reads each KV head once) are one matrix of up to kTileRows rows. The item walks
// the row's table; a block slot is taken when some query of the tile may see it (filled, not after the tile's last
// query if causal, inside the window of its first), so the keys past a causal chunk's tile are skipped unread. The
// taken keys and values are copied into a span buffer (kSpan keys, cache-resident); each span costs two products by
// the BLAS torch links (scores = Q K^T, then O += P V), and one softmax update per query row. Slots some query of
// the tile may not see (the chunk's diagonal, a window's edge, padding queries) are masked in the span's scores
// only where the span holds one.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "blas.h"
#include "paged.h"

namespace {

constexpr int64_t kSpan = 128;      // keys per span (whole blocks, or kSpan-key pieces of a longer block)
constexpr int64_t kTileRows = 128;  // query rows (heads x queries) per work item, at most (at least one query)

// scores s (M x n, row stride kSpan) = qs (M x D) times the span's keys: float32 by oneDNN's batch-reduce GEMM
// micro-kernel through torch (keys held transposed, (D, kSpan)), float64 by the BLAS (keys held (n, D)).
inline void scores(int M, int n, int D, const float* qs, const float* kt, float* s) {
  at::native::cpublas::brgemm(M, n, D, D, kSpan, kSpan, false, qs, kt, s);
}
inline void scores(int M, int n, int D, const double* qs, const double* kb, double* s) {
  qkv_blas::gemm('T', 'N', n, M, D, 1.0, kb, D, qs, D, 0.0, s, int(kSpan));
}
// o (M x Dv) += p (M x n, row stride kSpan) times the span's values vb (n x Dv).
inline void weigh(int M, int n, int Dv, const float* p, const float* vb, float* o) {
  at::native::cpublas::brgemm(M, Dv, n, kSpan, Dv, Dv, true, p, vb, o);
}
inline void weigh(int M, int n, int Dv, const double* p, const double* vb, double* o) {
  qkv_blas::gemm('N', 'N', Dv, M, n, 1.0, vb, Dv, p, int(kSpan), 1.0, o, Dv);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kpool, const at::Tensor& vpool, const at::Tensor& tables,
         const at::Tensor& kv_pos, const at::Tensor& q_pos, double scale, int64_t window, bool causal,
         const T* sinks, at::Tensor& out, at::Tensor& lse) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t P = kpool.size(0), Hkv = kpool.size(1), Tb = kpool.size(2), Dv = vpool.size(3);
  const int64_t NB = tables.size(1), G = Hq / Hkv;
  const int64_t QT = std::max<int64_t>(1, std::min<int64_t>(N, kTileRows / G)), tiles = (N + QT - 1) / QT;
  const T* qp = q.data_ptr<T>();
  const T* kp = kpool.data_ptr<T>();
  const T* vp = vpool.data_ptr<T>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* pos = kv_pos.data_ptr<int64_t>();
  const int64_t* qps = q_pos.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();  // (B, N, Hq, Dv)
  T* lp = lse.data_ptr<T>();  // (B, Hq, N)
  const int64_t qsb = q.stride(0), qsh = q.stride(1), qsn = q.stride(2);
  const int64_t psb = kv_pos.stride(0), qpsb = q_pos.stride(0), qpsn = q_pos.stride(1);
  const int64_t ksp = kpool.stride(0), ksh = kpool.stride(1), kst = kpool.stride(2);
  const int64_t vsp = vpool.stride(0), vsh = vpool.stride(1), vst = vpool.stride(2);
  const T ninf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, B * Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    qkv_blas::SequentialBlas sequential;  // this worker's products on this thread
    const int64_t Mmax = G * QT;
    std::vector<T> qs(Mmax * D), o(Mmax * Dv), s(Mmax * kSpan), m(Mmax), l(Mmax), kb(kSpan * D), vb(kSpan * Dv);
    std::vector<int64_t> qpos(Mmax), spos(kSpan);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (Hkv * tiles), h = (w / tiles) % Hkv, n0 = (w % tiles) * QT;
      const int64_t nq = std::min(QT, N - n0), M = G * nq;  // row r = g * nq + i: head h * G + g, query n0 + i
      int64_t qlo = std::numeric_limits<int64_t>::max(), qhi = -1;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t p = qps[b * qpsb + (n0 + i) * qpsn];
        for (int64_t g = 0; g < G; ++g) qpos[g * nq + i] = p;
        if (p >= 0) {
          qlo = std::min(qlo, p);
          qhi = std::max(qhi, p);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < nq; ++i) {
          const T* src = qp + b * qsb + (h * G + g) * qsh + (n0 + i) * qsn;
          T* dst = qs.data() + (g * nq + i) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = T(scale) * src[d];
        }
      }
      std::fill(o.begin(), o.begin() + M * Dv, T(0));
      std::fill(m.begin(), m.begin() + M, ninf);
      std::fill(l.begin(), l.begin() + M, T(0));
      auto maybe = [&](int64_t p) {  // some query of the tile may see the slot
        return p >= 0 && (!causal || p <= qhi) && (window <= 0 || qlo - p < window);
      };
      auto seen_by_all = [&](int64_t p) {  // every (non-padding) query of the tile sees it
        return p >= 0 && (!causal || p <= qlo) && (window <= 0 || qhi - p < window);
      };
      auto visible = [&](int64_t p, int64_t qq) {
        return p >= 0 && qq >= 0 && (!causal || p <= qq) && (window <= 0 || qq - p < window);
      };
      int64_t n = 0;       // keys in the span so far
      bool masked = false;  // the span holds a slot some query may not see
      auto flush = [&]() {
        // scores (M x n, row stride kSpan) = Qs (M x D) Kb^T: column-major, C^T = Kb Qs^T
        scores(int(M), int(n), int(D), qs.data(), kb.data(), s.data());
        // positions ascending through the span (as a row's cache holds them): a query's visible keys are one run
        // of slots, found by two binary searches; otherwise each slot is tested
        const bool ascending = masked && spos[0] >= 0 && std::is_sorted(spos.begin(), spos.begin() + n);
        for (int64_t r = 0; r < M; ++r) {
          T* sr = s.data() + r * kSpan;
          if (ascending) {
            const int64_t qq = qpos[r];
            int64_t a = 0, e = n;
            if (qq < 0) {
              e = 0;
            } else {
              if (causal) e = std::upper_bound(spos.begin(), spos.begin() + n, qq) - spos.begin();
              if (window > 0) a = std::lower_bound(spos.begin(), spos.begin() + n, qq - window + 1) - spos.begin();
              a = std::min(a, e);
            }
            std::fill(sr, sr + a, ninf);
            std::fill(sr + e, sr + n, ninf);
          } else if (masked) {
            for (int64_t t = 0; t < n; ++t) {
              if (!visible(spos[t], qpos[r])) sr[t] = ninf;
            }
          }
          const T a = qkv_paged::online_update<T>(sr, n, m[r], l[r]);
          T* orow = o.data() + r * Dv;
          if (a != T(1)) {
            const Vec va(a);
            int64_t d = 0;
            for (; d + L <= Dv; d += L) (Vec::loadu(orow + d) * va).store(orow + d);
            for (; d < Dv; ++d) orow[d] *= a;
          }
        }
        // O (M x Dv) += P (M x n) Vb (n x Dv): column-major, O^T += Vb^T P^T
        weigh(int(M), int(n), int(Dv), s.data(), vb.data(), o.data());
        n = 0;
        masked = false;
      };
      if (qhi >= 0) {
        const int64_t* row_pos = pos + b * psb;
        for (int64_t piece = 0, pieces = (Tb + kSpan - 1) / kSpan; piece < NB * pieces; ++piece) {
          const int64_t j = piece / pieces, lo = (piece % pieces) * kSpan, hi = std::min(Tb, lo + kSpan);  // slots
          const int64_t* pj = row_pos + j * Tb;
          int64_t first = hi, last = -1;
          for (int64_t t = lo; t < hi; ++t) {
            if (maybe(pj[t])) {
              first = std::min(first, t);
              last = t;
            }
          }
          if (last < 0) continue;  // no query of the tile sees these slots: they are not read
          const int64_t blk = tab[b * NB + j];
          const int64_t cnt = last - first + 1;
          if (n + cnt > kSpan) flush();
          const T* kblk = kp + blk * ksp + h * ksh;
          const T* vblk = vp + blk * vsp + h * vsh;
          if constexpr (std::is_same_v<T, float>) {  // keys (D, kSpan): the scores' right factor, row-major
            at::vec::transpose_mxn<T>(kblk + first * kst, kst, kb.data() + n, kSpan, int(cnt), int(D));
          } else {
            for (int64_t t = first; t <= last; ++t)
              std::memcpy(kb.data() + (n + t - first) * D, kblk + t * kst, D * sizeof(T));
          }
          if (vst == Dv) {
            std::memcpy(vb.data() + n * Dv, vblk + first * vst, cnt * Dv * sizeof(T));
          } else {
            for (int64_t t = first; t <= last; ++t)
              std::memcpy(vb.data() + (n + t - first) * Dv, vblk + t * vst, Dv * sizeof(T));
          }
          for (int64_t t = first; t <= last; ++t) {
            spos[n + t - first] = pj[t];
            masked = masked || !seen_by_all(pj[t]);
          }
          n += cnt;
        }
        if (n) flush();
      }
      for (int64_t r = 0; r < M; ++r) {
        const int64_t g = r / nq, i = r % nq, hq = h * G + g;
        T* dst = op + ((b * N + n0 + i) * Hq + hq) * Dv;
        T* lse_at = lp + (b * Hq + hq) * N + n0 + i;
        if (qpos[r] < 0) {  // a padding query: zeros, no sink
          std::fill(dst, dst + Dv, T(0));
          *lse_at = ninf;
          continue;
        }
        qkv_paged::finish_row<T>(o.data() + r * Dv, Dv, m[r], l[r], sinks == nullptr ? nullptr : sinks + hq, dst,
                                 lse_at);
      }
    }
  });
}

}  // namespace

// q (B, Hq, N, D), k_pool (P, Hkv, T, D), v_pool (P, Hkv, T, Dv) with unit last strides; tables (B, NB) int64;
// kv_pos (B, NB * T) int64, -1 where empty; q_pos (B, N) int64, -1 for padding queries (a row of either may be
// broadcast, stride 0); a slot is visible to a query at position >= 0 when filled, not after it if causal, inside the
// window (<= 0: none); sinks (Hq,) or None -> out (B, Hq, N, Dv) (a view of (B, N, Hq, Dv) memory), lse (B, Hq, N).
std::vector<at::Tensor> paged_prefill(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                      const at::Tensor& tables, const at::Tensor& kv_pos, const at::Tensor& q_pos,
                                      double scale, int64_t window, bool causal,
                                      const c10::optional<at::Tensor>& sinks) {
  const at::Tensor z = qkv_paged::check_args("paged_prefill", q, k_pool, v_pool, tables, kv_pos, q_pos, sinks);
  const int64_t B = q.size(0), N = q.size(2);
  auto out = at::empty({B, N, q.size(1), v_pool.size(3)}, q.options());
  auto lse = at::empty({B, q.size(1), N}, q.options());
  if (B * N > 0 && q.size(1) > 0) {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_prefill", [&] {
      run<scalar_t>(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal,
                    z.defined() ? z.data_ptr<scalar_t>() : nullptr, out, lse);
    });
  }
  return {out.permute({0, 2, 1, 3}), lse};
}
