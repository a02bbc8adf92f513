// What the paged-cache attention kernels (paged_decode.cpp, paged_prefill.cpp) check of their arguments alike.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace qkv_paged {

// q (B, Hq, D) with q_pos (B,), or q (B, Hq, N, D) with q_pos (B, N); k_pool (P, Hkv, T, D), v_pool (P, Hkv, T, Dv)
// with unit last strides, Hq % Hkv == 0; tables (B, NB) contiguous int64, kv_pos (B, NB * T) int64 (unit last
// stride); sinks (Hq,) or None. Returns the sinks in q's dtype, contiguous (undefined when None).
inline at::Tensor check_args(const char* fn, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                             const at::Tensor& tables, const at::Tensor& kv_pos, const at::Tensor& q_pos,
                             const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(), fn, ": CPU tensors only");
  TORCH_CHECK((q.dim() == 3 || q.dim() == 4) && q_pos.dim() == q.dim() - 2 && k_pool.dim() == 4 &&
                  v_pool.dim() == 4 && tables.dim() == 2 && kv_pos.dim() == 2,
              fn, ": q (B, Hq, [N,] D), pools (P, Hkv, T, D), tables (B, NB), kv_pos (B, NB * T), q_pos (B, [N])");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              fn, ": q and the pools of one dtype");
  TORCH_CHECK(q.stride(-1) == 1 && k_pool.stride(3) == 1 && v_pool.stride(3) == 1, fn, ": unit last strides");
  const int64_t B = q.size(0), NB = tables.size(1), Tb = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == q.size(-1) && v_pool.size(0) == k_pool.size(0) && v_pool.size(1) == k_pool.size(1) &&
                  v_pool.size(2) == Tb && k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0,
              fn, ": pools (P, Hkv, T, D) and (P, Hkv, T, Dv) agreeing with q (B, Hq, [N,] D), Hkv >= 1, Hq % Hkv == 0");
  TORCH_CHECK(tables.scalar_type() == at::kLong && kv_pos.scalar_type() == at::kLong &&
                  q_pos.scalar_type() == at::kLong && tables.is_contiguous() && kv_pos.stride(1) == 1,
              fn, ": int64 tables (contiguous) and positions (unit last stride)");
  TORCH_CHECK(tables.size(0) == B && kv_pos.size(0) == B && kv_pos.size(1) == NB * Tb && q_pos.size(0) == B &&
                  (q.dim() == 3 || q_pos.size(1) == q.size(2)),
              fn, ": tables (B, NB), kv_pos (B, NB * T), q_pos (B, [N])");
  // every entry, read or not, as the torch-op paths check the whole table (-1 is no "empty" marker here)
  const int64_t P = k_pool.size(0);
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * NB; ++i) {
    TORCH_CHECK(tab[i] >= 0 && tab[i] < P, fn, ": block id ", tab[i], " at table entry (", i / NB, ", ", i % NB,
                ") lies outside the pool of ", P, " blocks");
  }
  at::Tensor z;
  if (sinks.has_value() && sinks->defined()) {
    z = sinks->to(q.scalar_type()).contiguous();
    TORCH_CHECK(z.numel() == q.size(1), fn, ": one sink per query head");
  }
  return z;
}

// One online-softmax update (Milakov and Gimelshein 2018) of a query row by a span of n scores s: s becomes the
// span's probabilities exp(s - m'), the running maximum m and denominator l move to the span's, and the factor
// alpha = exp(m - m') that the row's accumulated output must be scaled by is returned. A span the row may see
// none of (every score -inf) leaves m and l as they were and its probabilities zeros (alpha 1); a NaN score
// spreads to l, so the row ends NaN.
template <typename T>
inline T online_update(T* s, int64_t n, T& m, T& l) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  const T ninf = -std::numeric_limits<T>::infinity();
  Vec vmx(ninf);
  int64_t t = 0;
  for (; t + L <= n; t += L) vmx = at::vec::maximum(vmx, Vec::loadu(s + t));
  T mx = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmx);
  for (; t < n; ++t) mx = std::isnan(s[t]) ? s[t] : std::max(mx, s[t]);
  if (mx == ninf && m == ninf) {
    std::fill(s, s + n, T(0));
    return T(1);
  }
  const T mnew = std::isnan(mx) ? mx : std::max(m, mx);
  const T a = m == ninf ? T(0) : std::exp(m - mnew);
  const Vec vm(mnew);
  Vec vsum(T(0));
  for (t = 0; t + L <= n; t += L) {
    const Vec e = (Vec::loadu(s + t) - vm).exp();
    e.store(s + t);
    vsum = vsum + e;
  }
  T sum = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mnew);
    sum += s[t];
  }
  l = l * a + sum;
  m = mnew;
  return a;
}

// A query row's result from its accumulated output o (Dv), running maximum m and denominator l: dst = o / l and
// *lse = m + log l, with a sink logit (sink != nullptr) as one more term of the denominator, with no value. A row
// with no visible key (l == 0, no sink) gives zeros and lse -inf, as the other paths; a NaN or +inf score left l NaN,
// and the row is NaN, as the contract says.
template <typename T>
inline void finish_row(const T* o, int64_t Dv, T m, T l, const T* sink, T* dst, T* lse) {
  const T ninf = -std::numeric_limits<T>::infinity();
  T mt = m, lt = l, f = T(1);
  if (sink != nullptr) {
    mt = std::isnan(*sink) ? *sink : std::max(m, *sink);
    f = m == ninf ? T(0) : std::exp(m - mt);
    lt = l * f + (*sink == ninf ? T(0) : std::exp(*sink - mt));  // a -inf sink adds nothing
  }
  if (std::isnan(mt) || mt == -ninf) {  // a NaN or +inf score: NaN, lse NaN or +inf as the reference has it
    std::fill(dst, dst + Dv, std::numeric_limits<T>::quiet_NaN());
    *lse = mt;
  } else if (lt != T(0)) {
    const T c = f / lt;
    for (int64_t d = 0; d < Dv; ++d) dst[d] = o[d] * c;
    *lse = mt + std::log(lt);
  } else {
    std::fill(dst, dst + Dv, T(0));
    *lse = ninf;
  }
}

}  // namespace qkv_paged
