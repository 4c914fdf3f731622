// ZeRO-Offload's optimizer step on this rank's host shard, in one pass over memory.
//
// For every element of the flat fp32 master shard:
//   g  = float(grad) * grad_scale          grad in its training dtype (fp32/bf16/fp16);
//                                          grad_scale folds loss-scale unscaling and clipping
//   p *= 1 - lr * wd                       (segments with weight decay only: AdamW's decoupled decay)
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + (1 - b2) * g * g
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//   out = cast(p)                          the parameter copy uploaded to the device (optional)
// and a non-finite gradient element anywhere sets found_inf. That is
// torch.optim.AdamW's arithmetic; doing it in one pass reads the gradient once
// in its narrow dtype and writes the narrow copy while the master is in
// registers, where the torch-op sequence (upcast, scale, AdamW, downcast)
// streams the shard through memory four times.
//
// The overflow flag is a report, not a guard: elements before the bad one are
// already updated when it is met. Callers that can overflow (fp16 loss
// scaling) decide skip-or-step from the global gradient norm first, as the
// ZeRO engine does, and use the flag as a check.
//
// Vectorized with AVX2+FMA (+F16C for fp16) when the build CPU has them, with a
// scalar path for the tail and for other CPUs; threads from ATen's pool, so
// torch.set_num_threads governs it.

// ATen and torch's pybind casters only: <torch/extension.h> would pull in the whole
// C++ frontend and nearly double the compile time (24 s vs 13 s on 2 cores).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYBRID_AVX2 1
#endif

namespace {

struct Coef {
  float lr_decay;   // 1 - lr * weight_decay
  float b1, omb1, b2, omb2;
  float step_size;  // lr / (1 - b1^t)
  float inv_bias2_sqrt; // 1 / sqrt(1 - b2^t): a multiply, where a divide would bound the loop
  float eps;
  float grad_scale;
};

// ---- scalar conversions (round to nearest even, as tensor.to() does) --------
inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline float load_scalar(const c10::Half* p) { return static_cast<float>(*p); }
inline void store_scalar(float* p, float x) { *p = x; }
inline void store_scalar(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }
inline void store_scalar(c10::Half* p, float x) { *p = c10::Half(x); }

struct NoOut {};  // out == None

template <typename G, typename O>
inline bool step_scalar(float* p, const G* g, float* m, float* v, O* out, int64_t i,
                        const Coef& c, bool decay) {
  float gr = load_scalar(g + i);
  bool bad = !std::isfinite(gr);
  gr *= c.grad_scale;
  float w = p[i];
  if (decay) w *= c.lr_decay;
  float mi = c.b1 * m[i] + c.omb1 * gr;
  float vi = c.b2 * v[i] + c.omb2 * gr * gr;
  float denom = std::sqrt(vi) * c.inv_bias2_sqrt + c.eps;
  w -= c.step_size * (mi / denom);
  p[i] = w;
  m[i] = mi;
  v[i] = vi;
  if constexpr (!std::is_same_v<O, NoOut>) store_scalar(out + i, w);
  return bad;
}

#ifdef HYBRID_AVX2
// ---- 8-wide loads/stores in each dtype -------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// The parameter copy-out is never read back here (it is uploaded or copied into
// the model), so it is written with streaming stores: no read-for-ownership of
// its cache lines, which would otherwise add a read to every byte written.
// Sixteen values at a time, so a narrow copy is one full 32-byte store; the
// loop first steps one element at a time up to a 32-byte aligned out.
inline void store16(float* p, __m256 a, __m256 b) {
  _mm256_stream_ps(p, a);
  _mm256_stream_ps(p + 8, b);
}
inline __m256i bf16_bits(__m256 x) {
  // round to nearest even; NaN stays a (quiet) NaN, as c10::BFloat16 does
  // (rounding alone could carry a NaN's low payload bits into an inf).
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline void store16(c10::BFloat16* p, __m256 a, __m256 b) {
  // packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7]; put the quads in order
  __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
#ifdef __F16C__
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store16(c10::Half* p, __m256 a, __m256 b) {
  __m128i lo = _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT);
  __m128i hi = _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm256_set_m128i(hi, lo));
}
#define HYBRID_F16C 1
#endif

template <typename T> constexpr bool vec_ok() {
#ifdef HYBRID_F16C
  return true;
#else
  return !std::is_same_v<T, c10::Half>;
#endif
}

struct VecCoef {
  __m256 decay, b1, omb1, b2, omb2, step, ib2s, eps, scale;
  VecCoef(const Coef& c, bool wd)
      : decay(_mm256_set1_ps(wd ? c.lr_decay : 1.0f)), b1(_mm256_set1_ps(c.b1)),
        omb1(_mm256_set1_ps(c.omb1)), b2(_mm256_set1_ps(c.b2)), omb2(_mm256_set1_ps(c.omb2)),
        step(_mm256_set1_ps(c.step_size)), ib2s(_mm256_set1_ps(c.inv_bias2_sqrt)),
        eps(_mm256_set1_ps(c.eps)), scale(_mm256_set1_ps(c.grad_scale)) {}
};

// Eight elements at i: update p, m, v in place, return the new p; OR a lane of
// `nonfinite` on for each inf/NaN gradient.
template <typename G>
inline __m256 update8(float* p, const G* g, float* m, float* v, int64_t i, const VecCoef& k,
                      __m256& nonfinite) {
  __m256 gr = load8(g + i);
  __m256 d = _mm256_sub_ps(gr, gr);  // 0 for finite x, NaN for inf/NaN
  nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
  gr = _mm256_mul_ps(gr, k.scale);
  __m256 w = _mm256_mul_ps(_mm256_loadu_ps(p + i), k.decay);
  __m256 mi = _mm256_add_ps(_mm256_mul_ps(k.b1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(k.omb1, gr));
  __m256 vi = _mm256_add_ps(_mm256_mul_ps(k.b2, _mm256_loadu_ps(v + i)),
                            _mm256_mul_ps(_mm256_mul_ps(k.omb2, gr), gr));
  __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), k.ib2s), k.eps);
  w = _mm256_sub_ps(w, _mm256_mul_ps(k.step, _mm256_div_ps(mi, denom)));
  _mm256_storeu_ps(p + i, w);
  _mm256_storeu_ps(m + i, mi);
  _mm256_storeu_ps(v + i, vi);
  return w;
}

