// Vocab-parallel cross-entropy pieces over this rank's logits (rows, cols).
//
// ce_stats: one block per row, one pass over the valid columns with an online
// softmax: each thread keeps (max m, sum s of exp(x - m)); a vector of VEC
// logits first raises m once (rescaling s by exp(m_old - m_new)) and then adds
// its exps, so the rescale costs one exp per vector, not per element. Thread
// states merge with the same rule across the warp and the block. Columns
// >= valid (padded vocabulary) are never read: they are -inf by definition.
//
// ce_grad: one block per row, grad = (exp(x - M) / S - onehot) * grad_loss from
// the global M and S, written straight in the logits dtype; the softmax is never
// materialised.
#include <math.h>

#include "common.cuh"

namespace hybrid {
namespace {

constexpr int kThreads = 512;

struct MS {
  float m, s;
};

// exp-sum states with max -inf have s == 0; never form (-inf) - (-inf).
__device__ __forceinline__ MS merge(MS a, MS b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

template <int N>
__device__ __forceinline__ void accumulate(MS& st, const float (&x)[N]) {
  float vm = x[0];
#pragma unroll
  for (int k = 1; k < N; ++k) vm = fmaxf(vm, x[k]);
  if (vm > st.m) {  // false when both are -inf
    st.s *= expf(st.m - vm);  // exp(-inf) = 0 on the first finite value
    st.m = vm;
  }
  if (st.m == -INFINITY) return;  // everything so far is -inf: contributes 0
#pragma unroll
  for (int k = 0; k < N; ++k) st.s += expf(x[k] - st.m);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
ce_stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                float* __restrict__ max_out, float* __restrict__ sum_out,
                float* __restrict__ tl_out, int cols, int64_t vocab_start, int valid) {
  __shared__ MS sh[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* xr = logits + row * cols;
  MS st{-INFINITY, 0.f};
  const int nvec = valid / VEC;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    float a[VEC];
    load_f<T, VEC>(xr + i * VEC, a);
    accumulate<VEC>(st, a);
  }
  for (int c = nvec * VEC + threadIdx.x; c < valid; c += kThreads) {
    float a[1] = {to_f(xr[c])};
    accumulate<1>(st, a);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MS other{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o)};
    st = merge(st, other);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[warp] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    MS tot = sh[0];
    for (int w = 1; w < kThreads / 32; ++w) tot = merge(tot, sh[w]);
    max_out[row] = tot.m;
    sum_out[row] = tot.s;
    const int64_t t = target[row] - vocab_start;
    tl_out[row] = (t >= 0 && t < cols) ? to_f(xr[t]) : 0.f;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
ce_grad_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
               const float* __restrict__ M, const float* __restrict__ S,
               const float* __restrict__ grad_loss, T* __restrict__ grad, int cols,
               int64_t vocab_start, int valid) {
  const int64_t row = blockIdx.x;
  const int64_t off = row * cols;
  const float m = M[row], s = S[row], g = grad_loss[row];
  const int64_t t = target[row] - vocab_start;  // may be outside [0, cols)
  for (int c0 = threadIdx.x * VEC; c0 < cols; c0 += kThreads * VEC) {
    float a[VEC], o[VEC];
    load_f<T, VEC>(logits + off + c0, a);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int c = c0 + k;
      float p = c < valid ? expf(a[k] - m) / s : 0.f;
      if (c == t) p -= 1.f;
      o[k] = c < valid ? p * g : 0.f;
    }
    store_f<T, VEC>(grad + off + c0, o);
  }
}

}  // namespace

void ce_stats(const void* logits, const int64_t* target, float* max, float* sumexp,
              float* target_logit, int64_t rows, int64_t cols, int64_t vocab_start,
              int64_t valid, DType dt, cudaStream_t stream) {
  if (rows == 0) return;
  valid = std::max<int64_t>(0, std::min(valid, cols));
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto x = static_cast<const scalar_t*>(logits);
    if (can_vec<scalar_t>(cols, {logits}))
      ce_stats_kernel<scalar_t, V><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          x, target, max, sumexp, target_logit, (int)cols, vocab_start, (int)valid);
    else
      ce_stats_kernel<scalar_t, 1><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          x, target, max, sumexp, target_logit, (int)cols, vocab_start, (int)valid);
  });
}

void ce_grad(const void* logits, const int64_t* target, const float* M, const float* S,
             const float* grad_loss, void* grad, int64_t rows, int64_t cols,
             int64_t vocab_start, int64_t valid, DType dt, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  valid = std::max<int64_t>(0, std::min(valid, cols));
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto x = static_cast<const scalar_t*>(logits);
    auto gr = static_cast<scalar_t*>(grad);
    if (can_vec<scalar_t>(cols, {logits, grad}))
      ce_grad_kernel<scalar_t, V><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          x, target, M, S, grad_loss, gr, (int)cols, vocab_start, (int)valid);
    else
      ce_grad_kernel<scalar_t, 1><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          x, target, M, S, grad_loss, gr, (int)cols, vocab_start, (int)valid);
  });
}

}  // namespace hybrid
