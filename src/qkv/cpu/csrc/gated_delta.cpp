// The gated delta rule by chunks, forward only: Gated DeltaNet (one log-decay per head and token) and Kimi Delta
// Attention (one per key channel), one (batch, head) sequence at a time with every chunk's work in cache.
//
// Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464), section 3.3 (the chunked WY/UT
// form); Kimi Team, "Kimi Linear", 2025 (arXiv:2510.26692) for per-channel gates. The algebra is the one
// qkv/linear/gated_chunk.py states and runs as batched torch ops; here a chunk's steps run back to back on
// buffers that stay in L1/L2 (a 64-token chunk of 128-wide keys is 32 KB), with MKL's GEMM and triangular solve,
// instead of each step sweeping all chunks through memory.
//
// Per chunk of n tokens, b_t the cumulative log-decay from the chunk's start (summed in double), S the state it
// starts from (Dk x Dv):
//   P[t, s] = sum_d q_td k_sd e^(b_td - b_sd), s <= t     A[t, s] = beta_t sum_d k_td k_sd e^(b_td - b_sd), s < t
//   [U | W] = (I + A)^-1 [beta V | beta K e^b]            u = U - W S
//   O = (Q e^b) S + P u                                   S' = e^(b_n) S + (K e^(b_n - b))^T u
// One decay per head: the scores are a GEMM times the (n x n) matrix e^(b_t - b_s). Per channel: the factored
// GEMM (Q e^b)(K e^-b)^T, exact while a chunk's log-decays stay within safe_log nats (e^-b finite, products
// within range): a chunk ends early where they would leave that range, and a single token beyond it forms each
// pair's sum with its own exponentials.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "blas.h"