// One core alone cannot keep enough misses in flight to fill the memory bus
// from five streams; asking for the lines a few KB ahead does.
constexpr int64_t kAhead = 512;
template <typename G>
inline void prefetch16(const float* p, const G* g, const float* m, const float* v, int64_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(m + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(v + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(g + i), _MM_HINT_T0);
}
#endif  // HYBRID_AVX2

// Update [lo, hi) of one segment; returns whether a non-finite gradient was seen.
template <typename G, typename O>
bool run_range(float* p, const G* g, float* m, float* v, O* out, int64_t lo, int64_t hi,
               const Coef& c, bool decay) {
  int64_t i = lo;
  bool bad = false;
#ifdef HYBRID_AVX2
  if constexpr (vec_ok<G>() && vec_ok<O>()) {
    const VecCoef k(c, decay);
    __m256 nonfinite = _mm256_setzero_ps();
    if constexpr (std::is_same_v<O, NoOut>) {
      for (; i + 16 <= hi; i += 16) {
        prefetch16(p, g, m, v, i + kAhead);
        update8(p, g, m, v, i, k, nonfinite);
        update8(p, g, m, v, i + 8, k, nonfinite);
      }
    } else {
      for (; i < hi && reinterpret_cast<uintptr_t>(out + i) % 32; ++i)
        bad |= step_scalar(p, g, m, v, out, i, c, decay);
      for (; i + 16 <= hi; i += 16) {
        prefetch16(p, g, m, v, i + kAhead);
        __m256 w0 = update8(p, g, m, v, i, k, nonfinite);
        __m256 w1 = update8(p, g, m, v, i + 8, k, nonfinite);
        store16(out + i, w0, w1);
      }
      _mm_sfence();  // order the streaming stores before the caller reads `out`
    }
    bad |= _mm256_movemask_ps(nonfinite) != 0;
  }
#endif
  for (; i < hi; ++i) bad |= step_scalar(p, g, m, v, out, i, c, decay);
  return bad;
}

template <typename G, typename O>
bool run_all(float* p, const G* g, float* m, float* v, O* out, int64_t n,
             const int64_t* bounds, const uint8_t* decay, int64_t nseg, const Coef& c) {
  // Equal contiguous chunks per thread (64-element aligned, a cache line of
  // every stream), each walking the segments it overlaps.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = ((n + threads - 1) / threads + 63) / 64 * 64;
  const int64_t nchunks = chunk ? (n + chunk - 1) / chunk : 0;
  std::vector<uint8_t> bad(std::max<int64_t>(nchunks, 1), 0);
  at::parallel_for(0, nchunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const int64_t lo = k * chunk, hi = std::min(n, lo + chunk);
      int64_t s = std::upper_bound(bounds, bounds + nseg + 1, lo) - bounds - 1;
      bool b = false;
      for (int64_t i = lo; i < hi; ++s) {
        const int64_t end = std::min(hi, bounds[s + 1]);
        b |= run_range(p, g, m, v, out, i, end, c, decay[s] != 0);
        i = end;
      }
      bad[k] = b;
    }
  });
  return std::any_of(bad.begin(), bad.end(), [](uint8_t x) { return x != 0; });
}

