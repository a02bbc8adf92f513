// Greedy tokens of an LM head without its float32 product: an int8 screen, then the few candidates exactly.
//
// logits = x W^T (x: M rows of K, W: V x K float32); the token is the first index of each row's maximum. The head
// is the largest product of a decode step (32000 x 512 floats are 65 MB, read once per step), yet greedy decoding
// needs one index per row. Here W is held once more in int8, a quarter of its bytes (row n as s_n q_n: q_n integers
// in [-127, 127], s_n = max |w_n| / 127), and each row of x as t x~ (x~ integers in [-127, 127], t = max |x| / 127,
// one plane of unsigned bytes, where that keeps the row's error near the head's and more than kFewRows rows share
// the call; else x~ in [-32767, 32767], t = max |x| / 32767, as two planes); oneDNN's batch-reduce GEMM through
// torch (AMX or AVX512-VNNI units) gives D_n = x~ . q_n exactly in integers, and a_n = t s_n D_n is the approximate
// logit. Where torch has no int8 GEMM for this CPU (AVX2 without VNNI: could_pack(kChar) is false) the same
// integers come from plane_sums below: each byte plane and the head's int8 entries widened to 16 bits and
// multiplied in pairs (vpmaddwd: u * q <= 255 * 127, a pair's sum fits in 16 x 16 -> 32 bits without saturation),
// summed in int32, the head packed for it in pairs of inputs instead of the VNNI layout. Every a_n comes with a rigorous bound b_n on its distance from the float32 logit l_n that any float32 GEMM
// may give (|l_n - a_n| <= b_n): with L the largest lower bound a_n - b_n of a row, only tokens whose upper bound
// a_n + b_n reaches L can hold the row's maximum, and those few are recomputed in float64, the first largest
// winning. The bound is Cauchy-Schwarz on the two quantizations,
// x . w_n - t x~ . s_n q_n = (x - t x~) . w_n + t x~ . (w_n - s_n q_n), plus the float32 GEMM's own accumulation
// error (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002, section 3.1:
// |fl(x.y) - x.y| <= gamma_K sum |x_k y_k| <= gamma_K |x| |y|, gamma_K = K u / (1 - K u)):
//   b_n = (|x - t x~| + g |x|) |w_n| + min(|t x~| |w_n - s_n q_n|, |t x~|_1 |w_n - s_n q_n|_inf) + K 2^-124,
// g = K 2^-23 >= gamma_K (norms are Euclidean but where marked: the second term is also Hoelder's with 1 and inf
// norms, tighter where x has a few large entries, as real hidden states do),
// the last term for products a float32 GEMM may flush to zero below the normal range; a_n's own rounding (two
// double products, one float conversion) and the bound's float32 arithmetic are covered by widening b_n by
// |a_n| 2^-20 and then by (1 + 2^-20). The int32 sums are exact while K (255 * 127) < 2^31, so K is at most
// kMaxK. Rows whose input or approximate logits are not finite are returned as not screened (ok false), for the
// caller's float32 path.
//
// A final logit soft-cap (cap > 0: the token is the first largest of cap tanh(l / cap), as Gemma 2-4 compute it in
// float32) keeps the order of distinct logits but may round two of them to one float32 value, and then the first
// index wins there, not the larger logit. The candidates are the same (the cap is monotone), their capped values are
// taken in float64, and a row is settled only when the winner's capped value stands more than kCapUlps float32 units
// in the last place above both the runner-up's and the cap of the largest upper bound a + b of the tokens left out
// (each one's float32 logit is at most its bound, so its capped value at most that); else it is returned not
// screened, for the float32
// path, which rounds as the model does.
//
// Logits rounded to a narrower format (logit_bits: 8 for a bfloat16 model, whose logits are the float32 sums of its
// bfloat16 head rounded to bfloat16; 24 is float32) tie often: two logits a bfloat16 unit apart round to one value,
// and the first index wins there. The head may then be given in bfloat16 (the candidates read it widened, exactly).
// Each candidate n also gets the bound e_n = g sum_k |x_k w_nk| on its float32 sum's distance from the exact v_n
// (Higham's, as above), and a row is settled only when the winner's lowest float32 sum v - e stands more than one
// unit of the narrow format (at the larger magnitude) above every other candidate's highest v + e and above the
// largest upper bound a + b of the tokens left out:
// rounding, monotone and at most half a unit, then keeps the winner strictly above every other token. With a cap as
// well, the capped values of those ends are compared with kCapUlps units of the narrow format.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // vocabulary entries per packed block
using Vec = at::vec::Vectorized<float>;
static_assert(kBlock % Vec::size() == 0, "a block is whole vectors");

