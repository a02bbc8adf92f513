// One decode step of a gated-delta mixer after its projections, in one call: the short causal convolution with
// SiLU, L2-normalised queries and keys (queries scaled), and the gated delta rule's update and read-out. The
// layer of Qwen3-Next / Qwen3.5 (Gated DeltaNet: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025,
// arXiv:2412.06464) and of Kimi Linear (KDA: Kimi Team, "Kimi Linear", 2025, arXiv:2510.26692); as torch ops the
// same step is some 35 small operator calls per layer, whose dispatch costs more than their arithmetic.
//
// Per batch row b: x = [conv_state[b] | mixed[b]] per channel (K taps), y = silu(sum_j w[c, j] x[c, j]), the new
// conv state the last K - 1 inputs. Channels are [q (Hk Dk) | k (Hk Dk) | v (H Dv)]; value head h reads key head
// h / (H / Hk). Per (b, h), with a = e^g (one per head, or one per key channel) and S the (Dk x Dv) state:
//   S <- a * S (rows),  u = beta (v - S^T k),  S <- S + k u^T,  o = S^T q
// (qkv/linear/gated_recurrent.py's step, the recurrence of issue 27, in the same order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void run(const T* mixed, const T* conv_state, const T* w, const T* g, const T* beta, const T* S0, T* conv_out,
         T* S, T* o, int64_t B, int64_t Cc, int64_t Kt, int64_t Hk, int64_t H, int64_t Dk, int64_t Dv, bool per_channel,
         T q_scale, T eps) {
  const int64_t Kp = Kt - 1, r = H / Hk;
  std::vector<T> y(B * Cc);
  for (int64_t b = 0; b < B; ++b) {  // the convolution: a few taps per channel
    for (int64_t c = 0; c < Cc; ++c) {
      const T* prev = conv_state + (b * Cc + c) * Kp;
      const T* wc = w + c * Kt;
      const T x = mixed[b * Cc + c];
      T acc = wc[Kp] * x;
      for (int64_t j = 0; j < Kp; ++j) acc += wc[j] * prev[j];
      y[b * Cc + c] = acc / (T(1) + std::exp(-acc));
      T* next = conv_out + (b * Cc + c) * Kp;
      for (int64_t j = 0; j + 1 < Kp; ++j) next[j] = prev[j + 1];
      if (Kp > 0) next[Kp - 1] = x;
    }
    for (int64_t kh = 0; kh < Hk; ++kh) {  // L2-normalised q (then scaled) and k, as fla and HF: eps in the root
      for (int64_t part = 0; part < 2; ++part) {
        T* v = y.data() + b * Cc + part * Hk * Dk + kh * Dk;
        T ss = 0;
        for (int64_t d = 0; d < Dk; ++d) ss += v[d] * v[d];
        const T f = (part == 0 ? q_scale : T(1)) / std::sqrt(ss + eps);
        for (int64_t d = 0; d < Dk; ++d) v[d] *= f;
      }
    }
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, Dk * Dv));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> kv(Dv), u(Dv), a(Dk);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, kh = h / r;
      const T* yq = y.data() + b * Cc + kh * Dk;
      const T* yk = yq + Hk * Dk;
      const T* yv = y.data() + b * Cc + 2 * Hk * Dk + h * Dv;
      const T* gh = g + bh * (per_channel ? Dk : 1);
      const T bt = beta[bh];
      const T* Sin = S0 + bh * Dk * Dv;
      T* Sout = S + bh * Dk * Dv;
      T* oh = o + bh * Dv;
      for (int64_t d = 0; d < Dk; ++d) a[d] = std::exp(gh[per_channel ? d : 0]);  // the decays, once
      std::fill(kv.begin(), kv.end(), T(0));
      for (int64_t d = 0; d < Dk; ++d) {  // kv = (a * S)^T k
        const T f = a[d] * yk[d];
        const T* row = Sin + d * Dv;
        for (int64_t e = 0; e < Dv; ++e) kv[e] += f * row[e];
      }
      for (int64_t e = 0; e < Dv; ++e) {
        u[e] = bt * (yv[e] - kv[e]);
        oh[e] = T(0);
      }
      for (int64_t d = 0; d < Dk; ++d) {  // S' = a * S + k u^T, o = S'^T q, one pass
        const T ad = a[d], kd = yk[d], qd = yq[d];
        const T* row = Sin + d * Dv;
        T* out = Sout + d * Dv;
        for (int64_t e = 0; e < Dv; ++e) {
          const T s = ad * row[e] + kd * u[e];
          out[e] = s;
          oh[e] += qd * s;
        }
      }
    }
  });
}

}  // namespace

// mixed (B, Cc) the projections [q | k | v]; conv_state (B, Cc, K - 1); conv_weight (Cc, K); g (B, H) or
// (B, H, Dk); beta (B, H); state (B, H, Dk, Dv). All contiguous CPU tensors of one floating dtype.
// Returns {o (B, H, Dv), the new conv state, the new state}; the inputs are not changed.
std::vector<at::Tensor> delta_decode(const at::Tensor& mixed, const at::Tensor& conv_state,
                                     const at::Tensor& conv_weight, const at::Tensor& g, const at::Tensor& beta,
                                     const at::Tensor& state, int64_t Hk, double q_scale, double eps) {
  for (const at::Tensor* t : {&mixed, &conv_state, &conv_weight, &g, &beta, &state}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "delta_decode: contiguous CPU tensors only");
    TORCH_CHECK(t->scalar_type() == mixed.scalar_type(), "delta_decode: one dtype");
  }
  TORCH_CHECK(mixed.dim() == 2 && conv_state.dim() == 3 && conv_weight.dim() == 2 && state.dim() == 4,
              "delta_decode: ranks");
  const int64_t B = mixed.size(0), Cc = mixed.size(1), Kt = conv_weight.size(1);
  const int64_t H = state.size(1), Dk = state.size(2), Dv = state.size(3);
  TORCH_CHECK(Hk > 0 && H % Hk == 0 && Cc == 2 * Hk * Dk + H * Dv, "delta_decode: channels [q | k | v]");
  TORCH_CHECK(conv_state.size(0) == B && conv_state.size(1) == Cc && conv_state.size(2) == Kt - 1 &&
                  conv_weight.size(0) == Cc && Kt >= 1, "delta_decode: convolution shapes");
  TORCH_CHECK(state.size(0) == B && beta.numel() == B * H, "delta_decode: state and beta");
  const bool per_channel = g.numel() == B * H * Dk && g.dim() == 3;
  TORCH_CHECK(per_channel || g.numel() == B * H, "delta_decode: g (B, H) or (B, H, Dk)");
  auto conv_out = at::empty_like(conv_state);
  auto S = at::empty_like(state);
  auto o = at::empty({B, H, Dv}, mixed.options());
  AT_DISPATCH_FLOATING_TYPES(mixed.scalar_type(), "delta_decode", [&] {
    run<scalar_t>(mixed.data_ptr<scalar_t>(), conv_state.data_ptr<scalar_t>(), conv_weight.data_ptr<scalar_t>(),
                  g.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), state.data_ptr<scalar_t>(),
                  conv_out.data_ptr<scalar_t>(), S.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), B, Cc, Kt, Hk, H,
                  Dk, Dv, per_channel, scalar_t(q_scale), scalar_t(eps));
  });
  return {o, conv_out, S};
}
