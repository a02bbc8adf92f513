// The few-row product of a decode step: the weight in float32, or stored narrower, as bfloat16 or as int8 with one
// float32 scale per output channel (weight-only quantization, as in Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix
// Multiplication for Transformers at Scale", arXiv:2208.07339, section 3.1, without the outlier split).
//
// A decode step streams every weight from memory once, so its time is the weight's bytes over the bandwidth:
// bfloat16 halves them and int8 quarters them. A float32 weight is streamed the same way: for one or two rows torch's
// F.linear (MKL's single-row product) reads it at about half the rate and on one thread. No instruction of an AVX2 CPU multiplies either format, so each
// weight vector is widened in registers (bfloat16 -> float32 is a 16-bit shift; int8 -> int32 -> float32) and
// multiplied by the float32 rows with fused multiply-adds, the sums in float32. Row n of the output is
//   y[m, n] = s_n * sum_k x[m, k] w[n, k] + b_n   (s_n = 1 for bfloat16 and float32),
// the K-term sum in Vec-wide partial sums (Vec: at::vec::Vectorized<float>, 8 lanes on AVX2, 16 on AVX-512; two
// four interleaved sets of them for a one-row, one-weight-row tile, whose single chain of dependent multiply-adds
// would otherwise wait on itself) added across lanes at the end, then the tail. Blocks of output rows run on torch's intra-op threads (at::parallel_for,
// which runs inline inside another parallel region and on one thread under torch.set_num_threads(1)); a share below
// kGrainWeights weights stays on the calling thread (a small product is not worth waking the pool). x may be float32
// or bfloat16 (widened once); the output has x's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
// Weights per thread's share, at least: a product of fewer runs on the calling thread alone. On a busy CPU every
// parallel region waits for a descheduled worker (milliseconds), so small products are not worth the pool: 256K
// weights are 256 KB of int8 (512 KB of bfloat16), tens of microseconds on one core.
constexpr int64_t kGrainWeights = 1 << 18;
// Inputs from which a one- or two-row product reads four weight rows side by side (products()).
constexpr int64_t kLongRow = 4096;
// The same for two rows of a bfloat16 or int8 weight, whose widening costs instructions of its own: from K = 2048
// (Llama-3.2-1B's projections) one weight row at a time ran at half the rate of four (skinny_bf16).
constexpr int64_t kLongRowNarrow = 2048;

// Vec::size() weights from p, widened to float32.
inline Vec widen(const at::BFloat16* p) {  // a bfloat16 is the high half of its float32
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  float buf[kV];
  for (int64_t i = 0; i < kV; ++i) buf[i] = static_cast<float>(p[i]);
  return Vec::loadu(buf);
#endif
}

inline Vec widen(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float buf[kV];
  for (int64_t i = 0; i < kV; ++i) buf[i] = static_cast<float>(p[i]);
  return Vec::loadu(buf);
#endif
}

inline Vec widen(const float* p) { return Vec::loadu(p); }

inline float scalar(float v) { return v; }
inline float scalar(at::BFloat16 v) { return static_cast<float>(v); }
inline float scalar(int8_t v) { return static_cast<float>(v); }

inline float lanes(const Vec& v) {  // the lanes' sum
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  float buf[kV];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < kV; ++i) s += buf[i];
  return s;
#endif
}