constexpr int64_t kMaxK = 65536;  // K * 255 * 127 < 2^31: the screen's int32 sums are exact
constexpr int64_t kPlanes = 64;   // byte planes of x per GEMM call (a row takes one or two)
constexpr double kPlaneSlack = 2;  // one plane when the row's relative error is at most this times the head's
constexpr int64_t kFewRows = 8;    // up to this many rows all go in two planes: a GEMM call costs about the same
                                   // (plane_sums: one row only, whose two planes take one pass over the head)
constexpr int64_t kGroup = 8;     // blocks per group: the candidate pass visits only groups that hold candidates
constexpr double kCapUlps = 8;    // a capped winner's margin, in float32 units in the last place of its value:
                                  // float32's divide, tanh and product each round by a unit or two

inline int quantized(float v, float scale, int limit) {  // round(v / scale), clamped to [-limit, limit]
  const double q = std::nearbyint(static_cast<double>(v) / scale);
  return static_cast<int>(std::max<double>(-limit, std::min<double>(limit, q)));
}

inline float up(double v) {  // a float >= v
  float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, std::numeric_limits<float>::infinity());
}

constexpr float kRel = 1.0f / (1 << 20);  // covers the rounding of the bound's own float32 arithmetic

// the bound b = c1 A + min(c2 B, c3 C) + s of one vector of one row, widened by |a| 2^-20 and then by (1 + 2^-20)
struct RowTerms {
  Vec c1, c2, c3;
};
inline Vec bound(const Vec& va, const float* A, const float* B, const float* C, const RowTerms& r, const Vec& s) {
  const Vec quant = at::vec::minimum(r.c2 * Vec::loadu(B), r.c3 * Vec::loadu(C));
  return ((r.c1 * Vec::loadu(A) + quant) + s + va.abs() * Vec(kRel)) * Vec(1.0f + kRel);
}

// a[j] = D S[j] t for one block, D = 256 hi[j] + lo[j] - 32768 R[j] for a row in two planes (lo given), else
// D = hi[j] - 128 R[j]: the integer part exact in double (|.| < 2^53), two double products and one rounding to float
inline void approximate(const int32_t* hi, const int32_t* lo, const int32_t* R, const float* S, double t, float* a) {
  const double high = lo ? 256.0 : 1.0, shift = lo ? 32768.0 : 128.0;
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512d vt = _mm512_set1_pd(t), vhigh = _mm512_set1_pd(high), vshift = _mm512_set1_pd(shift);
  for (; j + 8 <= kBlock; j += 8) {
    const __m512d h = _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + j)));
    const __m512d l = lo ? _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + j)))
                         : _mm512_setzero_pd();
    const __m512d r = _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(R + j)));
    const __m512d d = _mm512_sub_pd(_mm512_add_pd(_mm512_mul_pd(h, vhigh), l), _mm512_mul_pd(r, vshift));
    const __m512d sc = _mm512_cvtps_pd(_mm256_loadu_ps(S + j));
    _mm256_storeu_ps(a + j, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(d, sc), vt)));
  }
#endif
  for (; j < kBlock; ++j) {
    const double d = high * hi[j] + (lo ? lo[j] : 0) - shift * R[j];
    a[j] = static_cast<float>(d * S[j] * t);
  }
}

// Whether torch's batch-reduce GEMM multiplies int8 on this CPU (AMX, AVX512-VNNI); else plane_sums runs. The
// packing and the screen ask the same question, so a head is always read in the layout it was packed in.
inline bool int8_gemm() { return at::native::cpublas::could_pack(at::kChar); }

