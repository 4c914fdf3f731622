// y = gelu(x + bias) and its backward, for the GPT MLP (x: (rows, cols) = the
// fc output without its bias, bias: (cols,)); gelu is the tanh approximation
// (--openai-gelu) or the exact one, erf's (the default), chosen per launch.
//
// Numerics follow eager PyTorch exactly where it matters: eager first rounds
// x + bias to the storage dtype (a separate add kernel), then evaluates GELU in
// fp32 with the same formula as ATen's GeluCUDAKernelImpl. We round the sum the
// same way, so bf16/fp16 results agree with `F.gelu(x + b, approximate=...)`
// up to tanhf/erff/fma differences. dbias is the column sum of the *rounded* dx, as
// autograd would compute it from the dx tensor.
#include "common.cuh"

namespace hybrid {
namespace {

constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = kBeta * (x + kKappa * x * x * x);
  return 0.5f * x * (1.f + tanhf(inner));
}

__device__ __forceinline__ float gelu_tanh_grad(float dy, float x) {
  const float x_sq = x * x;
  const float inner = kBeta * (x + kKappa * x_sq * x);
  const float t = tanhf(inner);
  const float left = 0.5f * x;
  const float right = 1.f + t;
  const float left_derivative = 0.5f * right;
  const float right_derivative = left * (1.f - t * t) * (kBeta * (1.f + 3.f * kKappa * x_sq));
  return dy * (left_derivative + right_derivative);
}

constexpr float kSqrtHalf = 0.7071067811865476f;        // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.3989422804014327f;      // 1 / sqrt(2 pi)

__device__ __forceinline__ float gelu_erf(float x) {
  return 0.5f * x * (1.f + erff(x * kSqrtHalf));
}

__device__ __forceinline__ float gelu_erf_grad(float dy, float x) {
  const float cdf = 0.5f * (1.f + erff(x * kSqrtHalf));
  const float pdf = expf(-0.5f * x * x) * kInvSqrt2Pi;
  return dy * (cdf + x * pdf);
}

template <bool TANH>
__device__ __forceinline__ float gelu(float x) {
  return TANH ? gelu_tanh(x) : gelu_erf(x);
}

template <bool TANH>
__device__ __forceinline__ float gelu_grad(float dy, float x) {
  return TANH ? gelu_tanh_grad(dy, x) : gelu_erf_grad(dy, x);
}

// x + bias rounded to the storage type, back in fp32 (what eager's add produces).
template <typename T>
__device__ __forceinline__ float biased(float x, float b) {
  return to_f(from_f<T>(x + b));
}

// Flat grid-stride loop over VEC-element vectors; cols % VEC == 0 so a vector
// never straddles two rows.
template <typename T, int VEC, bool TANH>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                     T* __restrict__ y, int64_t n, int64_t cols) {
  const int64_t nvec = n / VEC;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i * VEC;
    float a[VEC], b[VEC], o[VEC];
    load_f<T, VEC>(x + e, a);
    load_f<T, VEC>(bias + e % cols, b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = gelu<TANH>(biased<T>(a[k], b[k]));
    store_f<T, VEC>(y + e, o);
  }
}

// dx for a (32 * VEC columns) x (chunk of rows) tile, plus this chunk's partial
// column sums of dx. Block (32, 8) as in ln_bwd_dwb_kernel.
template <typename T, int VEC, bool TANH>
__global__ void __launch_bounds__(256)
bias_gelu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                     const T* __restrict__ bias, T* __restrict__ dx, float* __restrict__ part,
                     int64_t rows, int cols, int64_t rows_per_chunk) {
  __shared__ float sh[8][VEC * 32 + 1];
  const int c0 = (blockIdx.x * 32 + threadIdx.x) * VEC;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  float acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
  if (c0 < cols) {
    float b[VEC];
    load_f<T, VEC>(bias + c0, b);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      float a[VEC], d[VEC], o[VEC];
      load_f<T, VEC>(x + r * cols + c0, a);
      load_f<T, VEC>(dy + r * cols + c0, d);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        o[k] = gelu_grad<TANH>(d[k], biased<T>(a[k], b[k]));
        acc[k] += to_f(from_f<T>(o[k]));  // sum what is stored, like autograd
      }
      store_f<T, VEC>(dx + r * cols + c0, o);
    }
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) sh[threadIdx.y][k * 32 + threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && c0 < cols) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float s = 0.f;
#pragma unroll
      for (int y = 0; y < 8; ++y) s += sh[y][k * 32 + threadIdx.x];
      part[blockIdx.y * static_cast<int64_t>(cols) + c0 + k] = s;
    }
  }
}

}  // namespace

