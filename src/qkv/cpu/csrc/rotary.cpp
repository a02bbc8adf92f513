// Rotary position embedding (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding",
// arXiv:2104.09864) applied to one step's queries or keys in one call: the torch ops of qkv/pos/rope.py's
// apply_rotary, in the same order from C++, so the result is the same bit for bit. A decode step rotates a few
// rows per layer, where the fifteen-odd small ops cost far more in Python dispatch than in arithmetic.
#include <ATen/ATen.h>

// x (..., H, N, D); cos, sin (..., N, R) broadcast over the heads; the first R channels rotate, the rest pass.
// Pairs are (2f, 2f + 1) when interleaved, else (f, f + R / 2).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t R = cos.size(-1), D = x.size(-1);
  TORCH_CHECK(R % 2 == 0 && R <= D, "rotary: rotary dim must be even and at most the head dim");
  const auto dtype = x.scalar_type();
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