namespace {

using qkv_blas::gemm;
using qkv_blas::trsm;

template <typename T>
void exp_inplace(T* x, int64_t n) {
  at::vec::map([](at::vec::Vectorized<T> a) { return a.exp(); }, x, x, n);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
         at::Tensor& S, at::Tensor& out, int64_t C, double safe_log) {
  const int64_t B = v.size(0), H = v.size(1), N = v.size(2), Dv = v.size(3);
  const int64_t Hk = k.size(1), Dk = k.size(3), rep = H / Hk;
  const bool per_channel = g.dim() == 4;
  const int64_t gw = per_channel ? Dk : 1;  // log-decays per token
  const int64_t w = Dv + Dk;                // row of [U | W]
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* gp = g.data_ptr<T>();
  const T* bp = beta.data_ptr<T>();
  T* Sp = S.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int ik = int(Dk), iv = int(Dv), iw = int(w);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const qkv_blas::SequentialBlas one_thread;
    std::vector<double> bc(C * gw);  // cumulative log-decays of the chunk
    std::vector<T> X(2 * C * Dk);   // rows [q e^b ; beta k e^b] (per head: [q ; beta k])
    std::vector<T> Kf(C * Dk);      // keys for the scores: k e^-b (per channel)
    std::vector<T> E(C * gw);       // e^b
    std::vector<T> G(2 * C * C);    // rows [P ; A]
    std::vector<T> Y(C * w);        // [beta V | beta K e^b], then [U | W], then [u | W]
    std::vector<T> Qe(per_channel ? 0 : C * Dk), Ke(C * Dk), tmp(std::max(C, Dk)), dec(Dk);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, kh = b * Hk + h / rep;
      const T* qh = qp + kh * N * Dk;
      const T* kh_ = kp + kh * N * Dk;
      const T* vh = vp + bh * N * Dv;
      const T* gh = gp + bh * N * gw;
      const T* betah = bp + bh * N;
      T* Sh = Sp + bh * Dk * Dv;
      T* oh = op + bh * N * Dv;
      for (int64_t c0 = 0, n = 0; c0 < N; c0 += n) {
        // cumulative log-decays in double; with per-channel gates the chunk ends early where they would leave
        // +-safe_log (a chunk is any run of tokens: the algebra holds for every split), so the factored scores
        // stay finite whatever the decay; only a single token beyond it takes the exact pairwise form
        const int64_t most = std::min(C, N - c0);
        const T* gc = gh + c0 * gw;
        double big = 0.0;
        n = 0;
        for (int64_t t = 0; t < most; ++t) {
          double row = 0.0;
          for (int64_t j = 0; j < gw; ++j) {
            const double x = (t ? bc[(t - 1) * gw + j] : 0.0) + double(gc[t * gw + j]);
            bc[t * gw + j] = x;
            row = std::max(row, std::abs(x));
          }
          if (per_channel && t > 0 && row > safe_log) break;
          big = std::max(big, row);
          n = t + 1;
        }
        const int in = int(n);
        const T* qc = qh + c0 * Dk;
        const T* kc = kh_ + c0 * Dk;
        const T* vc = vh + c0 * Dv;
        const T* bt = betah + c0;
        T* oc = oh + c0 * Dv;
        for (int64_t j = 0; j < n * gw; ++j) E[j] = T(bc[j]);
        exp_inplace(E.data(), n * gw);
        const bool factored = !per_channel || big <= safe_log;
        // X = [q e^b ; beta k e^b] (per channel) or [q ; beta k] (per head); Y = [beta v | beta k e^b]
        for (int64_t t = 0; t < n; ++t) {
          const T bet = bt[t];
          const T* qr = qc + t * Dk;
          const T* kr = kc + t * Dk;
          T* xq = X.data() + t * Dk;
          T* xk = X.data() + (n + t) * Dk;
          T* yv = Y.data() + t * w;
          T* yk = yv + Dv;
          for (int64_t d = 0; d < Dv; ++d) yv[d] = bet * vc[t * Dv + d];
          if (per_channel) {
            const T* e = E.data() + t * Dk;
            for (int64_t d = 0; d < Dk; ++d) {
              xq[d] = qr[d] * e[d];
              xk[d] = bet * kr[d] * e[d];
              yk[d] = xk[d];
            }
          } else {
            const T e = E[t];
            T* qe = Qe.data() + t * Dk;
            for (int64_t d = 0; d < Dk; ++d) {
              xq[d] = qr[d];
              xk[d] = bet * kr[d];
              yk[d] = xk[d] * e;
              qe[d] = qr[d] * e;
            }
          }
        }
        T* P = G.data();
        T* A = G.data() + n * n;
        if (factored) {
          const T* kf = kc;
          if (per_channel) {  // k e^-b
            for (int64_t j = 0; j < n * Dk; ++j) Kf[j] = T(-bc[j]);
            exp_inplace(Kf.data(), n * Dk);
            for (int64_t j = 0; j < n * Dk; ++j) Kf[j] *= kc[j];
            kf = Kf.data();
          }
          // [P ; A] (2n x n, row-major) = X Kf^T
          gemm('T', 'N', in, 2 * in, ik, T(1), kf, ik, X.data(), ik, T(0), G.data(), in);
          if (!per_channel) {  // times e^(b_t - b_s) on and below the diagonal
            for (int64_t t = 0; t < n; ++t) {
              T* pr = P + t * n;
              T* ar = A + t * n;
              for (int64_t s = 0; s <= t; ++s) tmp[s] = T(bc[t] - bc[s]);
              exp_inplace(tmp.data(), t + 1);
              for (int64_t s = 0; s <= t; ++s) {
                pr[s] *= tmp[s];
                ar[s] *= tmp[s];
              }
            }
          }
        } else {  // per channel, strong decay: each pair's sum with its own exponentials
          for (int64_t t = 0; t < n; ++t) {
            const T* qr = qc + t * Dk;
            const T* kt = kc + t * Dk;
            const T bet = bt[t];
            for (int64_t s = 0; s <= t; ++s) {
              const T* ks = kc + s * Dk;
              for (int64_t d = 0; d < Dk; ++d) tmp[d] = T(bc[t * Dk + d] - bc[s * Dk + d]);
              exp_inplace(tmp.data(), Dk);
              T sp = 0, sa = 0;
              for (int64_t d = 0; d < Dk; ++d) {
                sp += qr[d] * ks[d] * tmp[d];
                sa += kt[d] * ks[d] * tmp[d];
              }
              P[t * n + s] = sp;
              A[t * n + s] = bet * sa;
            }
          }
        }
        for (int64_t t = 0; t < n; ++t)  // P is causal: nothing above the diagonal (A's upper part is never read)
          std::fill(P + t * n + t + 1, P + (t + 1) * n, T(0));
        // [U | W] = (I + A)^-1 Y: Y^T (I + A)^T = R^T with (I + A)^T the unit upper column-major view of A
        trsm('R', 'U', 'N', 'U', iw, in, T(1), A, in, Y.data(), iw);
        T* U = Y.data();
        const T* W = Y.data() + Dv;
        const T* qe = per_channel ? X.data() : Qe.data();
        // O = (Q e^b) S + P u, with u = U - W S (both read the state the chunk starts from)
        gemm('N', 'N', iv, in, ik, T(1), Sh, iv, qe, ik, T(0), oc, iv);
        gemm('N', 'N', iv, in, ik, T(-1), Sh, iv, W, iw, T(1), U, iw);
        gemm('N', 'N', iv, in, in, T(1), U, iw, P, in, T(1), oc, iv);
        // S' = e^(b_n) S + (K e^(b_n - b))^T u
        const int64_t last = (n - 1) * gw;
        if (per_channel) {
          for (int64_t d = 0; d < Dk; ++d) dec[d] = E[last + d];
          if (factored) {  // k e^(b_n - b) = (k e^-b) e^(b_n)
            for (int64_t t = 0; t < n; ++t)
              for (int64_t d = 0; d < Dk; ++d) Ke[t * Dk + d] = Kf[t * Dk + d] * dec[d];
          } else {
            for (int64_t t = 0; t < n; ++t)
              for (int64_t d = 0; d < Dk; ++d) Ke[t * Dk + d] = T(bc[last + d] - bc[t * Dk + d]);
            exp_inplace(Ke.data(), n * Dk);
            for (int64_t j = 0; j < n * Dk; ++j) Ke[j] *= kc[j];
          }
        } else {
          std::fill(dec.begin(), dec.end(), E[last]);
          for (int64_t t = 0; t < n; ++t) tmp[t] = T(bc[last] - bc[t]);
          exp_inplace(tmp.data(), n);
          for (int64_t t = 0; t < n; ++t)
            for (int64_t d = 0; d < Dk; ++d) Ke[t * Dk + d] = kc[t * Dk + d] * tmp[t];
        }
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t e = 0; e < Dv; ++e) Sh[d * Dv + e] *= dec[d];
        gemm('N', 'T', iv, ik, in, T(1), U, iw, Ke.data(), ik, T(1), Sh, iv);
      }
    }
  });
}

}  // namespace

