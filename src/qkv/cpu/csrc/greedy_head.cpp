// Greedy tokens of an LM head without its float32 product: a bfloat16 screen, then the few candidates exactly.
//
// logits = x W^T (x: M rows of K, W: V x K float32); the token is the first index of each row's maximum. The head
// is the largest product of a decode step (32000 x 512 floats are 65 MB, read once per step), yet greedy decoding
// needs one index per row. Here W is held once in bfloat16 (half the bytes, multiplied by oneDNN's batch-reduce
// GEMM through torch, on AMX or AVX512-BF16 units) and every approximate logit a_n comes with a rigorous bound
// b_n on its distance from the float32 logit any float32 GEMM may give (|l_n - a_n| <= b_n); with L the largest
// lower bound a_n - b_n of a row, only tokens whose upper bound a_n + b_n reaches L can hold the row's maximum,
// and those few are recomputed in float64, the first largest winning. The bound (Higham, "Accuracy and Stability
// of Numerical Algorithms", 2nd ed., 2002, section 3.1: |fl(x.y) - x.y| <= gamma_K sum |x_k y_k|, gamma_K =
// K u / (1 - K u)) is Cauchy-Schwarz on the rounding of x and of W to bfloat16, plus gamma_K for the screen's
// own float32 accumulation and for the float32 GEMM it stands for:
//   b_n = |x| |w_n - wb_n| + |x - xb| |wb_n| + g (|xb| |wb_n| + |x| |w_n|) + K 2^-124,   g = K 2^-23 >= 2 gamma_K,
// the last term for products flushed to zero below float32's normal range (bfloat16 inputs below it are zeroed
// here first, so their rounding is in the norms). Rows whose input or screen is not finite are returned as not
// screened (ok false), for the caller's float32 path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // vocabulary entries per packed block
using Vec = at::vec::Vectorized<float>;
static_assert(kBlock % Vec::size() == 0, "a block is whole vectors");

inline float bf16_flushed(float v) {  // v rounded to bfloat16 (nearest even), zero below the normal range
  float r = static_cast<float>(c10::BFloat16(v));
  return std::fabs(r) < std::numeric_limits<float>::min() ? 0.0f : r;
}

inline float up(double v) {  // a float >= v
  float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, std::numeric_limits<float>::infinity());
}

constexpr float kRel = 1.0f / (1 << 20);  // covers the rounding of the bound's own float32 arithmetic

// the bound b = c1 A + c2 B + s of one vector of one row, widened by |a| 2^-20 and then by (1 + 2^-20)
inline Vec bound(const Vec& va, const float* A, const float* B, const Vec& c1, const Vec& c2, const Vec& s) {
  return ((c1 * Vec::loadu(A) + c2 * Vec::loadu(B)) + s + va.abs() * Vec(kRel)) * Vec(1.0f + kRel);
}

}  // namespace