// Outputs [n, n + NR) of rows [m, m + MR): x rows of K float32 (row stride K), w rows of K (row stride K);
// dot[i][j] = x[m + i] . w[n + j] in float32. A 1 x 1 tile keeps U = 4 sets of partial sums (Vec steps taken in
// turn) so that four multiply-add chains are in flight; larger tiles have MR x NR chains already.
template <int MR, int NR, typename W>
inline void tile(const float* x, const W* w, int64_t K, float dot[MR][NR]) {
  constexpr int U = MR * NR == 1 ? 4 : 1;
  Vec acc[U][MR][NR];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[u][i][j] = Vec(0.f);
  const int64_t main = K - K % kV;
  int64_t k = 0;
  for (; k + U * kV <= main; k += U * kV) {
    for (int u = 0; u < U; ++u) {
      Vec wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = widen(w + j * K + k + u * kV);
      for (int i = 0; i < MR; ++i) {
        const Vec xv = Vec::loadu(x + i * K + k + u * kV);
        for (int j = 0; j < NR; ++j) acc[u][i][j] = at::vec::fmadd(xv, wv[j], acc[u][i][j]);
      }
    }
  }
  for (; k < main; k += kV) {  // the Vec steps left over from the U-step loop
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = widen(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const Vec xv = Vec::loadu(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[0][i][j] = at::vec::fmadd(xv, wv[j], acc[0][i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      Vec a = acc[0][i][j];
      for (int u = 1; u < U; ++u) a = a + acc[u][i][j];
      float s = lanes(a);
      for (int64_t t = main; t < K; ++t) s += x[i * K + t] * scalar(w[j * K + t]);
      dot[i][j] = s;
    }
  }
}

// Outputs [n, n + NR) of rows [m, m + MR), scaled and biased, into out (row stride N).
template <int MR, int NR, typename W>
inline void emit(const float* x, const W* w, int64_t K, int64_t N, int64_t m, int64_t n, const float* scale,
                 const float* bias, float* out) {
  float dot[MR][NR];
  tile<MR, NR>(x + m * K, w + n * K, K, dot);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float s = scale ? scale[n + j] * dot[i][j] : dot[i][j];
      out[(m + i) * N + n + j] = bias ? s + bias[n + j] : s;
    }
}

// Outputs [n, n + NR) of every row: MR rows at a time (each widened weight vector feeds MR x NR accumulators;
// products() picks the tile by the row count), the last rows one by one.
template <int MR, int NR, typename W>
inline void rows_tile(const float* x, int64_t M, const W* w, int64_t K, int64_t N, int64_t n, const float* scale,
                      const float* bias, float* out) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) emit<MR, NR>(x, w, K, N, m, n, scale, bias, out);
  for (; m < M; ++m) emit<1, NR>(x, w, K, N, m, n, scale, bias, out);
}

template <int MR, int NR, typename W>
void products_tiled(const float* x, int64_t M, const W* w, int64_t K, int64_t N, const float* scale,
                    const float* bias, float* out) {
  const int64_t blocks = (N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(NR * K, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      if (n + NR <= N) {
        rows_tile<MR, NR>(x, M, w, K, N, n, scale, bias, out);
      } else {
        for (int64_t r = n; r < N; ++r) rows_tile<MR, 1>(x, M, w, K, N, r, scale, bias, out);
      }
    }
  });
}

template <typename W>
void products(const float* x, int64_t M, const W* w, int64_t K, int64_t N, const float* scale, const float* bias,
              float* out) {
  // One or two rows (a decode step's): the product is the weight's stream from memory. Short weight rows (K below
  // kLongRow: the QKV, output and up projections' K = 896 .. 2048) stream fastest one at a time; long ones (a down
  // projection's K = 4864 .. 8192) four side by side. Measured on the products of the 0.5B-1B shapes, weights cold
  // (benchmarks/skinny.py's skinny_stream table for float32): four short rows side by side ran at half the rate of
  // one, and one long row at 0.7-0.9 of four. From four rows the products, not the stream, set the time, and tiles
  // of several weight rows keep more accumulators busy.
#if defined(CPU_CAPABILITY_AVX512)
  if (M >= 8) {  // 32 registers: 8 x 3 accumulators, 3 widened weight vectors and a row of x
    products_tiled<8, 3>(x, M, w, K, N, scale, bias, out);
    return;
  }
#endif
  if (M >= 4) {
    products_tiled<4, 2>(x, M, w, K, N, scale, bias, out);
  } else if (M >= 2) {
    if (K >= (std::is_same_v<W, float> ? kLongRow : kLongRowNarrow)) {
      products_tiled<2, 4>(x, M, w, K, N, scale, bias, out);
    } else {
      products_tiled<2, 1>(x, M, w, K, N, scale, bias, out);
    }
  } else if (K >= kLongRow) {
    products_tiled<1, 4>(x, M, w, K, N, scale, bias, out);
  } else {
    products_tiled<1, 1>(x, M, w, K, N, scale, bias, out);
  }
}

}  // namespace

