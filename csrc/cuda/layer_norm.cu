// Fused LayerNorm over the last dimension, forward and backward.
//
// Fast path (16-byte aligned rows whose length is a multiple of the vector width
// and that fit in registers; see "Register-cached kernels" below): each row is
// read from global memory once and held in registers, forward computes mean and
// then variance (two-pass, fp32, no E[x^2] - E[x]^2 cancellation) from those
// registers; backward computes dx and the per-column dweight/dbias partial sums
// of a chunk of rows in one pass, writes one partial row per block, and
// ln_colsum_kernel adds the chunks in a fixed order (deterministic).
//
// Other rows (unaligned / odd widths / too wide for registers) go to the
// multi-pass kernels of layer_norm_multipass.cu; their partial sums end in the
// same ln_colsum_kernel.
#include "common.cuh"
#include "layer_norm.cuh"

namespace hybrid {
namespace {

// Register-cached kernels (the fast path: 16-byte vectors, rows that fit).
//
// A row is owned by `wpr` warps (tpr = 32 * wpr threads, threadIdx.x); thread t
// holds vectors j = t + i * tpr (i < NV) of the row in registers in the storage
// type, so the row is read from global memory exactly once. Rows of a block sit
// side by side in threadIdx.y. Sums across the warps of a row go through shared
// memory with one __syncthreads each; alternate buffers make a second barrier
// unnecessary (a warp can only overwrite a buffer after every warp has passed
// the barrier of the reduction in between, i.e. has read it).

constexpr int kMaxWprFwd = 16;  // up to 512 threads per row
constexpr int kMaxWprBwd = 16;  // up to 512 threads per row
constexpr int kFwdMaxElems = 64;  // fp32 values per thread a forward row slice may hold
constexpr int kBwdMaxElems = 16;  // backward also keeps dw/db accumulators per column

// Sum over the `wpr` warps of this row. sh: this row's [kMax] slot of one buffer.
// Every thread of the block calls it when wpr > 1 (it has a __syncthreads).
__device__ __forceinline__ float group_sum(float v, int wpr, float* sh) {
  v = warp_sum(v);
  if (wpr == 1) return v;
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < wpr; ++i) s += sh[i];
  return s;
}

__device__ __forceinline__ float2 group_sum2(float a, float b, int wpr, float2* sh) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (wpr == 1) return make_float2(a, b);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = make_float2(a, b);
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  for (int i = 0; i < wpr; ++i) {
    const float2 t = sh[i];
    s.x += t.x;
    s.y += t.y;
  }
  return s;
}

// Block (32 * wpr, rpb), rpb <= 4; one row per threadIdx.y, grid over row groups.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(512)
ln_fwd_reg_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                  T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                  int64_t rows, int cols, float eps, int wpr) {
  using V = Vec<T, VEC>;
  __shared__ float sh[2][4][kMaxWprFwd];
  const int tpr = blockDim.x, tid = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;  // dead rows still join the reductions
  const int nvec = cols / VEC;
  const V* xr = reinterpret_cast<const V*>(x + (live ? row : 0) * static_cast<int64_t>(cols));

  V xv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = tid + i * tpr;
    if (live && j < nvec) xv[i] = xr[j];
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = tid + i * tpr;
    if (live && j < nvec)
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += to_f(xv[i].v[k]);
  }
  const float mu = group_sum(s, wpr, sh[0][threadIdx.y]) / cols;
  float q = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = tid + i * tpr;
    if (live && j < nvec)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = to_f(xv[i].v[k]) - mu;
        q += d * d;
      }
  }
  const float rstd = rsqrtf(group_sum(q, wpr, sh[1][threadIdx.y]) / cols + eps);
  if (!live) return;
  if (tid == 0) {
    mean_out[row] = mu;
    rstd_out[row] = rstd;
  }
  const V* wr = reinterpret_cast<const V*>(w);
  const V* br = reinterpret_cast<const V*>(b);
  V* yr = reinterpret_cast<V*>(y + row * cols);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = tid + i * tpr;
    if (j < nvec) {
      const V wv = wr[j], bv = br[j];
      V o;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        o.v[k] = from_f<T>((to_f(xv[i].v[k]) - mu) * rstd * to_f(wv.v[k]) + to_f(bv.v[k]));
      yr[j] = o;
    }
  }
}