// sums (P, kBlock) int32 = planes (P, Kp) uint8 times one packed block (Kp / 2, kBlock, 2) int8 (inputs k and k + 1
// of entry j adjacent), exactly: what brgemm gives from the VNNI layout, for CPUs without an int8 GEMM.
void plane_sums(int64_t P, int64_t Kp, const uint8_t* planes, const int8_t* block, int32_t* sums) {
  int64_t p = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  static_assert(kBlock == 32, "four registers of eight 32-bit sums per plane");
  for (; p < P; p += 2) {  // two planes at a time share each widened load of the block
    const uint8_t* x0 = planes + p * Kp;
    const uint8_t* x1 = p + 1 < P ? x0 + Kp : x0;
    __m256i a0[4], a1[4];
    for (int i = 0; i < 4; ++i) a0[i] = _mm256_setzero_si256(), a1[i] = _mm256_setzero_si256();
    for (int64_t k = 0; k < Kp; k += 2) {
      const int8_t* w = block + k * kBlock;  // 2 * kBlock bytes: entries 0..31, two inputs each
      const __m256i b0 = _mm256_set1_epi32(static_cast<int32_t>(x0[k]) | (static_cast<int32_t>(x0[k + 1]) << 16));
      const __m256i b1 = _mm256_set1_epi32(static_cast<int32_t>(x1[k]) | (static_cast<int32_t>(x1[k + 1]) << 16));
      for (int i = 0; i < 4; ++i) {
        const __m256i wi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * i)));
        a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(wi, b0));
        a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(wi, b1));
      }
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + p * kBlock + 8 * i), a0[i]);
      if (p + 1 < P) _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + (p + 1) * kBlock + 8 * i), a1[i]);
    }
  }
#endif
  for (; p < P; ++p) {  // portable
    const uint8_t* x = planes + p * Kp;
    for (int64_t j = 0; j < kBlock; ++j) {
      int32_t acc = 0;
      for (int64_t k = 0; k < Kp; k += 2)
        acc += static_cast<int32_t>(x[k]) * block[k * kBlock + 2 * j] +
               static_cast<int32_t>(x[k + 1]) * block[k * kBlock + 2 * j + 1];
      sums[p * kBlock + j] = acc;
    }
  }
}

inline float lanes_max(const Vec& v) {  // the largest lane, NaN if any lane is NaN
  float lanes[Vec::size()];
  v.store(lanes);
  float m = lanes[0];
  for (int64_t i = 0; i < Vec::size(); ++i) {
    if (std::isnan(lanes[i])) return lanes[i];
    m = std::max(m, lanes[i]);
  }
  return m;
}

}  // namespace

