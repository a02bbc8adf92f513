// One decode step of attention by positions in one call: each row's single query against its cached keys, keys
// allowed by their positions (real, not after the query when causal, inside the window), learnable sinks (GPT-OSS)
// as one more logit in the denominator. A contiguous cache (B, Hkv, S, D) is the paged-decode kernel's pool of B
// blocks of S slots, row b's table [b] (paged_decode.cpp): the query heads of a KV head read it once, in place,
// with no additive mask built and no heads folded.
#include <ATen/ATen.h>

#include <vector>

std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                     const at::Tensor& tables, const at::Tensor& kv_pos, const at::Tensor& q_pos,
                                     double scale, int64_t window, bool causal,
                                     const c10::optional<at::Tensor>& sinks);

// q (B, Hq, 1, D); k, v (B, Hkv, S, D); q_pos (B or 1, 1), kv_pos (B or 1, S) int64 (-1: padding or empty);
// window <= 0: none; sinks (Hq,) or None -> (B, Hq, 1, D).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                            const at::Tensor& kv_pos, bool causal, int64_t window,
                            const c10::optional<at::Tensor>& sinks, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                  v.size(-1) == q.size(-1) && q_pos.dim() == 2 && kv_pos.dim() == 2,
              "decode_attention: q (B, Hq, 1, D), k and v (B, Hkv, S, D) with Hkv >= 1, positions (B, 1) and (B, S)");
  const int64_t B = q.size(0), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && q_pos.scalar_type() == at::kLong &&
                  kv_pos.scalar_type() == at::kLong && q_pos.size(1) == 1 && kv_pos.size(1) == S &&
                  (q_pos.size(0) == 1 || q_pos.size(0) == B) && (kv_pos.size(0) == 1 || kv_pos.size(0) == B),
              "decode_attention: int64 positions (B or 1, 1) and (B or 1, S)");
  auto unit = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  auto kp = kv_pos.stride(1) == 1 ? kv_pos : kv_pos.contiguous();
  auto tables = at::arange(B, kv_pos.options()).view({B, 1});
  auto res = paged_decode(unit(q.select(2, 0)), unit(k), unit(v), tables, kp.expand({B, S}),
                          q_pos.select(1, 0).expand({B}), scale, window, causal, sinks);
  return res[0].unsqueeze(2);
}