// W (V, K) float32 -> {packed (V/kBlock rounded up, K, kBlock) bfloat16 in the VNNI layout of torch's brgemm,
// A (Vp) = |w_n - wb_n| + g |w_n|, B (Vp) = |wb_n|, as floats rounded up}; padding entries are zero.
std::vector<at::Tensor> screen_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "screen_pack: weight must be a contiguous float32 (V, K) tensor");
  const int64_t V = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0 && K > 0, "screen_pack: K must be even (bfloat16 pairs), got ", K);
  TORCH_CHECK(at::native::cpublas::could_pack(at::kBFloat16), "screen_pack: no bfloat16 GEMM on this CPU");
  const int64_t nb = (V + kBlock - 1) / kBlock, Vp = nb * kBlock;
  const double g = K * std::ldexp(1.0, -23);
  auto packed = at::empty({nb, K, kBlock}, weight.options().dtype(at::kBFloat16));
  auto A = at::zeros({Vp}, weight.options());
  auto B = at::zeros({Vp}, weight.options());
  const float* w = weight.data_ptr<float>();
  float* pa = A.data_ptr<float>();
  float* pb = B.data_ptr<float>();
  auto* out = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<at::BFloat16> block(K * kBlock);  // (K, kBlock) row-major, before the VNNI packing
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t n = b * kBlock + j;
        double err = 0, nwb = 0, nw = 0;
        for (int64_t k = 0; k < K; ++k) {
          const float v = n < V ? w[n * K + k] : 0.0f, r = bf16_flushed(v);
          block[k * kBlock + j] = c10::BFloat16(r);
          const double d = static_cast<double>(v) - r;
          err += d * d, nwb += static_cast<double>(r) * r, nw += static_cast<double>(v) * v;
        }
        if (n < V) {
          pa[n] = up((std::sqrt(err) + g * std::sqrt(nw)) * (1 + 1e-12));
          pb[n] = up(std::sqrt(nwb) * (1 + 1e-12));
        }
      }
      at::native::cpublas::pack(K, kBlock, kBlock, kBlock, at::kBFloat16, at::kBFloat16, block.data(),
                                out + b * K * kBlock);
    }
  });
  return {packed, A, B};
}