// x (..., K) float32 or bfloat16; weight (N, K) contiguous, float32 or bfloat16 (scale None) or int8 (scale (N,) float32);
// bias (N,) or None (any floating dtype, used in float32) -> (..., N) in x's dtype.
at::Tensor weight_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1),
              "weight_linear: x (..., K) and a weight (N, K), got x ", x.sizes(), " and weight ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "weight_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "weight_linear: the weight must be contiguous");
  const bool has_scale = scale.has_value() && scale->defined();
  const int64_t K = x.size(-1), N = weight.size(0);
  if (weight.scalar_type() == at::kChar) {
    TORCH_CHECK(has_scale && scale->dim() == 1 && scale->size(0) == N && scale->scalar_type() == at::kFloat,
                "weight_linear: an int8 weight needs scale (N,) float32, one per output channel");
  } else {
    TORCH_CHECK((weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) && !has_scale,
                "weight_linear: the weight must be float32 or bfloat16 (no scale) or int8 (with scale), got ",
                weight.scalar_type(), has_scale ? " with a scale" : "");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N && bias->is_floating_point()),
              "weight_linear: bias must be (N,) floating or None");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  int64_t R = 1;
  for (size_t d = 0; d + 1 < sizes.size(); ++d) R *= sizes[d];
  if (K == 0 || R == 0 || N == 0) {  // an empty sum: the bias, or zeros
    auto out = at::zeros({R, N}, x.options().dtype(at::kFloat));
    if (has_bias && K == 0) out.copy_(bias->to(at::kFloat).expand({R, N}));
    return out.to(x.scalar_type()).view(sizes);
  }
  // A decode step makes about a hundred of these calls: bfloat16 rows, bias and results are widened and narrowed
  // here in plain loops (a few hundred values), not by dispatched dtype conversions.
  const auto floats = [](const at::Tensor& t, std::vector<float>& buf) -> const float* {
    if (t.scalar_type() == at::kFloat) return t.data_ptr<float>();
    buf.resize(t.numel());
    if (t.scalar_type() == at::kBFloat16) {
      const at::BFloat16* p = t.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < t.numel(); ++i) buf[i] = static_cast<float>(p[i]);
    } else {
      auto f = t.to(at::kFloat);
      std::copy(f.data_ptr<float>(), f.data_ptr<float>() + f.numel(), buf.begin());
    }
    return buf.data();
  };
  auto xc = x.reshape({R, K}).contiguous();
  auto bc = has_bias ? bias->contiguous() : at::Tensor();
  auto sf = has_scale ? scale->contiguous() : at::Tensor();
  std::vector<float> xbuf, bbuf, obuf;
  const float* px = floats(xc, xbuf);
  const float* pb = has_bias ? floats(bc, bbuf) : nullptr;
  const float* ps = has_scale ? sf.data_ptr<float>() : nullptr;
  auto out = at::empty({R, N}, x.options());
  const bool narrow = x.scalar_type() != at::kFloat;
  if (narrow) obuf.resize(R * N);
  float* po = narrow ? obuf.data() : out.data_ptr<float>();
  if (weight.scalar_type() == at::kChar) {
    products(px, R, weight.data_ptr<int8_t>(), K, N, ps, pb, po);
  } else if (weight.scalar_type() == at::kFloat) {
    products(px, R, weight.data_ptr<float>(), K, N, ps, pb, po);
  } else {
    products(px, R, weight.data_ptr<at::BFloat16>(), K, N, ps, pb, po);
  }
  if (narrow) {  // bfloat16 rows: the float32 sums rounded once (round to nearest even)
    at::BFloat16* y = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < R * N; ++i) y[i] = static_cast<at::BFloat16>(obuf[i]);
  }
  return out.view(sizes);
}