// W (V, K) float32 -> {packed (V/kBlock rounded up, Kp, kBlock) int8 in the VNNI layout of torch's brgemm (without
// an int8 GEMM: each block (Kp / 2, kBlock, 2), plane_sums's), A (Vp)
// = |w_n|, B (Vp) = |w_n - s_n q_n|, C (Vp) = |w_n - s_n q_n|_inf (floats rounded up), S (Vp) the scales s_n, R (Vp)
// int32 the sums of q_n, P (1) the head's relative quantization error sum B / sum A (an input row goes in one byte
// plane when its own relative error is at most kPlaneSlack P)};
// Kp is K rounded up to whole groups of four, padding entries are zero.
std::vector<at::Tensor> screen_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "screen_pack: weight must be a contiguous float32 (V, K) tensor");
  const int64_t V = weight.size(0), K = weight.size(1), Kp = (K + 3) / 4 * 4;
  TORCH_CHECK(K > 0 && K <= kMaxK, "screen_pack: K must be 1..", kMaxK, " (exact int32 sums), got ", K);
  const bool vnni = int8_gemm();
  const int64_t nb = (V + kBlock - 1) / kBlock, Vp = nb * kBlock;
  auto packed = at::empty({nb, Kp, kBlock}, weight.options().dtype(at::kChar));
  auto A = at::zeros({Vp}, weight.options());
  auto B = at::zeros({Vp}, weight.options());
  auto C = at::zeros({Vp}, weight.options());
  auto S = at::zeros({Vp}, weight.options());
  auto R = at::zeros({Vp}, weight.options().dtype(at::kInt));
  const float* w = weight.data_ptr<float>();
  float *pa = A.data_ptr<float>(), *pb = B.data_ptr<float>(), *pc = C.data_ptr<float>(), *ps = S.data_ptr<float>();
  int32_t* pr = R.data_ptr<int32_t>();
  auto* out = packed.data_ptr<int8_t>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int8_t> block(Kp * kBlock);  // (Kp, kBlock) row-major, before the VNNI packing
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(block.begin(), block.end(), int8_t(0));
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t n = b * kBlock + j;
        if (n >= V) continue;
        const float* wn = w + n * K;
        float big = 0.0f;
        for (int64_t k = 0; k < K; ++k) big = std::max(big, std::fabs(wn[k]));
        const float s = std::max(big / 127.0f, std::numeric_limits<float>::min());
        double err = 0, nw = 0, worst = 0;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          const int q = quantized(wn[k], s, 127);
          block[k * kBlock + j] = static_cast<int8_t>(q);
          sum += q;
          const double d = static_cast<double>(wn[k]) - static_cast<double>(s) * q;  // s q exact in double
          err += d * d, nw += static_cast<double>(wn[k]) * wn[k], worst = std::max(worst, std::fabs(d));
        }
        pa[n] = up(std::sqrt(nw) * (1 + 1e-12));
        pb[n] = up(std::sqrt(err) * (1 + 1e-12));
        pc[n] = up(worst);
        ps[n] = s, pr[n] = sum;
      }
      int8_t* dst = out + b * Kp * kBlock;
      if (vnni) {
        at::native::cpublas::pack(Kp, kBlock, kBlock, kBlock, at::kChar, at::kChar, block.data(), dst);
      } else {  // pairs of inputs per entry: dst[(k / 2) 2 kBlock + 2 j + k % 2] = block[k kBlock + j]
        for (int64_t k = 0; k < Kp; ++k)
          for (int64_t j = 0; j < kBlock; ++j) dst[(k / 2) * 2 * kBlock + 2 * j + k % 2] = block[k * kBlock + j];
      }
    }
  });
  double sum_a = 0, sum_b = 0;
  for (int64_t n = 0; n < V; ++n) sum_a += pa[n], sum_b += pb[n];
  auto P = at::full({1}, sum_a > 0 ? static_cast<float>(sum_b / sum_a) : 0.0f, weight.options());
  return {packed, A, B, C, S, R, P};
}