template <typename G>
bool dispatch_out(float* p, const G* g, float* m, float* v, const c10::optional<at::Tensor>& out,
                  int64_t n, const int64_t* bounds, const uint8_t* decay, int64_t nseg,
                  const Coef& c) {
  if (!out.has_value())
    return run_all(p, g, m, v, static_cast<NoOut*>(nullptr), n, bounds, decay, nseg, c);
  switch (out->scalar_type()) {
    case at::kFloat:
      return run_all(p, g, m, v, out->data_ptr<float>(), n, bounds, decay, nseg, c);
    case at::kBFloat16:
      return run_all(p, g, m, v, out->data_ptr<c10::BFloat16>(), n, bounds, decay, nseg, c);
    case at::kHalf:
      return run_all(p, g, m, v, out->data_ptr<c10::Half>(), n, bounds, decay, nseg, c);
    default:
      TORCH_CHECK(false, "adam_step: out must be fp32, bf16 or fp16, got ", out->scalar_type());
  }
}

void check_flat(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), "adam_step: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous() && t.dim() == 1 && t.numel() == n,
              "adam_step: ", name, " must be contiguous and flat with ", n, " elements");
}

}  // namespace

// Python: adam_step(master, grad, exp_avg, exp_avg_sq, out, seg_bounds, seg_decay,
//                   lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf,
//                   scalars=None)
// scalars: optional fp64 (3,) CPU tensor [grad_scale, step, skip] that overrides the
// two arguments of those names (the ZeRO engine computes them as tensors, so no
// caller has to read them into Python); skip != 0 leaves every buffer untouched.
void adam_step(at::Tensor master, const at::Tensor& grad, at::Tensor exp_avg,
               at::Tensor exp_avg_sq, const c10::optional<at::Tensor>& out,
               const at::Tensor& seg_bounds, const at::Tensor& seg_decay, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step,
               double grad_scale, at::Tensor found_inf,
               const c10::optional<at::Tensor>& scalars) {
  const int64_t n = master.numel();
  TORCH_CHECK(master.scalar_type() == at::kFloat, "adam_step: master must be fp32");
  check_flat(master, "master", n);
  check_flat(grad, "grad", n);
  check_flat(exp_avg, "exp_avg", n);
  check_flat(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "adam_step: moments must be fp32");
  if (out.has_value()) check_flat(*out, "out", n);
  const int64_t nseg = seg_decay.numel();
  TORCH_CHECK(seg_bounds.scalar_type() == at::kLong && seg_bounds.is_contiguous() &&
                  seg_bounds.numel() == nseg + 1,
              "adam_step: seg_bounds must be int64 with len(seg_decay) + 1 entries");
  TORCH_CHECK(seg_decay.scalar_type() == at::kByte && seg_decay.is_contiguous(),
              "adam_step: seg_decay must be uint8");
  const int64_t* bounds = seg_bounds.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[nseg] == n, "adam_step: segments must cover [0, n)");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1 &&
                  found_inf.device().is_cpu(),
              "adam_step: found_inf must be a one-element fp32 CPU tensor");
  if (scalars.has_value() && scalars->defined()) {
    TORCH_CHECK(scalars->device().is_cpu() && scalars->scalar_type() == at::kDouble &&
                    scalars->is_contiguous() && scalars->numel() == 3,
                "adam_step: scalars must be a contiguous fp64 CPU tensor of 3 elements "
                "[grad_scale, step, skip]");
    const double* sc = scalars->data_ptr<double>();
    if (sc[2] != 0.0) return;  // a skipped step: nothing moves, not even the moments
    grad_scale = sc[0];
    step = static_cast<int64_t>(sc[1]);
  }
  TORCH_CHECK(step >= 1, "adam_step: step counts from 1");

  Coef c;
  c.lr_decay = static_cast<float>(1.0 - lr * weight_decay);
  c.b1 = static_cast<float>(beta1);
  c.omb1 = static_cast<float>(1.0 - beta1);
  c.b2 = static_cast<float>(beta2);
  c.omb2 = static_cast<float>(1.0 - beta2);
  c.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  c.inv_bias2_sqrt =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  c.eps = static_cast<float>(eps);
  c.grad_scale = static_cast<float>(grad_scale);

  float* p = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const uint8_t* decay = seg_decay.data_ptr<uint8_t>();
  bool bad = false;
  switch (grad.scalar_type()) {
    case at::kFloat:
      bad = dispatch_out(p, grad.data_ptr<float>(), m, v, out, n, bounds, decay, nseg, c);
      break;
    case at::kBFloat16:
      bad = dispatch_out(p, grad.data_ptr<c10::BFloat16>(), m, v, out, n, bounds, decay, nseg, c);
      break;
    case at::kHalf:
      bad = dispatch_out(p, grad.data_ptr<c10::Half>(), m, v, out, n, bounds, decay, nseg, c);
      break;
    default:
      TORCH_CHECK(false, "adam_step: grad must be fp32, bf16 or fp16, got ", grad.scalar_type());
  }
  if (bad) found_inf.fill_(1.0f);
}

