// The few-row products of a decode step, and a one-token mixture-of-experts feed-forward, each in one call.
//
// A decode step multiplies one row per sequence by every weight. The row-block product of qkv/cpu/skinny.py
// (by_rows: the weight's output rows cut into nb blocks, strided views of the same storage, one batched GEMM)
// is some ten tensor operations written in Python, whose dispatch costs a tenth of a small product; here the
// same ATen calls run in the same order from C++, so the results are those of the Python path bit for bit.
// moe_token runs a single token's k routed experts (ascending expert id, qkv/nn/moe.py's order) through the same
// products and the experts' activation: SwiGLU (act(gate) * up, act SiLU) or GPT-OSS's clamped form
// ((clamp(up) + 1) * min(gate, limit) * sigmoid(alpha * min(gate, limit))), each written as the torch ops of
// qkv/nn/moe.py. moe_grouped runs each expert's rows the same way.
//
// Threads: the experts of one call run side by side in one parallel region of torch's pool (at::parallel_for over
// the experts, on the calling thread alone when they are small: expert_grain; the ATen calls inside run on their
// worker thread alone, as nested regions do), then their
// results are added in ascending expert id on the calling thread. One region a call instead of a few per expert:
// on a busy CPU every region waits for a descheduled worker, and an expert's few rows are too small to split.
// Each expert's products and activation are the same calls as on one thread, so the values are unchanged.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace {

// x2 (M, K) @ weight (N, K)^T through nb row blocks of a contiguous weight (nb <= 1: at::linear) -> (M, N).
at::Tensor rows_product(const at::Tensor& x2, const at::Tensor& weight, int64_t nb) {
  if (nb <= 1) return at::linear(x2, weight);
  const int64_t rows = x2.size(0), K = x2.size(1), N = weight.size(0);
  const int64_t block = N / nb, main = nb * block;
  auto blocks = weight.narrow(0, 0, main).view({nb, block, K});
  auto xt = x2.t().expand({nb, K, rows});
  auto out = at::empty({rows, N}, x2.options());
  if (rows == 1) {
    auto dst = out.narrow(1, 0, main).view({nb, block, 1});
    at::bmm_out(dst, blocks, xt);
  } else {
    out.narrow(1, 0, main).copy_(at::bmm(blocks, xt).view({main, rows}).t());
  }
  if (main < N) out.narrow(1, main, N - main).copy_(at::linear(x2, weight.narrow(0, main, N - main)));
  return out;
}

}  // namespace

at::Tensor weight_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias);

namespace {

// rows_product with the bias: at::linear's fused bias where there are no blocks, as F.linear on the Python path;
// nb = 0: the weight streamed by weight_linear (weight_linear.cpp), as qkv.cpu.gemm.linear takes a decode step's
// float32 product.
at::Tensor product(const at::Tensor& x2, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t nb) {
  if (nb == 0) return weight_linear(x2, weight, c10::nullopt, bias);
  const bool has_bias = bias.has_value() && bias->defined();
  if (nb <= 1) return has_bias ? at::linear(x2, weight, *bias) : at::linear(x2, weight);
  auto out = rows_product(x2, weight, nb);
  if (has_bias) out.add_(*bias);
  return out;
}

c10::optional<at::Tensor> select(const c10::optional<at::Tensor>& stacked, int64_t e) {
  if (!stacked.has_value() || !stacked->defined()) return c10::nullopt;
  return stacked->select(0, e);
}

// Expert e on rows x (n, d): down(act(gate_up(x))) with its biases, as qkv/nn/moe.py's loops write it -> (n, d).
at::Tensor expert(const at::Tensor& x, int64_t e, const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
                  const at::Tensor& down, const c10::optional<at::Tensor>& down_bias, bool clamped, double alpha,
                  double limit, int64_t nb_gate_up, int64_t nb_down) {
  const int64_t f = gate_up.size(1) / 2;
  auto gu = product(x, gate_up.select(0, e), select(gate_up_bias, e), nb_gate_up);  // (n, 2f)
  auto gate = gu.narrow(1, 0, f), up = gu.narrow(1, f, f);
  at::Tensor h;
  if (clamped) {
    auto g = at::clamp(gate, c10::nullopt, limit);
    auto u = up.clamp(-limit, limit);
    h = (u + 1) * g * at::sigmoid(g * alpha);
  } else {
    h = at::silu(gate) * up;
  }
  return product(h, down.select(0, e), select(down_bias, e), nb_down);
}

// Experts a thread's share holds, at least: an expert of width d, hidden f and n rows is 3 n f d multiply-adds, and
// shares below 2^20 stay on the calling thread (small experts are not worth a parallel region).
int64_t expert_grain(int64_t d, int64_t f, int64_t n) {
  const int64_t work = std::max<int64_t>(1, 3 * std::max<int64_t>(n, 1) * f * d);
  return std::max<int64_t>(1, ((int64_t(1) << 20) + work - 1) / work);
}

}  // namespace

