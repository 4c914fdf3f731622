// AdamW over a flat fp32 master shard in one pass: read grad (any float dtype),
// update master / exp_avg / exp_avg_sq in place, write the low-precision
// parameter copy, and flag inf/NaN gradients -- replacing an unscale kernel, an
// isfinite reduction, the optimizer step and a separate downcast copy.
//
// Arithmetic mirrors hybrid.kernels.adam.adam_step_reference (torch.optim.AdamW):
// the points where the reference rounds between separate torch kernels use
// __fmul_rn/__fadd_rn/__fdiv_rn, which nvcc never contracts into an FMA.
//
// Weight decay is per segment: seg_bounds (S+1,) int64, seg_decay (S,) uint8.
// Each thread walks increasing indices (grid-stride), so it keeps the segment it
// is in and only binary-searches again when it crosses that segment's end.
#include "common.cuh"

namespace hybrid {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;

struct SegCursor {
  int64_t end = -1;  // first index past the current segment
  bool decay = false;

  __device__ __forceinline__ bool at(int64_t i, const int64_t* __restrict__ bounds,
                                     const uint8_t* __restrict__ flags, int64_t nseg) {
    if (i >= end) {
      // largest s with bounds[s] <= i
      int64_t lo = 0, hi = nseg - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (bounds[mid] <= i) lo = mid; else hi = mid - 1;
      }
      end = bounds[lo + 1];
      decay = flags[lo] != 0;
    }
    return decay;
  }
};

__device__ __forceinline__ void adam_elem(float& p, float g_raw, float& m, float& v, bool decay,
                                          const AdamScalars& s, bool& bad) {
  bad |= !isfinite(g_raw);
  const float g = __fmul_rn(g_raw, s.grad_scale);
  if (decay) p = __fmul_rn(p, s.decay_factor);
  m = __fadd_rn(__fmul_rn(m, s.beta1), s.one_minus_beta1 * g);
  v = __fadd_rn(__fmul_rn(v, s.beta2), s.one_minus_beta2 * g * g);
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias2_sqrt), s.eps);
  p = p - s.step_size * __fdiv_rn(m, denom);
}

template <typename G, typename O, bool HAS_OUT, int VEC>
__device__ __forceinline__ void adam_chunk(int64_t i, float* __restrict__ p, const G* __restrict__ g,
                                           float* __restrict__ m, float* __restrict__ v,
                                           O* __restrict__ out, SegCursor& seg,
                                           const int64_t* __restrict__ bounds,
                                           const uint8_t* __restrict__ flags, int64_t nseg,
                                           const AdamScalars& s, bool& bad) {
  float pv[VEC], gv[VEC], mv[VEC], vv[VEC];
  load_f<float, VEC>(p + i, pv);
  load_f<G, VEC>(g + i, gv);
  load_f<float, VEC>(m + i, mv);
  load_f<float, VEC>(v + i, vv);
#pragma unroll
  for (int k = 0; k < VEC; ++k)
    adam_elem(pv[k], gv[k], mv[k], vv[k], seg.at(i + k, bounds, flags, nseg), s, bad);
  store_f<float, VEC>(p + i, pv);
  store_f<float, VEC>(m + i, mv);
  store_f<float, VEC>(v + i, vv);
  if constexpr (HAS_OUT) store_f<O, VEC>(out + i, pv);
}

// VEC-wide body over [0, n - n % VEC), then the tail one element per thread.
template <typename G, typename O, bool HAS_OUT, int VEC>
__global__ void __launch_bounds__(kThreads)
adam_kernel(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
            float* __restrict__ v, O* __restrict__ out, const int64_t* __restrict__ bounds,
            const uint8_t* __restrict__ flags, int64_t nseg, int64_t n, AdamScalars host_s,
            const AdamScalars* __restrict__ dev_s, float* __restrict__ found_inf) {
  const AdamScalars s = dev_s ? *dev_s : host_s;
  if (s.skip) return;
  SegCursor seg;
  bool bad = false;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nvec = n / VEC;
  for (int64_t j = tid; j < nvec; j += nthreads)
    adam_chunk<G, O, HAS_OUT, VEC>(j * VEC, p, g, m, v, out, seg, bounds, flags, nseg, s, bad);
  for (int64_t i = nvec * VEC + tid; i < n; i += nthreads)
    adam_chunk<G, O, HAS_OUT, 1>(i, p, g, m, v, out, seg, bounds, flags, nseg, s, bad);
  if (bad) *found_inf = 1.f;  // benign race: every writer stores the same value
}

