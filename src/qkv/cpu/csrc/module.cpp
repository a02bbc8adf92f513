// The Python module of qkv's CPU kernels: one binding per kernel file in this folder.
#include <torch/extension.h>

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
                                        const at::Tensor& S, const at::Tensor& R, const at::Tensor& P);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_attention", &gather_attention, "attention over listed keys, read in place (CPU)");
  m.def("gated_delta_chunks", &gated_delta_chunks, "the gated delta rule by chunks, forward (CPU)");
  m.def("rows_linear", &rows_linear, "a few rows times a weight through row blocks, plus the bias (CPU)");
  m.def("moe_token", &moe_token, "one token's routed experts, ascending id, weighted and summed (CPU)");
  m.def("moe_grouped", &moe_grouped, "a few tokens' routed experts, grouped by expert (CPU)");
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up over a fused gate-up projection, one pass (CPU)");
  m.def("rotary", &rotary, "rotary position embedding of one step's queries or keys (CPU)");
  m.def("rms_norm", &rms_norm, "RMS normalization of a few rows, one loop per row (CPU)");
  m.def("decode_attention", &decode_attention, "one query per row over its cached keys by position (CPU)");
  m.def("paged_decode", &paged_decode, "one query per row over its blocks of a paged cache, read in place (CPU)");
  m.def("paged_prefill", &paged_prefill, "several queries per row over its blocks of a paged cache, in place (CPU)");
  m.def("paged_store", &paged_store, "a step's keys and values into their blocks and slots of a paged cache (CPU)");
  m.def("screen_pack", &screen_pack, "an LM head's int8 screen and its bound terms (CPU)");
  m.def("screened_argmax", &screened_argmax, "greedy tokens through the int8 screen, candidates in float64 (CPU)");
  m.def("delta_decode", &delta_decode, "a gated-delta mixer's decode step after its projections (CPU)");
}