// q, k (B, Hk, N, Dk); v (B, H, N, Dv), H a multiple of Hk (value head h reads key head h / (H / Hk)); g (B, H, N)
// or (B, H, N, Dk) log-decays per token; beta (B, H, N); state (B, H, Dk, Dv). All contiguous, one floating dtype.
// safe_log: the largest |cumulative log-decay| a per-channel chunk may reach (qkv.linear.gated_chunk._SAFE_SPREAD).
// Returns {out (B, H, N, Dv), the final state}; the state given is not changed.
std::vector<at::Tensor> gated_delta_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                           int64_t chunk, double safe_log) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, &state}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "gated_delta_chunks: contiguous CPU tensors only");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "gated_delta_chunks: one dtype");
  }
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && v.dim() == 4, "gated_delta_chunks: q, k, v shapes");
  const int64_t B = v.size(0), H = v.size(1), N = v.size(2), Dk = k.size(3), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(2) == N && k.size(1) > 0 && H % k.size(1) == 0,
              "gated_delta_chunks: heads (Hk >= 1, H % Hk == 0)");
  TORCH_CHECK((g.dim() == 3 || (g.dim() == 4 && g.size(3) == Dk)) && g.size(0) == B && g.size(1) == H &&
                  g.size(2) == N, "gated_delta_chunks: g (B, H, N[, Dk])");
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == B && beta.size(1) == H && beta.size(2) == N,
              "gated_delta_chunks: beta (B, H, N)");
  TORCH_CHECK(state.dim() == 4 && state.size(0) == B && state.size(1) == H && state.size(2) == Dk &&
                  state.size(3) == Dv, "gated_delta_chunks: state (B, H, Dk, Dv)");
  TORCH_CHECK(chunk > 0 && safe_log > 0, "gated_delta_chunks: chunk > 0, safe_log > 0");
  auto S = state.clone();
  auto out = at::empty({B, H, N, Dv}, v.options());
  if (Dk == 0 || Dv == 0 || N == 0) {  // no key channel: nothing is read from or written to the state
    out.zero_();
    return {out, S};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_chunks", [&] {
    run<scalar_t>(q, k, v, g, beta, S, out, std::min(chunk, std::max<int64_t>(N, 1)), safe_log);
  });
  return {out, S};
}
