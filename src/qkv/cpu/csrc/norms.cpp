// RMS normalization (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", arXiv:1910.07467) of a decode
// step's few rows in one call: y = x / sqrt(mean(x^2) + eps) * (offset + w). torch's F.rms_norm on the CPU runs as
// five or six dispatched operators (pow, sum, div, add, rsqrt, mul), each costing more than a 512-wide row's
// arithmetic; this is one loop per row. The sum of squares is accumulated in double (torch's in the input dtype),
// so float32 results can differ from F.rms_norm's in the last bit, never by more. bfloat16 rows normalize in
// float32 and are rounded once at the end, as qkv.nn.RMSNorm's low-precision path (offset + weight in float32 too).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>

// x (..., D) float32/float64/bfloat16; weight (D,) of x's dtype; offset + weight is rounded once in that dtype (Gemma,
// Qwen3-Next), in float32 for bfloat16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: x (..., D) and a weight (D,) of x's dtype");
  auto xc = x.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t D = x.size(-1), rows = D ? xc.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    using op_t = at::opmath_type<scalar_t>;  // float for bfloat16, the dtype itself otherwise
    const scalar_t* px = xc.data_ptr<scalar_t>();
    const scalar_t* pw = w.data_ptr<scalar_t>();
    scalar_t* py = out.data_ptr<scalar_t>();
    const op_t off = static_cast<op_t>(offset);
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* a = px + r * D;
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight running sums, so the loop vectorizes
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) {
          for (int j = 0; j < 8; ++j) acc[j] += static_cast<double>(a[i + j]) * static_cast<double>(a[i + j]);
        }
        for (; i < D; ++i) acc[0] += static_cast<double>(a[i]) * static_cast<double>(a[i]);
        const double ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        const op_t inv = static_cast<op_t>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
        scalar_t* y = py + r * D;
        for (int64_t c = 0; c < D; ++c)
          y[c] = static_cast<scalar_t>((static_cast<op_t>(a[c]) * inv) * (off + static_cast<op_t>(pw[c])));
      }
    });
  });
  return out;
}
