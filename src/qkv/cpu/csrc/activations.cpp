// SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202) in one pass over the fused
// gate-up projection: silu(gate) * up, where torch runs silu into a new tensor and then the product. Each value is
// computed as torch's CPU kernels compute it (silu as x / (1 + exp(-x)), vectorized over whole pairs of vectors from
// the start of a row and scalar in the row's tail, then one rounded product), so the result is the same bit for bit;
// the saving is the intermediate tensor's write and read.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>

// h (..., 2f) with unit last stride, gate in the first f channels -> (..., f) contiguous.
at::Tensor silu_mul(const at::Tensor& h) {
  TORCH_CHECK(h.dim() >= 1 && h.size(-1) % 2 == 0 && h.stride(-1) == 1, "silu_mul: h (..., 2f), unit last stride");
  TORCH_CHECK(h.scalar_type() == at::kFloat || h.scalar_type() == at::kDouble, "silu_mul: float32 or float64");
  const int64_t f = h.size(-1) / 2;
  auto sizes = h.sizes().vec();
  sizes.back() = f;
  auto out = at::empty(sizes, h.options());
  if (h.numel() == 0) return out;
  auto x = h.reshape({-1, h.size(-1)});  // a view wherever the leading dims allow
  const int64_t rows = x.size(0);
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "silu_mul", [&] {
    using Vec = at::vec::Vectorized<scalar_t>;
    constexpr int64_t L = Vec::size();
    const scalar_t* px = x.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    const int64_t rs = x.stride(0);
    const Vec one(scalar_t(1));
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(f, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* g = px + r * rs;
        const scalar_t* u = g + f;
        scalar_t* o = po + r * f;
        int64_t i = 0;
        for (; i + 2 * L <= f; i += 2 * L) {
          const Vec g0 = Vec::loadu(g + i), g1 = Vec::loadu(g + i + L);
          const Vec a0 = g0 / (one + g0.neg().exp()), a1 = g1 / (one + g1.neg().exp());
          (a0 * Vec::loadu(u + i)).store(o + i);
          (a1 * Vec::loadu(u + i + L)).store(o + i + L);
        }
        for (; i < f; ++i) {
          const scalar_t a = g[i] / (scalar_t(1) + std::exp(-g[i]));
          o[i] = a * u[i];
        }
      }
    });
  });
  return out;
}