// x (M, K) float32 -> {tokens (M) int64, ok (M) bool, candidates (M) int64}: tokens of the screened rows (ok),
// and how many tokens each row recomputed.
std::vector<at::Tensor> screened_argmax(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                                        const at::Tensor& A, const at::Tensor& B) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "screened_argmax: x must be a contiguous float32 (M, K) tensor");
  const int64_t M = x.size(0), K = x.size(1), V = weight.size(0), nb = packed.size(0), Vp = nb * kBlock;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "screened_argmax: weight must be a contiguous float32 (V, K) tensor with x's K");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kBlock && nb * kBlock >= V &&
                  (nb - 1) * kBlock < V && A.numel() == Vp && B.numel() == Vp,
              "screened_argmax: packed/A/B do not come from screen_pack(weight)");
  auto tokens = at::zeros({M}, x.options().dtype(at::kLong));
  auto ok = at::zeros({M}, x.options().dtype(at::kBool));
  auto count = at::zeros({M}, x.options().dtype(at::kLong));
  if (M == 0) return {tokens, ok, count};
  const float* px = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* pa = A.data_ptr<float>();
  const float* pb = B.data_ptr<float>();
  const auto* pw = packed.data_ptr<at::BFloat16>();

  // per row: xb, c1 = |x|, c2 = |x - xb| + g |xb|, both rounded up; a row with a non-finite input is not screened
  const double g = K * std::ldexp(1.0, -23);
  const float slack = static_cast<float>(K * std::ldexp(1.0, -124));
  std::vector<at::BFloat16> xb(M * K);
  std::vector<float> c1(M), c2(M);
  std::vector<char> row_ok(M, 1);
  for (int64_t m = 0; m < M; ++m) {
    double nx = 0, nxb = 0, ex = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = px[m * K + k], r = bf16_flushed(v);
      xb[m * K + k] = c10::BFloat16(r);
      const double d = static_cast<double>(v) - r;
      nx += static_cast<double>(v) * v, nxb += static_cast<double>(r) * r, ex += d * d;
    }
    if (!std::isfinite(nx)) row_ok[m] = 0;
    c1[m] = up(std::sqrt(nx) * (1 + 1e-12));
    c2[m] = up((std::sqrt(ex) + g * std::sqrt(nxb)) * (1 + 1e-12));
    if (!std::isfinite(c1[m]) || !std::isfinite(c2[m])) row_ok[m] = 0;
  }

  // the screen: approximate logits (M, Vp); per thread and row, the largest lower bound a - b (as a vector) and
  // a vector that turns NaN where some a was NaN or infinite (a * 0)
  std::unique_ptr<float[]> a(new float[M * Vp]);  // every entry written by the screen
  constexpr int64_t L = Vec::size();
  const int threads = at::get_num_threads();
  std::vector<float> lo_acc(threads * M * L, -std::numeric_limits<float>::infinity());
  std::vector<float> nan_acc(threads * M * L, 0.0f);
  const Vec vs(slack), zero(0.0f);
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    const int t = at::get_thread_num();
    for (int64_t b = b0; b < b1; ++b) {
      float* ab = a.get() + b * kBlock;
      at::native::cpublas::brgemm(M, kBlock, K, K, kBlock, Vp, false, xb.data(), pw + b * K * kBlock, ab, true);
      const int64_t live = std::min(kBlock, V - b * kBlock);
      for (int64_t m = 0; m < M; ++m) {
        const float* am = ab + m * Vp;
        float* lo_m = lo_acc.data() + (t * M + m) * L;
        float* nan_m = nan_acc.data() + (t * M + m) * L;
        const Vec c1v(c1[m]), c2v(c2[m]);
        Vec lo = Vec::loadu(lo_m), bad = Vec::loadu(nan_m);
        for (int64_t j = 0; j < kBlock; j += L) {
          const Vec va = Vec::loadu(am + j);
          const Vec cand = va - bound(va, pa + b * kBlock + j, pb + b * kBlock + j, c1v, c2v, vs);
          if (j + L <= live) {
            lo = at::vec::maximum(lo, cand), bad = bad + va * zero;
          } else if (j < live) {  // the last block's padding entries take no part
            const int64_t n = live - j;
            lo = at::vec::maximum(lo, Vec::set(Vec(-std::numeric_limits<float>::infinity()), cand, n));
            bad = bad + Vec::set(zero, va, n) * zero;
          }
        }
        lo.store(lo_m), bad.store(nan_m);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });

  // the candidates of each row (upper bound a + b >= the row's largest lower bound), in float64, the first
  // largest winning
  int64_t* pt = tokens.data_ptr<int64_t>();
  bool* pok = ok.data_ptr<bool>();
  int64_t* pc = count.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float floor = -std::numeric_limits<float>::infinity();
      bool good = row_ok[m];
      for (int t = 0; t < threads; ++t)
        for (int64_t i = 0; i < L; ++i) {
          floor = std::max(floor, lo_acc[(t * M + m) * L + i]);
          good = good && nan_acc[(t * M + m) * L + i] == 0.0f;
        }
      if (!good || !std::isfinite(floor)) continue;
      const float* xm = px + m * K;
      const float* am = a.get() + m * Vp;
      const Vec c1v(c1[m]), c2v(c2[m]), vfloor(floor);
      double best = -std::numeric_limits<double>::infinity();
      int64_t arg = -1, seen = 0;
      for (int64_t j0 = 0; j0 < V; j0 += L) {
        const Vec va = Vec::loadu(am + j0);
        const Vec hi = va + bound(va, pa + j0, pb + j0, c1v, c2v, vs);
        int lanes = ~(hi >= vfloor).zero_mask() & ((1 << L) - 1);
        while (lanes) {
          const int i = __builtin_ctz(lanes);
          lanes &= lanes - 1;
          const int64_t n = j0 + i;
          if (n >= V) break;
          const float* wn = w + n * K;
          double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
          int64_t k = 0;
          for (; k + 4 <= K; k += 4) {
            s0 += static_cast<double>(xm[k]) * wn[k], s1 += static_cast<double>(xm[k + 1]) * wn[k + 1];
            s2 += static_cast<double>(xm[k + 2]) * wn[k + 2], s3 += static_cast<double>(xm[k + 3]) * wn[k + 3];
          }
          for (; k < K; ++k) s0 += static_cast<double>(xm[k]) * wn[k];
          const double v = (s0 + s1) + (s2 + s3);
          ++seen;
          if (arg < 0 || v > best) best = v, arg = n;
        }
      }
      if (arg < 0 || !std::isfinite(best)) continue;
      pt[m] = arg, pok[m] = true, pc[m] = seen;
    }
  });
  return {tokens, ok, count};
}
