// Rotary position embedding (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding",
// arXiv:2104.09864) applied to one step's queries or keys in one call, with the values of qkv/pos/rope.py's
// apply_rotary bit for bit: out = x * cos + turned * sin, each product rounded, then the sum (the kernels build
// without contracted multiply-adds), turned the pairs (a, b) -> (-b, a). float32/float64 queries of (B, H, N, D)
// with cos/sin (B or 1, N, R) or (N, R) of their dtype take one vectorized pass (no turned copy, no products
// written and read back); other layouts and dtypes run apply_rotary's torch ops from C++ in the same order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

namespace {

template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, at::Tensor& out) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3), R = cos.size(-1), half = R / 2;
  const bool batched = cos.dim() == 3 && cos.size(0) > 1;
  const int64_t csb = batched ? cos.stride(0) : 0, csn = cos.stride(-2);
  const int64_t ssb = batched ? sin.stride(0) : 0, ssn = sin.stride(-2);
  const int64_t xsb = x.stride(0), xsh = x.stride(1), xsn = x.stride(2);
  const int64_t osb = out.stride(0), osh = out.stride(1), osn = out.stride(2);
  const T* px = x.data_ptr<T>();
  const T* pc = cos.data_ptr<T>();
  const T* ps = sin.data_ptr<T>();
  T* po = out.data_ptr<T>();
  at::parallel_for(0, B * H * N, std::max<int64_t>(1, 8192 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r % N, h = (r / N) % H, b = r / (N * H);
      const T* a = px + b * xsb + h * xsh + n * xsn;
      const T* c = pc + b * csb + n * csn;
      const T* s = ps + b * ssb + n * ssn;
      T* o = po + b * osb + h * osh + n * osn;
      if (interleaved) {  // pairs (2f, 2f + 1)
        for (int64_t f = 0; f < R; f += 2) {
          const T x0 = a[f], x1 = a[f + 1];
          o[f] = x0 * c[f] + (-x1) * s[f];
          o[f + 1] = x1 * c[f + 1] + x0 * s[f + 1];
        }
      } else {  // pairs (f, f + R / 2)
        int64_t f = 0;
        for (; f + L <= half; f += L) {
          const Vec x1 = Vec::loadu(a + f), x2 = Vec::loadu(a + half + f);
          (x1 * Vec::loadu(c + f) + x2.neg() * Vec::loadu(s + f)).store(o + f);
          (x2 * Vec::loadu(c + half + f) + x1 * Vec::loadu(s + half + f)).store(o + half + f);
        }
        for (; f < half; ++f) {
          const T x1 = a[f], x2 = a[half + f];
          o[f] = x1 * c[f] + (-x2) * s[f];
          o[half + f] = x2 * c[half + f] + x1 * s[half + f];
        }
      }
      std::copy(a + R, a + D, o + R);  // the channels past R pass through
    }
  });
}

}  // namespace

// x (..., H, N, D); cos, sin (..., N, R) broadcast over the heads; the first R channels rotate, the rest pass.
// Pairs are (2f, 2f + 1) when interleaved, else (f, f + R / 2).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t R = cos.size(-1), D = x.size(-1);
  TORCH_CHECK(R % 2 == 0 && R <= D, "rotary: rotary dim must be even and at most the head dim");
  const auto dtype = x.scalar_type();
  const bool fused = (dtype == at::kFloat || dtype == at::kDouble) && cos.scalar_type() == dtype &&
                     sin.scalar_type() == dtype && x.dim() == 4 && (cos.dim() == 2 || cos.dim() == 3) &&
                     cos.sizes() == sin.sizes() && cos.size(-2) == x.size(2) &&
                     (cos.dim() == 2 || cos.size(0) == 1 || cos.size(0) == x.size(0)) && x.stride(-1) == 1 &&
                     cos.stride(-1) == 1 && sin.stride(-1) == 1;
  if (fused) {
    auto out = at::empty_like(x);  // x's layout (a transposed projection stays one)
    AT_DISPATCH_FLOATING_TYPES(dtype, "rotary", [&] { rotate<scalar_t>(x, cos, sin, interleaved, out); });
    return out;
  }
  const auto work = (dtype == at::kFloat || dtype == at::kDouble) ? dtype : at::kFloat;
  auto c = cos.unsqueeze(-3), s = sin.unsqueeze(-3);
  auto xr = x.narrow(-1, 0, R).to(work);
  at::Tensor turned;  // each pair (a, b) -> (-b, a)
  if (interleaved) {
    turned = at::stack({xr.slice(-1, 1, R, 2).neg(), xr.slice(-1, 0, R, 2)}, -1).flatten(-2);
  } else {
    const int64_t half = R / 2;
    turned = at::cat({xr.narrow(-1, half, R - half).neg(), xr.narrow(-1, 0, half)}, -1);
  }
  auto out = xr * c.to(work) + turned * s.to(work);
  if (R < D) return at::cat({out.to(dtype), x.narrow(-1, R, D - R)}, -1);
  return out.to(dtype);
}
