// Fused LayerNorm over the last dimension, forward and backward.
//
// Layout: a block holds ROWS_PER_BLOCK rows side by side (threadIdx.y), each row
// owned by `wpr` warps (threadIdx.x in [0, 32 * wpr)). Narrow rows use one warp
// per row (no __syncthreads in the reductions); rows of 4096+ use 4 warps so a
// wide row still has enough loads in flight. Each thread walks its row in
// 16-byte vectors when the row length and pointers allow, else element by element.
// The row is re-read from L1/L2 for the second pass instead of being held in
// registers, which keeps one kernel for every hidden size.
//
// Statistics are computed in fp32 in two passes (mean, then mean of squared
// deviations): no cancellation, unlike E[x^2] - E[x]^2.
//
// Backward: dx with the same row layout; dweight/dbias by a column-tiled kernel
// that writes per-row-chunk partial sums (2 x chunks x cols floats) and a
// column_sum kernel that adds the chunks in a fixed order (deterministic).
#include "common.cuh"

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

template <typename T>
int vec_width(int64_t cols, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  if (cols % V) return 1;
  for (const void* p : ptrs)
    if (!aligned16(p)) return 1;
  return V;
}

}  // namespace

void layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean,
                    float* rstd, int64_t rows, int64_t cols, float eps, DType dt,
                    cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const RowLayout L = row_layout(cols);
  dim3 block(32 * L.wpr, L.rpb), grid(static_cast<unsigned>(ceil_div(rows, L.rpb)));
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto xt = static_cast<const scalar_t*>(x);
    auto wt = static_cast<const scalar_t*>(w);
    auto bt = static_cast<const scalar_t*>(b);
    auto yt = static_cast<scalar_t*>(y);
    if (vec_width<scalar_t>(cols, {x, w, b, y}) == V)
      ln_fwd_kernel<scalar_t, V><<<grid, block, 0, stream>>>(xt, wt, bt, yt, mean, rstd, rows,
                                                              (int)cols, eps, L.wpr);
    else
      ln_fwd_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(xt, wt, bt, yt, mean, rstd, rows,
                                                              (int)cols, eps, L.wpr);
  });
}

int64_t layer_norm_bwd_chunks(int64_t rows, int64_t cols) {
  // Enough (column tile x row chunk) blocks to fill the GPU a few times over,
  // chunks of at least 32 rows so the partial buffer stays small.
  const int64_t tiles = ceil_div(cols, 256);
  int64_t chunks = (8 * static_cast<int64_t>(num_sms()) + tiles - 1) / tiles;
  chunks = std::min<int64_t>(chunks, ceil_div(rows, 32));
  return std::max<int64_t>(chunks, 1);
}

void layer_norm_bwd(const void* dy, const void* x, const void* w, const float* mean,
                    const float* rstd, void* dx, void* dw, void* db, float* workspace,
                    int64_t rows, int64_t cols, DType dt, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t chunks = layer_norm_bwd_chunks(rows, cols);
  const int64_t per_chunk = ceil_div(std::max<int64_t>(rows, 1), chunks);
  float* part_w = workspace;
  float* part_b = workspace + chunks * cols;
  const RowLayout L = row_layout(cols);
  dim3 block(32 * L.wpr, L.rpb), grid(static_cast<unsigned>(ceil_div(rows, L.rpb)));
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto dyt = static_cast<const scalar_t*>(dy);
    auto xt = static_cast<const scalar_t*>(x);
    auto wt = static_cast<const scalar_t*>(w);
    auto dxt = static_cast<scalar_t*>(dx);
    const bool vec = vec_width<scalar_t>(cols, {dy, x, w, dx}) == V;
    if (rows > 0) {
      if (vec)
        ln_bwd_dx_kernel<scalar_t, V><<<grid, block, 0, stream>>>(dyt, xt, wt, mean, rstd, dxt,
                                                                   rows, (int)cols, L.wpr);
      else
        ln_bwd_dx_kernel<scalar_t, 1><<<grid, block, 0, stream>>>(dyt, xt, wt, mean, rstd, dxt,
                                                                   rows, (int)cols, L.wpr);
    }
    dim3 tblock(32, 8);
    if (vec) {
      dim3 tgrid(static_cast<unsigned>(ceil_div(cols, 32 * V)), static_cast<unsigned>(chunks));
      ln_bwd_dwb_kernel<scalar_t, V><<<tgrid, tblock, 0, stream>>>(
          dyt, xt, mean, rstd, part_w, part_b, rows, (int)cols, per_chunk);
    } else {
      dim3 tgrid(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(chunks));
      ln_bwd_dwb_kernel<scalar_t, 1><<<tgrid, tblock, 0, stream>>>(
          dyt, xt, mean, rstd, part_w, part_b, rows, (int)cols, per_chunk);
    }
    launch_column_sum<scalar_t>(part_w, dw, chunks, cols, stream);
    launch_column_sum<scalar_t>(part_b, db, chunks, cols, stream);
  });
}

}  // namespace hybrid
