// LayerNorm fallback kernels: rows that are unaligned, of an odd width, or too
// wide to hold in registers (layer_norm.cu takes every other row).
//
// A block holds rows side by side (threadIdx.y), each row owned by `wpr` warps;
// the row is re-read from L1/L2 for every pass; dx by one kernel, the
// dweight/dbias partial sums of row chunks by a column-tiled kernel.
#include <type_traits>

#include "common.cuh"
#include "layer_norm.cuh"

namespace hybrid {
namespace {


constexpr int kThreads = 256;

struct RowLayout {
  int wpr;   // warps per row
  int rpb;   // rows per block
};

RowLayout row_layout(int64_t cols) {
  int wpr = cols >= 4096 ? 4 : 1;
  return {wpr, kThreads / (32 * wpr)};
}

// Sum of v over the threads of this row (threadIdx.y); every thread of the block
// must call it (it may __syncthreads).
__device__ __forceinline__ float row_sum(float v, int wpr, float (*sh)[8]) {
  v = warp_sum(v);
  if (wpr == 1) return v;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // previous readers of sh are done
  if (lane == 0) sh[threadIdx.y][warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < wpr; ++i) s += sh[threadIdx.y][i];
  return s;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
ln_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
              T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
              int64_t rows, int cols, float eps, int wpr) {
  __shared__ float sh[8][8];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;  // dead rows still join the reductions
  const int stride = blockDim.x * VEC;
  const T* xr = x + (live ? row : 0) * cols;

  float s = 0.f;
  if (live)
#pragma unroll 4
    for (int c = threadIdx.x * VEC; c < cols; c += stride) {
      float a[VEC];
      load_f<T, VEC>(xr + c, a);
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += a[k];
    }
  const float mu = row_sum(s, wpr, sh) / cols;

  float q = 0.f;
  if (live)
#pragma unroll 4
    for (int c = threadIdx.x * VEC; c < cols; c += stride) {
      float a[VEC];
      load_f<T, VEC>(xr + c, a);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = a[k] - mu;
        q += d * d;
      }
    }
  const float rstd = rsqrtf(row_sum(q, wpr, sh) / cols + eps);
  if (!live) return;
  if (threadIdx.x == 0) {
    mean_out[row] = mu;
    rstd_out[row] = rstd;
  }
  T* yr = y + row * cols;
#pragma unroll 4
  for (int c = threadIdx.x * VEC; c < cols; c += stride) {
    float a[VEC], wv[VEC], bv[VEC], o[VEC];
    load_f<T, VEC>(xr + c, a);
    load_f<T, VEC>(w + c, wv);
    load_f<T, VEC>(b + c, bv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = (a[k] - mu) * rstd * wv[k] + bv[k];
    store_f<T, VEC>(yr + c, o);
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w,  xhat = (x - mu) * rstd
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
ln_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                 const float* __restrict__ mean, const float* __restrict__ rstd_in,
                 T* __restrict__ dx, int64_t rows, int cols, int wpr) {
  __shared__ float sh[8][8];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const int stride = blockDim.x * VEC;
  const int64_t off = (live ? row : 0) * cols;
  const float mu = live ? mean[row] : 0.f, rstd = live ? rstd_in[row] : 0.f;

  float s1 = 0.f, s2 = 0.f;
  if (live)
#pragma unroll 4
    for (int c = threadIdx.x * VEC; c < cols; c += stride) {
      float a[VEC], d[VEC], wv[VEC];
      load_f<T, VEC>(x + off + c, a);
      load_f<T, VEC>(dy + off + c, d);
      load_f<T, VEC>(w + c, wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float g = d[k] * wv[k];
        s1 += g;
        s2 += g * (a[k] - mu) * rstd;
      }
    }
  const float mean_g = row_sum(s1, wpr, sh) / cols;
  const float mean_gx = row_sum(s2, wpr, sh) / cols;
  if (!live) return;
#pragma unroll 4
  for (int c = threadIdx.x * VEC; c < cols; c += stride) {
    float a[VEC], d[VEC], wv[VEC], o[VEC];
    load_f<T, VEC>(x + off + c, a);
    load_f<T, VEC>(dy + off + c, d);
    load_f<T, VEC>(w + c, wv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float xhat = (a[k] - mu) * rstd;
      o[k] = rstd * (d[k] * wv[k] - mean_g - xhat * mean_gx);
    }
    store_f<T, VEC>(dx + off + c, o);
  }
}

// Partial dweight = sum dy * xhat and dbias = sum dy over one chunk of rows, for a
// tile of 32 * VEC columns. Block (32, 8): threadIdx.x owns VEC adjacent columns,
// threadIdx.y strides the chunk's rows; the 8 row-groups are added in shared memory.
template <typename T, int VEC>
__global__ void __launch_bounds__(256)
ln_bwd_dwb_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                  const float* __restrict__ mean, const float* __restrict__ rstd,
                  float* __restrict__ part_w, float* __restrict__ part_b, int64_t rows,
                  int cols, int64_t rows_per_chunk) {
  __shared__ float shw[8][VEC * 32 + 1];
  __shared__ float shb[8][VEC * 32 + 1];
  const int c0 = (blockIdx.x * 32 + threadIdx.x) * VEC;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  float aw[VEC], ab[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) aw[k] = ab[k] = 0.f;
  if (c0 < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      float a[VEC], d[VEC];
      load_f<T, VEC>(x + r * cols + c0, a);
      load_f<T, VEC>(dy + r * cols + c0, d);
      const float mu = mean[r], rs = rstd[r];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        aw[k] += d[k] * ((a[k] - mu) * rs);
        ab[k] += d[k];
      }
    }
  // column k*32 + tx within the tile layout keeps the shared stores conflict-free
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    shw[threadIdx.y][k * 32 + threadIdx.x] = aw[k];
    shb[threadIdx.y][k * 32 + threadIdx.x] = ab[k];
  }
  __syncthreads();
  if (threadIdx.y == 0 && c0 < cols) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float sw = 0.f, sb = 0.f;
#pragma unroll
      for (int y = 0; y < 8; ++y) {
        sw += shw[y][k * 32 + threadIdx.x];
        sb += shb[y][k * 32 + threadIdx.x];
      }
      part_w[blockIdx.y * static_cast<int64_t>(cols) + c0 + k] = sw;
      part_b[blockIdx.y * static_cast<int64_t>(cols) + c0 + k] = sb;
    }
  }
}

}  // namespace

