// qkv's CPU kernels as torch operators, qkv_cpu::<name>: every schema is declared here once, the CPU implementation
// is the kernel file's function, and under autograd each operator refuses inputs that require a gradient (none of
// them has a backward). Shapes for FakeTensor tracing and torch.compile are registered in Python
// (qkv/cpu/ops.py, torch.library.register_fake). No pybind: the library is loaded with torch.ops.load_library.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <vector>

std::vector<at::Tensor> gather_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& idx, double scale, bool causal, int64_t offset,
                                         const c10::optional<at::Tensor>& sinks, int64_t tile);
std::vector<at::Tensor> gated_delta_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                           int64_t chunk, double safe_log);
std::vector<at::Tensor> delta_decode(const at::Tensor& mixed, const at::Tensor& conv_state,
                                     const at::Tensor& conv_weight, const at::Tensor& g, const at::Tensor& beta,
                                     const at::Tensor& state, int64_t Hk, double q_scale, double eps);
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       int64_t nb);
at::Tensor weight_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias);
at::Tensor moe_token(const at::Tensor& x, const std::vector<int64_t>& ids, const at::Tensor& weights,
                     const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                     const c10::optional<at::Tensor>& down_bias, bool clamped, double alpha, double limit,
                     int64_t nb_gate_up, int64_t nb_down);
at::Tensor moe_grouped(const at::Tensor& x, const at::Tensor& token, const at::Tensor& weights,
                       const std::vector<int64_t>& counts, const at::Tensor& gate_up,
                       const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                       const c10::optional<at::Tensor>& down_bias, bool clamped, double alpha, double limit,
                       const std::vector<int64_t>& nb_gate_up, const std::vector<int64_t>& nb_down);
std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                     const at::Tensor& tables, const at::Tensor& kv_pos, const at::Tensor& q_pos,
                                     double scale, int64_t window, bool causal,
                                     const c10::optional<at::Tensor>& sinks);
std::vector<at::Tensor> paged_prefill(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                      const at::Tensor& tables, const at::Tensor& kv_pos, const at::Tensor& q_pos,
                                      double scale, int64_t window, bool causal,
                                      const c10::optional<at::Tensor>& sinks);
void paged_store(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& blocks, const at::Tensor& offsets, const at::Tensor& src);
at::Tensor silu_mul(const at::Tensor& h);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                            const at::Tensor& kv_pos, bool causal, int64_t window,
                            const c10::optional<at::Tensor>& sinks, double scale);
std::vector<at::Tensor> screen_pack(const at::Tensor& weight);
std::vector<at::Tensor> screened_argmax(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                                        const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                                        const at::Tensor& S, const at::Tensor& R, const at::Tensor& P,
                                        double cap, int64_t logit_bits);

namespace {

// The dispatcher hands int[] arguments over as ArrayRef; the kernels take vectors.
at::Tensor moe_token_op(const at::Tensor& x, c10::ArrayRef<int64_t> ids, const at::Tensor& weights,
                        const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
                        const at::Tensor& down, const c10::optional<at::Tensor>& down_bias, bool clamped,
                        double alpha, double limit, int64_t nb_gate_up, int64_t nb_down) {
  return moe_token(x, ids.vec(), weights, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit, nb_gate_up,
                   nb_down);
}

at::Tensor moe_grouped_op(const at::Tensor& x, const at::Tensor& token, const at::Tensor& weights,
                          c10::ArrayRef<int64_t> counts, const at::Tensor& gate_up,
                          const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                          const c10::optional<at::Tensor>& down_bias, bool clamped, double alpha, double limit,
                          c10::ArrayRef<int64_t> nb_gate_up, c10::ArrayRef<int64_t> nb_down) {
  return moe_grouped(x, token, weights, counts.vec(), gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit,
                     nb_gate_up.vec(), nb_down.vec());
}

void paged_store_op(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& blocks, const at::Tensor& offsets, const at::Tensor& src) {
  paged_store(k_pool, v_pool, k, v, blocks, offsets, src);
}

// Autograd kernel of every qkv_cpu operator: none has a backward, so an input that requires a gradient while grad
// mode is on is refused by name (a silently wrong or missing gradient is worse than an error); otherwise the call
// goes on below autograd to the CPU kernel.
void refuse_gradients(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto n = op.schema().arguments().size();
  if (at::GradMode::is_enabled()) {
    for (size_t i = stack->size() - n; i < stack->size(); ++i) {
      const auto& arg = (*stack)[i];
      bool grad = arg.isTensor() && arg.toTensor().requires_grad();
      if (arg.isTensorList()) {
        for (const at::Tensor& t : arg.toTensorList().vec()) grad = grad || t.requires_grad();
      }
      TORCH_CHECK(!grad, op.schema().name(), " has no backward: its argument '",
                  op.schema().arguments()[i - (stack->size() - n)].name(),
                  "' requires a gradient; call it under torch.no_grad() or on detached tensors, or use the torch-op "
                  "path (qkv.cpu.ops names each kernel's eligibility)");
    }
  }
  at::AutoDispatchBelowAutograd guard;
  op.callBoxed(stack);
}

}  // namespace