// dx for every row plus the dweight/dbias partial sums of one chunk of rows.
// Block (32 * wpr, rpb), grid = chunks: block k handles rows [k * per_chunk,
// (k + 1) * per_chunk), its threadIdx.y groups taking rows in turn, and keeps
// per-column sums of dy * xhat and dy in registers. At the end the rpb groups are
// added in shared memory in a fixed order (dynamic smem: 2 * cols floats when
// rpb > 1) and the block writes one partial row of part_w and of part_b.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(512)
ln_bwd_reg_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                  const float* __restrict__ mean, const float* __restrict__ rstd_in,
                  T* __restrict__ dx, float* __restrict__ part_w, float* __restrict__ part_b,
                  int64_t rows, int cols, int64_t per_chunk, int wpr) {
  static_assert(VEC % 4 == 0, "partials are written as float4");
  using V = Vec<T, VEC>;
  __shared__ float2 sh[2][8][kMaxWprBwd];  // rpb <= 8
  extern __shared__ float4 red4[];
  const int tpr = blockDim.x, tid = threadIdx.x, rpb = blockDim.y;
  const int nvec = cols / VEC;
  const V* wr = reinterpret_cast<const V*>(w);

  V wv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = tid + i * tpr;
    if (j < nvec) wv[i] = wr[j];
  }
  float aw[NV][VEC], ab[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) aw[i][k] = ab[i][k] = 0.f;

  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * per_chunk;
  const int64_t r1 = min(rows, r0 + per_chunk);
  const int64_t iters = r1 > r0 ? (r1 - r0 + rpb - 1) / rpb : 0;  // same in every thread
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t r = r0 + it * rpb + threadIdx.y;
    const bool live = r < r1;
    const int64_t off = (live ? r : 0) * static_cast<int64_t>(cols);
    const V* xr = reinterpret_cast<const V*>(x + off);
    const V* dyr = reinterpret_cast<const V*>(dy + off);
    V xv[NV], dv[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = tid + i * tpr;
      if (live && j < nvec) {
        xv[i] = xr[j];
        dv[i] = dyr[j];
      }
    }
    const float mu = live ? mean[r] : 0.f, rs = live ? rstd_in[r] : 0.f;
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = tid + i * tpr;
      if (live && j < nvec)
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float d = to_f(dv[i].v[k]);
          const float xh = (to_f(xv[i].v[k]) - mu) * rs;
          const float g = d * to_f(wv[i].v[k]);
          s1 += g;
          s2 += g * xh;
          aw[i][k] += d * xh;
          ab[i][k] += d;
        }
    }
    const float2 t = group_sum2(s1, s2, wpr, sh[it & 1][threadIdx.y]);
    if (live) {
      const float mean_g = t.x / cols, mean_gx = t.y / cols;
      V* dxr = reinterpret_cast<V*>(dx + off);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int j = tid + i * tpr;
        if (j < nvec) {
          V o;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xh = (to_f(xv[i].v[k]) - mu) * rs;
            const float g = to_f(dv[i].v[k]) * to_f(wv[i].v[k]);
            o.v[k] = from_f<T>(rs * (g - mean_g - xh * mean_gx));
          }
          dxr[j] = o;
        }
      }
    }
  }

  float* pw = part_w + static_cast<int64_t>(blockIdx.x) * cols;
  float* pb = part_b + static_cast<int64_t>(blockIdx.x) * cols;
  if (rpb == 1) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = tid + i * tpr;
      if (j < nvec)
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
          reinterpret_cast<float4*>(pw + j * VEC)[q] =
              make_float4(aw[i][4 * q], aw[i][4 * q + 1], aw[i][4 * q + 2], aw[i][4 * q + 3]);
          reinterpret_cast<float4*>(pb + j * VEC)[q] =
              make_float4(ab[i][4 * q], ab[i][4 * q + 1], ab[i][4 * q + 2], ab[i][4 * q + 3]);
        }
    }
    return;
  }
  // rpb > 1: red4 holds cols / 4 float4 of dw sums, then cols / 4 of db sums.
  float4* rw = red4;
  float4* rb = red4 + cols / 4;
  for (int grp = 0; grp < rpb; ++grp) {
    if (threadIdx.y == grp) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int j = tid + i * tpr;
        if (j < nvec)
#pragma unroll
          for (int q = 0; q < VEC / 4; ++q) {
            const int e = j * (VEC / 4) + q;
            float4 a = make_float4(aw[i][4 * q], aw[i][4 * q + 1], aw[i][4 * q + 2],
                                   aw[i][4 * q + 3]);
            float4 c = make_float4(ab[i][4 * q], ab[i][4 * q + 1], ab[i][4 * q + 2],
                                   ab[i][4 * q + 3]);
            if (grp > 0) {
              const float4 pa = rw[e], pc = rb[e];
              a = make_float4(pa.x + a.x, pa.y + a.y, pa.z + a.z, pa.w + a.w);
              c = make_float4(pc.x + c.x, pc.y + c.y, pc.z + c.z, pc.w + c.w);
            }
            rw[e] = a;
            rb[e] = c;
          }
      }
    }
    __syncthreads();
  }
  const int nthreads = tpr * rpb, flat = threadIdx.y * tpr + tid;
  for (int e = flat; e < cols / 4; e += nthreads) {
    reinterpret_cast<float4*>(pw)[e] = rw[e];
    reinterpret_cast<float4*>(pb)[e] = rb[e];
  }
}

