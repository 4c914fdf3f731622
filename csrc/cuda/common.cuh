// Helpers shared by the hybrid_cuda_ops kernels: dtype dispatch, fp32 conversion,
// aligned vector access, warp/block reductions and the column-sum kernel used for
// weight/bias gradients.
//
// The .cu files do not include torch: they take raw pointers, a DType code and a
// cudaStream_t (see ops.h), so they compile fast and the glue in ops.cpp is the
// only place that knows about at::Tensor. cpp_extension compiles .cu files with
// -D__CUDA_NO_HALF_CONVERSIONS__ etc., so every conversion here is explicit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <initializer_list>

#include "ops.h"

namespace hybrid {

// ---- fp32 <-> storage dtype (round to nearest even, like torch's .to()) ----
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// N elements of T moved as one 16-byte (or smaller) transaction.
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

template <typename T, int N>
__device__ __forceinline__ void load_f(const T* p, float (&out)[N]) {
  Vec<T, N> a = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f(a.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_f(T* p, const float (&in)[N]) {
  Vec<T, N> a;
#pragma unroll
  for (int i = 0; i < N; ++i) a.v[i] = from_f<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = a;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether 16-byte vector loads/stores of T work: every row a whole number of
// vectors and every base pointer 16-byte aligned.
template <typename T>
bool can_vec(int64_t cols, std::initializer_list<const void*> ptrs) {
  if (cols % (16 / sizeof(T))) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

// Number of SMs of the current device (cached per process; one device per rank).
int num_sms();

// out[c] = sum_k partial[k * cols + c] over k < chunks, in a fixed order so the
// result is deterministic; written in T. Used for dweight/dbias after per-block
// partial sums.
template <typename T>
__global__ void column_sum_kernel(const float* __restrict__ partial, T* __restrict__ out,
                                  int64_t chunks, int64_t cols) {
  // blockDim (32, 8): threadIdx.x picks the column, threadIdx.y strides the chunks,
  // then the 8 partial sums of a column are added through shared memory.
  __shared__ float buf[8][33];
  int64_t c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < cols)
    for (int64_t k = threadIdx.y; k < chunks; k += 8) acc += partial[k * cols + c];
  buf[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.f;
#pragma unroll
    for (int y = 0; y < 8; ++y) s += buf[y][threadIdx.x];
    out[c] = from_f<T>(s);
  }
}

template <typename T>
inline void launch_column_sum(const float* partial, void* out, int64_t chunks, int64_t cols,
                              cudaStream_t stream) {
  dim3 block(32, 8);
  dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)));
  column_sum_kernel<T><<<grid, block, 0, stream>>>(partial, static_cast<T*>(out), chunks, cols);
}

}  // namespace hybrid

// Calls BODY with `scalar_t` bound to the storage type of DTYPE.
#define HYBRID_DISPATCH(DTYPE, ...)                                  \
  switch (DTYPE) {                                                  \
    case hybrid::DType::kFloat: {                                   \
      using scalar_t = float;                                       \
      __VA_ARGS__;                                                  \
      break;                                                        \
    }                                                               \
    case hybrid::DType::kBFloat16: {                                \
      using scalar_t = __nv_bfloat16;                               \
      __VA_ARGS__;                                                  \
      break;                                                        \
    }                                                               \
    case hybrid::DType::kHalf: {                                    \
      using scalar_t = __half;                                      \
      __VA_ARGS__;                                                  \
      break;                                                        \
    }                                                               \
  }
