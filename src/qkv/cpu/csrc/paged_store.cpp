// One step's keys and values written into a paged KV cache's block pools (PagedAttention's block tables: Kwon et al.
// 2023, arXiv:2309.06180): each real token's (head, D) vectors copied to its block and slot, in one pass for keys
// and values, with no index tensors built per layer.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstring>

// k_pool (P, H, T, D), v_pool (P, H, T, Dv) with unit last strides; k (B, H, n, D), v (B, H, n, Dv) with unit last
// strides; blocks, offsets, src (m,) int64: token src[i] (b * n + t) goes to slot offsets[i] of block blocks[i].
void paged_store(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& blocks, const at::Tensor& offsets, const at::Tensor& src) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "paged_store: pools (P, H, T, D), k and v (B, H, n, D)");
  TORCH_CHECK(k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_pool.scalar_type() == k.scalar_type(),
              "paged_store: k, v and the pools of one dtype");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "paged_store: unit last strides");
  TORCH_CHECK(k.size(1) == k_pool.size(1) && v.size(1) == v_pool.size(1) && k.size(3) == k_pool.size(3) &&
                  v.size(3) == v_pool.size(3) && k.size(0) == v.size(0) && k.size(2) == v.size(2),
              "paged_store: k, v and the pools disagree in heads or head dims");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                  src.scalar_type() == at::kLong && blocks.is_contiguous() && offsets.is_contiguous() &&
                  src.is_contiguous() && blocks.numel() == offsets.numel() && blocks.numel() == src.numel(),
              "paged_store: blocks, offsets and src contiguous int64 of one length");
  const int64_t m = blocks.numel(), n = k.size(2), P = k_pool.size(0), T = k_pool.size(2), BN = k.size(0) * n;
  const int64_t* bl = blocks.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  const int64_t* sr = src.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(bl[i] >= 0 && bl[i] < P && of[i] >= 0 && of[i] < T && sr[i] >= 0 && sr[i] < BN,
                "paged_store: slot ", i, " (block ", bl[i], ", offset ", of[i], ", token ", sr[i],
                ") lies outside the pool of ", P, " blocks of ", T, " or the step's ", BN, " tokens");
  }
  const int64_t H = k.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "paged_store", [&] {
    auto copy = [&](at::Tensor& pool, const at::Tensor& x) {
      const int64_t D = x.size(3), bytes = D * sizeof(scalar_t);
      scalar_t* dst = pool.data_ptr<scalar_t>();
      const scalar_t* from = x.data_ptr<scalar_t>();
      const int64_t ps = pool.stride(0), ph = pool.stride(1), pt = pool.stride(2);
      const int64_t xb = x.stride(0), xh = x.stride(1), xt = x.stride(2);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t b = sr[i] / n, t = sr[i] % n;
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(dst + bl[i] * ps + h * ph + of[i] * pt, from + b * xb + h * xh + t * xt, bytes);
      }
    };
    copy(k_pool, k);
    copy(v_pool, v);
  });
}