// The kernels' vector width as a type, so one launch site serves both widths.
template <int V>
using Width = std::integral_constant<int, V>;

template <typename T>
void layer_norm_fwd_multipass(const T* x, const T* w, const T* b, T* y, float* mean,
                              float* rstd, int64_t rows, int cols, float eps, bool vec,
                              cudaStream_t stream) {
  const RowLayout L = row_layout(cols);
  dim3 block(32 * L.wpr, L.rpb), grid(static_cast<unsigned>(ceil_div(rows, L.rpb)));
  auto launch = [&](auto width) {
    ln_fwd_kernel<T, decltype(width)::value><<<grid, block, 0, stream>>>(
        x, w, b, y, mean, rstd, rows, cols, eps, L.wpr);
  };
  vec ? launch(Width<16 / sizeof(T)>{}) : launch(Width<1>{});
}

template <typename T>
void layer_norm_bwd_multipass(const T* dy, const T* x, const T* w, const float* mean,
                              const float* rstd, T* dx, float* part_w, float* part_b,
                              int64_t rows, int cols, int64_t chunks, int64_t per_chunk,
                              bool vec, cudaStream_t stream) {
  const RowLayout L = row_layout(cols);
  dim3 block(32 * L.wpr, L.rpb), grid(static_cast<unsigned>(ceil_div(rows, L.rpb)));
  auto launch = [&](auto width) {
    constexpr int V = decltype(width)::value;
    if (rows > 0)
      ln_bwd_dx_kernel<T, V><<<grid, block, 0, stream>>>(dy, x, w, mean, rstd, dx, rows, cols,
                                                         L.wpr);
    dim3 tblock(32, 8), tgrid(static_cast<unsigned>(ceil_div(cols, 32 * V)),
                              static_cast<unsigned>(chunks));
    ln_bwd_dwb_kernel<T, V><<<tgrid, tblock, 0, stream>>>(dy, x, mean, rstd, part_w, part_b,
                                                          rows, cols, per_chunk);
  };
  vec ? launch(Width<16 / sizeof(T)>{}) : launch(Width<1>{});
}

#define HYBRID_LN_MULTIPASS(T)                                                             \
  template void layer_norm_fwd_multipass<T>(const T*, const T*, const T*, T*, float*, float*, \
                                            int64_t, int, float, bool, cudaStream_t);        \
  template void layer_norm_bwd_multipass<T>(const T*, const T*, const T*, const float*,     \
                                            const float*, T*, float*, float*, int64_t, int,  \
                                            int64_t, int64_t, bool, cudaStream_t);
HYBRID_LN_MULTIPASS(float)
HYBRID_LN_MULTIPASS(__nv_bfloat16)
HYBRID_LN_MULTIPASS(__half)
#undef HYBRID_LN_MULTIPASS

}  // namespace hybrid