// x (M, K) float32 -> {tokens (M) int64, ok (M) bool, candidates (M) int64, planes (M) int64}: tokens of the
// screened rows (ok), how many tokens each row recomputed, and in how many byte planes it went; cap > 0: the tokens
// of the soft-capped logits cap tanh(l / cap), a row whose capped winner is not clear left not screened.
std::vector<at::Tensor> screened_argmax(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                                        const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                                        const at::Tensor& S, const at::Tensor& R, const at::Tensor& P,
                                        double cap, int64_t logit_bits) {
  TORCH_CHECK(std::isfinite(cap) && cap >= 0, "screened_argmax: cap must be finite and >= 0 (0: no soft-cap), got ",
              cap);
  TORCH_CHECK(logit_bits == 24 || logit_bits == 8,
              "screened_argmax: logit_bits must be 24 (float32 logits) or 8 (bfloat16), got ", logit_bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "screened_argmax: x must be a contiguous float32 (M, K) tensor");
  const int64_t M = x.size(0), K = x.size(1), V = weight.size(0), nb = packed.size(0), Vp = nb * kBlock;
  const int64_t Kp = (K + 3) / 4 * 4;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "screened_argmax: weight must be a contiguous float32 or bfloat16 (V, K) tensor with x's K");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == Kp && packed.size(2) == kBlock &&
                  packed.scalar_type() == at::kChar && nb * kBlock >= V && (nb - 1) * kBlock < V &&
                  A.numel() == Vp && B.numel() == Vp && C.numel() == Vp && S.numel() == Vp && R.numel() == Vp &&
                  R.scalar_type() == at::kInt && P.numel() == 1 && P.scalar_type() == at::kFloat,
              "screened_argmax: packed/A/B/C/S/R do not come from screen_pack(weight)");
  auto tokens = at::zeros({M}, x.options().dtype(at::kLong));
  auto ok = at::zeros({M}, x.options().dtype(at::kBool));
  auto count = at::zeros({M}, x.options().dtype(at::kLong));
  auto planes = at::zeros({M}, x.options().dtype(at::kLong));
  if (M == 0) return {tokens, ok, count, planes};
  const float* px = x.data_ptr<float>();
  const bool bf16_head = weight.scalar_type() == at::kBFloat16;
  const float* w = bf16_head ? nullptr : weight.data_ptr<float>();
  const at::BFloat16* w16 = bf16_head ? weight.data_ptr<at::BFloat16>() : nullptr;
  const bool rounded = logit_bits < 24;  // logits in a narrower format than float32: ties to rule out
  const double gamma = K * std::ldexp(1.0, -23);  // >= gamma_K: a float32 sum's error over sum |x_k w_k|
  const float *pa = A.data_ptr<float>(), *pb = B.data_ptr<float>(), *pc = C.data_ptr<float>();
  const float* ps = S.data_ptr<float>();
  const int32_t* pr = R.data_ptr<int32_t>();
  const auto* pw = packed.data_ptr<int8_t>();

  // per row: t and x~ = round(x / t), in 8 bits (x~ in [-127, 127], one plane of u = x~ + 128) where that error
  // |x - t x~| is at most kPlaneSlack times the head's relative error P times |x| (the bound at most about
  // 1 + kPlaneSlack times the two-plane one) and there are more than kFewRows rows (fewer, and each GEMM call
  // costs about the same whatever its rows, so the second plane's tighter bound is free; plane_sums, without an
  // int8 GEMM: more than one row, its passes take two planes at a time), else in 16 bits (x~ in
  // [-32767, 32767], u = x~ + 32768 as two planes: u >> 8, then u & 255); c1 = |x - t x~| + g |x|, c2 = |t x~|,
  // c3 = |t x~|_1, rounded up. A row with a non-finite input is not screened.
  const bool vnni = int8_gemm();  // plane_sums's time grows with the planes, a GEMM call's hardly
  const double g = K * std::ldexp(1.0, -23);
  const float slack = static_cast<float>(K * std::ldexp(1.0, -124));
  const double one_plane = kPlaneSlack * static_cast<double>(P.data_ptr<float>()[0]);
  std::vector<float> t(M), c1(M), c2(M), c3(M);
  std::vector<int> limit(M);
  std::vector<int64_t> first_plane(M + 1, 0);
  std::vector<char> row_ok(M, 1);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = px + m * K;
    float big = 0.0f;
    for (int64_t k = 0; k < K; ++k) big = std::max(big, std::fabs(xm[k]));  // NaN is dropped here, seen below
    for (const int lim : {127, 32767}) {
      if (lim == 127 && (vnni ? M <= kFewRows : M == 1)) continue;
      t[m] = std::max(big / static_cast<float>(lim), std::numeric_limits<float>::min());
      double nx = 0, nq = 0, ex = 0, aq = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int q = std::isfinite(xm[k]) ? quantized(xm[k], t[m], lim) : 0;
        const double tq = static_cast<double>(t[m]) * q, d = static_cast<double>(xm[k]) - tq;
        nx += static_cast<double>(xm[k]) * xm[k], nq += tq * tq, ex += d * d, aq += std::fabs(tq);
      }
      limit[m] = lim;
      row_ok[m] = std::isfinite(nx);
      c1[m] = up((std::sqrt(ex) + g * std::sqrt(nx)) * (1 + 1e-12));
      c2[m] = up(std::sqrt(nq) * (1 + 1e-12));
      c3[m] = up(aq * (1 + 1e-12));
      if (!std::isfinite(c1[m]) || !std::isfinite(c2[m]) || !std::isfinite(c3[m])) row_ok[m] = 0;
      if (!row_ok[m] || std::sqrt(ex) <= one_plane * std::sqrt(nx)) break;
    }
    first_plane[m + 1] = first_plane[m] + (limit[m] == 127 ? 1 : 2);
  }
  std::vector<uint8_t> xq(first_plane[M] * Kp, 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = px + m * K;
    uint8_t* row = xq.data() + first_plane[m] * Kp;
    for (int64_t k = 0; k < K; ++k) {
      const int q = std::isfinite(xm[k]) ? quantized(xm[k], t[m], limit[m]) : 0;
      if (limit[m] == 127) {
        row[k] = static_cast<uint8_t>(q + 128);
      } else {
        const int u = q + 32768;
        row[k] = static_cast<uint8_t>(u >> 8), row[Kp + k] = static_cast<uint8_t>(u & 255);
      }
    }
  }
  // rows in runs of at most kPlanes byte planes, one GEMM call per run and block
  std::vector<int64_t> runs{0};
  for (int64_t m = 1; m <= M; ++m)
    if (m == M || first_plane[m + 1] - first_plane[runs.back()] > kPlanes) runs.push_back(m);
  int64_t* pp = planes.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) pp[m] = first_plane[m + 1] - first_plane[m];

  // the screen, a group of kGroup blocks of kBlock tokens at a time: approximate logits a = t s D (M, Vp), D = x~ .
  // q exact from the brgemm's int32 sums of both byte planes; per row and group, the largest lower bound a - b, the
  // largest upper bound a + b and the largest |a| (NaN or infinite where some a was not finite). The row's largest
  // float32 logit is at least its largest lower bound, so only groups whose upper bound reaches it hold candidates.
  const int64_t ng = (nb + kGroup - 1) / kGroup, span = kGroup * kBlock;
  std::unique_ptr<float[]> a(new float[M * Vp]);  // every entry written by the screen
  std::vector<float> grp_lo(M * ng), grp_hi(M * ng), grp_mag(M * ng);
  constexpr int64_t L = Vec::size();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const Vec vs(slack);
  at::parallel_for(0, ng, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int32_t> sums(kPlanes * kBlock);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * span, live = std::min(span, V - first);  // tokens of this group (not padding)
      for (size_t run = 0; run + 1 < runs.size(); ++run) {
        const int64_t m0 = runs[run], m1 = runs[run + 1], p0 = first_plane[m0];
        for (int64_t b = g * kGroup; b < std::min(nb, (g + 1) * kGroup); ++b) {
          if (vnni) {
            at::native::cpublas::brgemm(first_plane[m1] - p0, kBlock, Kp, Kp, kBlock, kBlock, false,
                                        xq.data() + p0 * Kp, pw + b * Kp * kBlock, sums.data(), true);
          } else {
            plane_sums(first_plane[m1] - p0, Kp, xq.data() + p0 * Kp, pw + b * Kp * kBlock, sums.data());
          }
          for (int64_t m = m0; m < m1; ++m) {
            const int32_t* hi = sums.data() + (first_plane[m] - p0) * kBlock;
            approximate(hi, limit[m] == 127 ? nullptr : hi + kBlock, pr + b * kBlock, ps + b * kBlock, t[m],
                        a.get() + m * Vp + b * kBlock);
          }
        }
        for (int64_t m = m0; m < m1; ++m) {
          const float* am = a.get() + m * Vp + first;
          const RowTerms terms{Vec(c1[m]), Vec(c2[m]), Vec(c3[m])};
          Vec lo(-kInf), hi(-kInf), mag(0.0f);
          for (int64_t j = 0; j < live; j += L) {
            const Vec va = Vec::loadu(am + j);
            const Vec bv = bound(va, pa + first + j, pb + first + j, pc + first + j, terms, vs);
            if (j + L <= live) {
              lo = at::vec::maximum(lo, va - bv), hi = at::vec::maximum(hi, va + bv);
              mag = at::vec::maximum(mag, va.abs());
            } else {  // the last group's padding entries take no part
              lo = at::vec::maximum(lo, Vec::set(Vec(-kInf), va - bv, live - j));
              hi = at::vec::maximum(hi, Vec::set(Vec(-kInf), va + bv, live - j));
              mag = at::vec::maximum(mag, Vec::set(Vec(0.0f), va.abs(), live - j));
            }
          }
          grp_lo[m * ng + g] = lanes_max(lo), grp_hi[m * ng + g] = lanes_max(hi);
          grp_mag[m * ng + g] = lanes_max(mag);
        }
      }
    }
    if (vnni) at::native::cpublas::brgemm_release(true);
  });

  // the candidates of each row (upper bound a + b >= the row's largest lower bound), in float64, the first
  // largest winning
  int64_t* pt = tokens.data_ptr<int64_t>();
  bool* pok = ok.data_ptr<bool>();
  int64_t* pn = count.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float floor = -kInf;
      bool good = row_ok[m];
      for (int64_t g = 0; g < ng; ++g) {
        good = good && std::isfinite(grp_mag[m * ng + g]);
        floor = std::max(floor, grp_lo[m * ng + g]);
      }
      if (!good || !std::isfinite(floor)) continue;
      const float* xm = px + m * K;
      const float* am = a.get() + m * Vp;
      const RowTerms terms{Vec(c1[m]), Vec(c2[m]), Vec(c3[m])};
      const Vec vfloor(floor);
      double best = -std::numeric_limits<double>::infinity();
      double best_e = 0, other = best;  // the winner's bound e (rounded logits), the others' largest v + e
      double left = best;  // the largest upper bound a + b of a token left out (its float32 logit is at most that)
      const bool ends = cap > 0 || rounded;  // the winner is checked against the others' highest values
      int64_t arg = -1, seen = 0;
      for (int64_t g = 0; g < ng; ++g) {
        if (!(grp_hi[m * ng + g] >= floor)) {
          left = std::max(left, static_cast<double>(grp_hi[m * ng + g]));
          continue;
        }
        for (int64_t j0 = g * span; j0 < std::min((g + 1) * span, V); j0 += L) {
          const Vec va = Vec::loadu(am + j0);
          const Vec hi = va + bound(va, pa + j0, pb + j0, pc + j0, terms, vs);
          if (ends) {  // the lanes left out, padding entries excluded
            const Vec out = Vec::blendv(hi, Vec(-kInf), hi >= vfloor);
            const int64_t live = std::min<int64_t>(L, V - j0);
            left = std::max(left, static_cast<double>(lanes_max(live < L ? Vec::set(Vec(-kInf), out, live) : out)));
          }
          int lanes = ~(hi >= vfloor).zero_mask() & ((1 << L) - 1);
          while (lanes) {
            const int i = __builtin_ctz(lanes);
            lanes &= lanes - 1;
            const int64_t n = j0 + i;
            if (n >= V) break;
            double s0 = 0, s1 = 0, s2 = 0, s3 = 0, mag = 0;
            if (bf16_head) {  // widened exactly; the sum of |products| rides along
              const at::BFloat16* wn = w16 + n * K;
              for (int64_t k = 0; k < K; ++k) {
                const double p = static_cast<double>(xm[k]) * static_cast<float>(wn[k]);
                s0 += p, mag += std::fabs(p);
              }
            } else {
              const float* wn = w + n * K;
              int64_t k = 0;
              for (; k + 4 <= K; k += 4) {
                s0 += static_cast<double>(xm[k]) * wn[k], s1 += static_cast<double>(xm[k + 1]) * wn[k + 1];
                s2 += static_cast<double>(xm[k + 2]) * wn[k + 2], s3 += static_cast<double>(xm[k + 3]) * wn[k + 3];
              }
              for (; k < K; ++k) s0 += static_cast<double>(xm[k]) * wn[k];
              if (rounded)
                for (k = 0; k < K; ++k) mag += std::fabs(static_cast<double>(xm[k]) * wn[k]);
            }
            const double v = (s0 + s1) + (s2 + s3);
            // float32 logits: the float64 value decides (e = 0), as without rounding to a narrower format
            const double e = rounded ? (gamma * mag + K * std::ldexp(1.0, -124)) * (1 + 1e-9) : 0.0;
            ++seen;
            if (arg < 0 || v > best) {
              if (arg >= 0) other = std::max(other, best + best_e);
              best = v, best_e = e, arg = n;
            } else {
              other = std::max(other, v + e);
            }
          }
        }
      }
      if (arg < 0 || !std::isfinite(best)) continue;
      // the winner's lowest value against the highest any other token may take
      const double low = best - best_e, rival = std::max(other, left);
      const auto unit = [&](double a, double b) {  // the logits' format's spacing at the larger magnitude
        const double big = std::max({std::fabs(a), std::fabs(b), static_cast<double>(FLT_MIN)});
        return std::ldexp(1.0, std::ilogb(big) - static_cast<int>(logit_bits - 1));
      };
      if (cap > 0) {  // the cap could round the winner onto another token's value: the caller's path decides
        const double c_low = cap * std::tanh(low / cap), c_rival = cap * std::tanh(rival / cap);
        if (!(c_low - c_rival > kCapUlps * unit(c_low, c_rival))) continue;
      } else if (rounded) {  // rounding could tie the winner with another token: the caller's path decides
        if (!(low - rival > unit(low, rival))) continue;
      }
      pt[m] = arg, pok[m] = true, pn[m] = seen;
    }
  });
  return {tokens, ok, count, planes};
}