// dw[c] = sum_k part_w[k][c], db likewise (blockIdx.y picks which), chunks added
// in a fixed order: thread (tx, ty) sums chunks ty, ty + 16, ..., then the 16
// partial sums of a column are added in order through shared memory.
template <typename T>
__global__ void __launch_bounds__(512)
ln_colsum_kernel(const float* __restrict__ part, T* __restrict__ dw, T* __restrict__ db,
                 int64_t chunks, int cols) {
  __shared__ float buf[16][33];
  const float* p = part + (blockIdx.y ? chunks * cols : 0);
  T* out = blockIdx.y ? db : dw;
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < cols)
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < chunks; k += 16) acc += p[k * cols + c];
  buf[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.f;
#pragma unroll
    for (int y = 0; y < 16; ++y) s += buf[y][threadIdx.x];
    out[c] = from_f<T>(s);
  }
}

struct RegCfg {
  int nv;   // 16-byte vectors per thread (1, 2, 4, 8); 0: the row does not fit
  int wpr;  // warps per row
};

// Fewest warps per row whose threads hold the row in at most max_nv vectors each.
RegCfg reg_cfg(int64_t nvec, int max_nv, int max_wpr) {
  for (int wpr = 1; wpr <= max_wpr; wpr *= 2) {
    const int64_t need = ceil_div(nvec, 32 * wpr);
    if (need <= max_nv) {
      int nv = 1;
      while (nv < need) nv *= 2;
      return {nv, wpr};
    }
  }
  return {0, 0};
}

template <typename T, int VEC, int NV>
void launch_fwd_reg(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd,
                    int64_t rows, int cols, float eps, int wpr, cudaStream_t stream) {
  if constexpr (NV * VEC <= kFwdMaxElems) {
    const int rpb = std::max(1, 4 / wpr);
    dim3 block(32 * wpr, rpb), grid(static_cast<unsigned>(ceil_div(rows, rpb)));
    ln_fwd_reg_kernel<T, VEC, NV><<<grid, block, 0, stream>>>(x, w, b, y, mean, rstd, rows,
                                                               cols, eps, wpr);
  }
}

template <typename T, int VEC, int NV>
void launch_bwd_reg(const T* dy, const T* x, const T* w, const float* mean, const float* rstd,
                    T* dx, float* part_w, float* part_b, int64_t rows, int cols,
                    int64_t chunks, int64_t per_chunk, int wpr, cudaStream_t stream) {
  if constexpr (NV * VEC <= kBwdMaxElems) {
    const int rpb = std::max(1, 8 / wpr);
    const size_t smem = rpb > 1 ? 2 * sizeof(float) * static_cast<size_t>(cols) : 0;
    dim3 block(32 * wpr, rpb), grid(static_cast<unsigned>(chunks));
    ln_bwd_reg_kernel<T, VEC, NV><<<grid, block, smem, stream>>>(
        dy, x, w, mean, rstd, dx, part_w, part_b, rows, cols, per_chunk, wpr);
  }
}

}  // namespace

void layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean,
                    float* rstd, int64_t rows, int64_t cols, float eps, DType dt,
                    cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto xt = static_cast<const scalar_t*>(x);
    auto wt = static_cast<const scalar_t*>(w);
    auto bt = static_cast<const scalar_t*>(b);
    auto yt = static_cast<scalar_t*>(y);
    const bool vec = can_vec<scalar_t>(cols, {x, w, b, y});
    const RegCfg R = vec ? reg_cfg(cols / V, kFwdMaxElems / V < 8 ? kFwdMaxElems / V : 8,
                                   kMaxWprFwd)
                         : RegCfg{0, 0};
    const int c = static_cast<int>(cols);
    switch (R.nv) {
      case 1: launch_fwd_reg<scalar_t, V, 1>(xt, wt, bt, yt, mean, rstd, rows, c, eps, R.wpr, stream); break;
      case 2: launch_fwd_reg<scalar_t, V, 2>(xt, wt, bt, yt, mean, rstd, rows, c, eps, R.wpr, stream); break;
      case 4: launch_fwd_reg<scalar_t, V, 4>(xt, wt, bt, yt, mean, rstd, rows, c, eps, R.wpr, stream); break;
      case 8: launch_fwd_reg<scalar_t, V, 8>(xt, wt, bt, yt, mean, rstd, rows, c, eps, R.wpr, stream); break;
      default:  // unaligned or very wide rows
        layer_norm_fwd_multipass<scalar_t>(xt, wt, bt, yt, mean, rstd, rows, c, eps, vec, stream);
    }
  });
}

int64_t layer_norm_bwd_chunks(int64_t rows, int64_t cols) {
  // One partial row per block of the backward kernel: about two resident
  // 256-thread blocks per SM, and at least 8 rows per chunk.
  (void)cols;
  int64_t chunks = std::min<int64_t>(2 * static_cast<int64_t>(num_sms()), ceil_div(rows, 8));
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
  HYBRID_DISPATCH(dt, {
    constexpr int V = 16 / sizeof(scalar_t);
    auto dyt = static_cast<const scalar_t*>(dy);
    auto xt = static_cast<const scalar_t*>(x);
    auto wt = static_cast<const scalar_t*>(w);
    auto dxt = static_cast<scalar_t*>(dx);
    const int c = static_cast<int>(cols);
    const bool vec = can_vec<scalar_t>(cols, {dy, x, w, dx}) && aligned16(workspace);
    const RegCfg R = vec ? reg_cfg(cols / V, kBwdMaxElems / V, kMaxWprBwd) : RegCfg{0, 0};
    switch (R.nv) {
      case 1: launch_bwd_reg<scalar_t, V, 1>(dyt, xt, wt, mean, rstd, dxt, part_w, part_b, rows, c, chunks, per_chunk, R.wpr, stream); break;
      case 2: launch_bwd_reg<scalar_t, V, 2>(dyt, xt, wt, mean, rstd, dxt, part_w, part_b, rows, c, chunks, per_chunk, R.wpr, stream); break;
      case 4: launch_bwd_reg<scalar_t, V, 4>(dyt, xt, wt, mean, rstd, dxt, part_w, part_b, rows, c, chunks, per_chunk, R.wpr, stream); break;
      case 8: launch_bwd_reg<scalar_t, V, 8>(dyt, xt, wt, mean, rstd, dxt, part_w, part_b, rows, c, chunks, per_chunk, R.wpr, stream); break;
      default:  // unaligned or very wide rows
        layer_norm_bwd_multipass<scalar_t>(dyt, xt, wt, mean, rstd, dxt, part_w, part_b, rows, c,
                                           chunks, per_chunk, vec, stream);
    }
    dim3 sblock(32, 16), sgrid(static_cast<unsigned>(ceil_div(cols, 32)), 2);
    ln_colsum_kernel<scalar_t><<<sgrid, sblock, 0, stream>>>(
        workspace, static_cast<scalar_t*>(dw), static_cast<scalar_t*>(db), chunks, c);
  });
}

}  // namespace hybrid