TORCH_LIBRARY(qkv_cpu, m) {
  m.def("gather_attention(Tensor q, Tensor k, Tensor v, Tensor idx, float scale, bool causal, int offset, "
        "Tensor? sinks, int tile) -> Tensor[]");
  m.def("gated_delta_chunks(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, int chunk, "
        "float safe_log) -> Tensor[]");
  m.def("delta_decode(Tensor mixed, Tensor conv_state, Tensor conv_weight, Tensor g, Tensor beta, Tensor state, "
        "int Hk, float q_scale, float eps) -> Tensor[]");
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias, int nb) -> Tensor");
  m.def("weight_linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("moe_token(Tensor x, int[] ids, Tensor weights, Tensor gate_up, Tensor? gate_up_bias, Tensor down, "
        "Tensor? down_bias, bool clamped, float alpha, float limit, int nb_gate_up, int nb_down) -> Tensor");
  m.def("moe_grouped(Tensor x, Tensor token, Tensor weights, int[] counts, Tensor gate_up, Tensor? gate_up_bias, "
        "Tensor down, Tensor? down_bias, bool clamped, float alpha, float limit, int[] nb_gate_up, "
        "int[] nb_down) -> Tensor");
  m.def("silu_mul(Tensor h) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor q_pos, Tensor kv_pos, bool causal, int window, "
        "Tensor? sinks, float scale) -> Tensor");
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor kv_pos, Tensor q_pos, "
        "float scale, int window, bool causal, Tensor? sinks) -> Tensor[]");
  m.def("paged_prefill(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor kv_pos, Tensor q_pos, "
        "float scale, int window, bool causal, Tensor? sinks) -> Tensor[]");
  m.def("paged_store(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor k, Tensor v, Tensor blocks, Tensor offsets, "
        "Tensor src) -> ()");
  m.def("screen_pack(Tensor weight) -> Tensor[]");
  m.def("screened_argmax(Tensor x, Tensor weight, Tensor packed, Tensor A, Tensor B, Tensor C, Tensor S, Tensor R, "
        "Tensor P, float cap=0.0, int logit_bits=24) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(qkv_cpu, CPU, m) {
  m.impl("gather_attention", &gather_attention);
  m.impl("gated_delta_chunks", &gated_delta_chunks);
  m.impl("delta_decode", &delta_decode);
  m.impl("rows_linear", &rows_linear);
  m.impl("weight_linear", &weight_linear);
  m.impl("moe_token", &moe_token_op);
  m.impl("moe_grouped", &moe_grouped_op);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_store", &paged_store_op);
  m.impl("screen_pack", &screen_pack);
  m.impl("screened_argmax", &screened_argmax);
}

TORCH_LIBRARY_IMPL(qkv_cpu, Autograd, m) {
  for (const char* name : {"gather_attention", "gated_delta_chunks", "delta_decode", "rows_linear", "weight_linear",
                           "moe_token", "moe_grouped", "silu_mul", "rotary", "rms_norm", "decode_attention", "paged_decode",
                           "paged_prefill", "paged_store", "screen_pack", "screened_argmax"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&refuse_gradients>());
  }
}