void bias_gelu_fwd(const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                   bool use_tanh, DType dt, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t cap = 32LL * num_sms();  // grid-stride beyond this
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto xt = static_cast<const scalar_t*>(x);
    auto bt = static_cast<const scalar_t*>(bias);
    auto yt = static_cast<scalar_t*>(y);
    const bool vec = can_vec<scalar_t>(cols, {x, bias, y});
    const unsigned grid = static_cast<unsigned>(
        std::min(ceil_div(vec ? n / V : n, kThreads), cap));
    if (vec && use_tanh) {
      bias_gelu_fwd_kernel<scalar_t, V, true><<<grid, kThreads, 0, stream>>>(xt, bt, yt, n, cols);
    } else if (vec) {
      bias_gelu_fwd_kernel<scalar_t, V, false><<<grid, kThreads, 0, stream>>>(xt, bt, yt, n, cols);
    } else if (use_tanh) {
      bias_gelu_fwd_kernel<scalar_t, 1, true><<<grid, kThreads, 0, stream>>>(xt, bt, yt, n, cols);
    } else {
      bias_gelu_fwd_kernel<scalar_t, 1, false><<<grid, kThreads, 0, stream>>>(xt, bt, yt, n, cols);
    }
  });
}

int64_t bias_gelu_bwd_chunks(int64_t rows, int64_t cols) {
  const int64_t tiles = ceil_div(cols, 256);
  int64_t chunks = (8 * static_cast<int64_t>(num_sms()) + tiles - 1) / tiles;
  chunks = std::min<int64_t>(chunks, ceil_div(rows, 32));
  return std::max<int64_t>(chunks, 1);
}

void bias_gelu_bwd(const void* dy, const void* x, const void* bias, void* dx, void* dbias,
                   float* workspace, int64_t rows, int64_t cols, bool use_tanh, DType dt,
                   cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t chunks = bias_gelu_bwd_chunks(rows, cols);
  const int64_t per_chunk = ceil_div(std::max<int64_t>(rows, 1), chunks);
  dim3 block(32, 8);
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto dyt = static_cast<const scalar_t*>(dy);
    auto xt = static_cast<const scalar_t*>(x);
    auto bt = static_cast<const scalar_t*>(bias);
    auto dxt = static_cast<scalar_t*>(dx);
    const bool vec = can_vec<scalar_t>(cols, {dy, x, bias, dx});
    dim3 grid(static_cast<unsigned>(ceil_div(cols, 32 * (vec ? V : 1))),
              static_cast<unsigned>(chunks));
    if (vec && use_tanh) {
      bias_gelu_bwd_kernel<scalar_t, V, true><<<grid, block, 0, stream>>>(
          dyt, xt, bt, dxt, workspace, rows, (int)cols, per_chunk);
    } else if (vec) {
      bias_gelu_bwd_kernel<scalar_t, V, false><<<grid, block, 0, stream>>>(
          dyt, xt, bt, dxt, workspace, rows, (int)cols, per_chunk);
    } else if (use_tanh) {
      bias_gelu_bwd_kernel<scalar_t, 1, true><<<grid, block, 0, stream>>>(
          dyt, xt, bt, dxt, workspace, rows, (int)cols, per_chunk);
    } else {
      bias_gelu_bwd_kernel<scalar_t, 1, false><<<grid, block, 0, stream>>>(
          dyt, xt, bt, dxt, workspace, rows, (int)cols, per_chunk);
    }
    launch_column_sum<scalar_t>(workspace, dbias, chunks, cols, stream);
  });
}

}  // namespace hybrid