// The scalars of a step whose inputs live on the device: the host's double
// formulas of ops.cpp, evaluated once by one thread.
__global__ void adam_scalars_kernel(AdamScalars s, const double* __restrict__ dev, double lr,
                                    double beta1, double beta2, AdamScalars* __restrict__ out) {
  const double step = dev[1];
  s.grad_scale = static_cast<float>(dev[0]);
  s.step_size = static_cast<float>(lr / (1.0 - pow(beta1, step)));
  s.bias2_sqrt = static_cast<float>(sqrt(1.0 - pow(beta2, step)));
  s.skip = dev[2] != 0.0;
  *out = s;
}

template <typename G, typename O, bool HAS_OUT>
void launch(float* p, const void* g, float* m, float* v, void* out, const int64_t* bounds,
            const uint8_t* flags, int64_t nseg, int64_t n, const AdamScalars& s,
            const AdamScalars* dev_s, float* found_inf, cudaStream_t stream) {
  const bool vec = aligned16(p) && aligned16(m) && aligned16(v) &&
                   (reinterpret_cast<uintptr_t>(g) % (kVec * sizeof(G)) == 0) &&
                   (!HAS_OUT || reinterpret_cast<uintptr_t>(out) % (kVec * sizeof(O)) == 0);
  const int64_t work = vec ? ceil_div(n, kVec) : n;
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, kThreads), 16LL * num_sms())));
  auto gt = static_cast<const G*>(g);
  auto ot = static_cast<O*>(out);
  if (vec)
    adam_kernel<G, O, HAS_OUT, kVec><<<grid, kThreads, 0, stream>>>(p, gt, m, v, ot, bounds, flags,
                                                                    nseg, n, s, dev_s, found_inf);
  else
    adam_kernel<G, O, HAS_OUT, 1><<<grid, kThreads, 0, stream>>>(p, gt, m, v, ot, bounds, flags,
                                                                 nseg, n, s, dev_s, found_inf);
}

template <typename G>
void launch_out(float* p, const void* g, float* m, float* v, void* out, DType out_dt,
                bool has_out, const int64_t* bounds, const uint8_t* flags, int64_t nseg,
                int64_t n, const AdamScalars& s, const AdamScalars* dev_s, float* found_inf,
                cudaStream_t stream) {
  if (!has_out) {
    launch<G, float, false>(p, g, m, v, nullptr, bounds, flags, nseg, n, s, dev_s, found_inf,
                            stream);
    return;
  }
  HYBRID_DISPATCH(out_dt, {
    launch<G, scalar_t, true>(p, g, m, v, out, bounds, flags, nseg, n, s, dev_s, found_inf,
                              stream);
  });
}

}  // namespace

void adam_step(float* p, const void* g, DType g_dt, float* m, float* v, void* out,
               DType out_dt, bool has_out, const int64_t* seg_bounds, const uint8_t* seg_decay,
               int64_t num_segments, int64_t n, const AdamScalars& s, float* found_inf,
               const double* dev_scalars, double lr, double beta1, double beta2,
               AdamScalars* workspace, cudaStream_t stream) {
  if (n == 0 || num_segments == 0) return;
  const AdamScalars* dev_s = nullptr;
  if (dev_scalars != nullptr) {
    adam_scalars_kernel<<<1, 1, 0, stream>>>(s, dev_scalars, lr, beta1, beta2, workspace);
    dev_s = workspace;
  }
  HYBRID_DISPATCH(g_dt, {
    launch_out<scalar_t>(p, g, m, v, out, out_dt, has_out, seg_bounds, seg_decay, num_segments,
                         n, s, dev_s, found_inf, stream);
  });
}

}  // namespace hybrid