// x (..., K) @ weight (N, K)^T (+ bias) -> (..., N), as qkv.cpu.skinny.by_rows then the bias.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       int64_t nb) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) && weight.is_contiguous(),
              "rows_linear: x (..., K) and a contiguous weight (N, K)");
  const int64_t K = x.size(-1), N = weight.size(0);
  const int64_t rows = K ? x.numel() / K : 0;
  auto out = product(x.reshape({rows, K}), weight, bias, nb);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return out.view(sizes);
}

// One token's routed experts: x (1, d); ids, weights (k,) the chosen experts and their router weights (float32);
// gate_up (E, 2f, d) and down (E, d, f) stacked (biases (E, 2f), (E, d) or None); clamped: GPT-OSS's activation
// with alpha and limit, else SiLU(gate) * up; nb_gate_up, nb_down: row blocks of the two products (1: at::linear,
// 0: the weight streamed).
at::Tensor moe_token(const at::Tensor& x, const std::vector<int64_t>& ids, const at::Tensor& weights,
                     const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                     const c10::optional<at::Tensor>& down_bias, bool clamped, double alpha, double limit,
                     int64_t nb_gate_up, int64_t nb_down) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && gate_up.dim() == 3 && down.dim() == 3 &&
                  weights.numel() == static_cast<int64_t>(ids.size()),
              "moe_token: x (1, d), ids and weights (k,), gate_up (E, 2f, d), down (E, d, f)");
  std::vector<std::pair<int64_t, int64_t>> order;  // (expert, slot), ascending expert id
  for (size_t j = 0; j < ids.size(); ++j) {
    TORCH_CHECK(ids[j] >= 0 && ids[j] < gate_up.size(0), "moe_token: expert id ", ids[j], " outside [0, ",
                gate_up.size(0), ")");  // -1 would select the last expert
    order.emplace_back(ids[j], static_cast<int64_t>(j));
  }
  std::sort(order.begin(), order.end());
  std::vector<at::Tensor> ys(order.size());
  const at::ThreadLocalState caller;  // the workers dispatch as the caller does (below autograd, inference mode)
  const int64_t grain = expert_grain(x.size(1), gate_up.size(1) / 2, 1);
  at::parallel_for(0, static_cast<int64_t>(order.size()), grain, [&](int64_t i0, int64_t i1) {
    at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t i = i0; i < i1; ++i) {
      ys[i] = expert(x, order[i].first, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit, nb_gate_up,
                     nb_down);
    }
  });
  auto out = at::zeros_like(x);
  for (size_t i = 0; i < order.size(); ++i) {
    out.add_((ys[i] * weights.narrow(0, order[i].second, 1)).to(out.scalar_type()));
  }
  return out;
}

// Tokens grouped by expert (the loop of qkv/nn/moe.py for more than one token): x (T, d); token (A,) int64 the token
// of each assignment, grouped by expert in ascending id; weights (A,) their router weights in the same order; counts
// (E,) assignments per expert; nb_gate_up, nb_down (E,) row blocks of each expert's products for its row count.
// Per expert with tokens: out.index_add_(0, t, (down(act(gate_up(x[t]))) * w).to(out's dtype)).
at::Tensor moe_grouped(const at::Tensor& x, const at::Tensor& token, const at::Tensor& weights,
                       const std::vector<int64_t>& counts, const at::Tensor& gate_up,
                       const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                       const c10::optional<at::Tensor>& down_bias, bool clamped, double alpha, double limit,
                       const std::vector<int64_t>& nb_gate_up, const std::vector<int64_t>& nb_down) {
  const int64_t E = gate_up.size(0);
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && static_cast<int64_t>(counts.size()) == E &&
                  static_cast<int64_t>(nb_gate_up.size()) == E && static_cast<int64_t>(nb_down.size()) == E &&
                  token.numel() == weights.numel(),
              "moe_grouped: x (T, d), token and weights (A,), counts and row blocks (E,)");
  int64_t assigned = 0;
  for (const int64_t n : counts) {
    TORCH_CHECK(n >= 0, "moe_grouped: a negative count");
    assigned += n;
  }
  TORCH_CHECK(assigned == token.numel(), "moe_grouped: counts sum to ", assigned, ", not the ", token.numel(),
              " assignments");
  std::vector<int64_t> active, starts;  // experts with rows, ascending, and where their assignments start
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] > 0) {
      active.push_back(e);
      starts.push_back(start);
    }
    start += counts[e];
  }
  std::vector<at::Tensor> ys(active.size());
  const at::ThreadLocalState caller;  // the workers dispatch as the caller does (below autograd, inference mode)
  const int64_t grain = expert_grain(x.size(1), gate_up.size(1) / 2, active.empty() ? 1 : assigned / active.size());
  at::parallel_for(0, static_cast<int64_t>(active.size()), grain, [&](int64_t i0, int64_t i1) {
    at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = active[i];
      auto t = token.narrow(0, starts[i], counts[e]);
      ys[i] = expert(x.index_select(0, t), e, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit,
                     nb_gate_up[e], nb_down[e]);
    }
  });
  auto out = at::zeros_like(x);
  for (size_t i = 0; i < active.size(); ++i) {
    const int64_t e = active[i];
    out.index_add_(0, token.narrow(0, starts[i], counts[e]),
                   (ys[i] * weights.narrow(0, starts[i], counts[e]).unsqueeze(1)).to(out.scalar_type()));
  }
  return out;
}