// STREAM triad a = b + s * c with the same threads, so the bench can state
// the memory bandwidth each optimizer reaches a fraction of.
void triad(at::Tensor a, const at::Tensor& b, const at::Tensor& c, double s) {
  const int64_t n = a.numel();
  float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  const float* pc = c.data_ptr<float>();
  const float sf = static_cast<float>(s);
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    int64_t i = lo;
#ifdef HYBRID_AVX2
    // streaming stores skip the read-for-ownership of a: 12 bytes moved per element,
    // as STREAM counts them
    for (; i < hi && (reinterpret_cast<uintptr_t>(pa + i) & 31); ++i) pa[i] = pb[i] + sf * pc[i];
    const __m256 vs = _mm256_set1_ps(sf);
    for (; i + 8 <= hi; i += 8)
      _mm256_stream_ps(pa + i, _mm256_add_ps(_mm256_loadu_ps(pb + i),
                                             _mm256_mul_ps(vs, _mm256_loadu_ps(pc + i))));
    _mm_sfence();
#endif
    for (; i < hi; ++i) pa[i] = pb[i] + sf * pc[i];
  });
}

std::string build_info() {
#if defined(HYBRID_AVX2) && defined(HYBRID_F16C)
  return "avx2+fma+f16c";
#elif defined(HYBRID_AVX2)
  return "avx2+fma";
#else
  return "scalar";
#endif
}

void register_aio(py::module_& mod);  // csrc/aio.cpp: the swap I/O thread pool

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // The GIL is released: ZeRO-Offload runs this step on a worker thread while the
  // main thread keeps driving forward and backward.
  mod.def("adam_step", &adam_step, "fused ZeRO-Offload AdamW step on a host shard",
          py::arg("master"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("out"), py::arg("seg_bounds"), py::arg("seg_decay"), py::arg("lr"),
          py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::arg("step"), py::arg("grad_scale"), py::arg("found_inf"),
          py::arg("scalars") = py::none(), py::call_guard<py::gil_scoped_release>());
  mod.def("triad", &triad, "STREAM triad a = b + s * c");
  mod.def("build_info", &build_info, "vector ISA the kernel was built for");
  register_aio(mod);
}
