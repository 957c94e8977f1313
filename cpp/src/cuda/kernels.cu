// CUDA kernels of Kiln's fused ops: the formulas of include/kernels.h on the GPU.
//
// Elementwise work runs in grid-stride loops sized to the device (a few blocks per
// SM), so any size works with one launch. Reductions are deterministic: no atomics
// on floating point; partial sums land in a workspace in a fixed order and are
// summed by a second kernel, so the same input gives the same bits every run.
//
// Host side: launchers declared in launch.h, explicitly instantiated for float and
// double at the end. Only c10's CUDA headers are included here (for the launch
// check); tensors and dispatch stay in ../cuda_ops.cc.

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "launch.h"

namespace kiln::ops::cuda {
namespace {

constexpr int kThreads = 256;  // elementwise and swish-reduction blocks
constexpr int kWarp = 32;

// ----- device math, overloaded so that float stays in float -----

__device__ __forceinline__ float d_erf(float v) { return erff(v); }
__device__ __forceinline__ double d_erf(double v) { return erf(v); }
__device__ __forceinline__ float d_exp(float v) { return expf(v); }
__device__ __forceinline__ double d_exp(double v) { return exp(v); }
__device__ __forceinline__ float d_log(float v) { return logf(v); }
__device__ __forceinline__ double d_log(double v) { return log(v); }

template <typename T>
__device__ __forceinline__ T gelu(T z) {
  return z * T(0.5) * (T(1) + d_erf(z * T(M_SQRT1_2)));
}

// d/dz gelu(z) = Phi(z) + z * phi(z).
template <typename T>
__device__ __forceinline__ T gelu_grad(T z) {
  const T cdf = T(0.5) * (T(1) + d_erf(z * T(M_SQRT1_2)));
  const T pdf = d_exp(T(-0.5) * z * z) * T(0.3989422804014327);  // 1/sqrt(2 pi)
  return cdf + z * pdf;
}

template <typename T>
__device__ __forceinline__ T sigmoid(T z) {
  return T(1) / (T(1) + d_exp(-z));
}

// ----- reductions -----

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};

// Like std::max in the CPU kernel: a NaN on the right is skipped.
struct Max {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// The reduction over the whole block, returned to every thread. blockDim.x is a
// multiple of 32 (at most 1024); `shared` holds 32 elements and is free again on return.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T* shared) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  v = warp_reduce(v, op);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : identity;
  v = warp_reduce(v, op);  // every warp reduces the same values: all threads get the total
  __syncthreads();
  return v;
}

// ----- launch geometry -----

int sm_count() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return std::max(count, 1);
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Enough blocks to fill the device a few times over; the loops stride over the rest.
unsigned int elementwise_blocks(std::int64_t n) {
  return static_cast<unsigned int>(
      std::max<std::int64_t>(1, std::min<std::int64_t>(ceil_div(n, kThreads), sm_count() * 8)));
}

// ----- bias + GELU -----

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                         T* __restrict__ y, std::int64_t n, std::int64_t cols) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    y[i] = gelu(x[i] + bias[i % cols]);
  }
}

// Tiles of 32 columns (threadIdx.x, so that a warp reads 32 neighbours of a row)
// by a chunk of rows (blockIdx.y), walked by 8 row-threads (threadIdx.y).
constexpr int kColTile = 32;
constexpr int kRowThreads = 8;

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ dx,
                                          T* __restrict__ partial, std::int64_t rows,
                                          std::int64_t cols, std::int64_t chunk_rows) {
  __shared__ T tile[kRowThreads][kColTile + 1];
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.y) * chunk_rows;
  const std::int64_t last = min(rows, first + chunk_rows);
  T acc = 0;
  if (j < cols) {
    const T b = bias[j];
    for (std::int64_t i = first + threadIdx.y; i < last; i += kRowThreads) {
      const std::int64_t k = i * cols + j;
      const T g = dy[k] * gelu_grad(x[k] + b);
      dx[k] = g;
      acc += g;
    }
  }
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    T sum = 0;
#pragma unroll
    for (int r = 0; r < kRowThreads; ++r) sum += tile[r][threadIdx.x];
    partial[static_cast<std::int64_t>(blockIdx.y) * cols + j] = sum;
  }
}

// dbias[j] = sum over chunks of partial[chunk, j], in chunk order.
template <typename T>
__global__ void sum_columns_kernel(const T* __restrict__ partial, T* __restrict__ out,
                                   std::int64_t chunks, std::int64_t cols) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < cols; j += stride) {
    T sum = 0;
    for (std::int64_t k = 0; k < chunks; ++k) sum += partial[k * cols + j];
    out[j] = sum;
  }
}

// ----- softmax cross-entropy with label smoothing -----

// One row per warp (kBlockPerRow false: rows of up to kWarpRowMax classes) or per
// block (wide rows). The threads of a row stride over its classes; the row's max,
// sum of exponentials and sum of logits are reduced with warp shuffles (and shared
// memory across the warps of a block).
constexpr std::int64_t kWarpRowMax = 1024;
constexpr int kWarpRowThreads = 128;  // 4 rows per block

template <bool kBlockPerRow>
struct RowGroup {
  __device__ static int lane() { return kBlockPerRow ? threadIdx.x : threadIdx.x % kWarp; }
  __device__ static int width() { return kBlockPerRow ? blockDim.x : kWarp; }
  __device__ static std::int64_t first_row() {
    return kBlockPerRow ? blockIdx.x
                        : static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / kWarp) +
                              threadIdx.x / kWarp;
  }
  __device__ static std::int64_t row_stride() {
    return kBlockPerRow ? gridDim.x : static_cast<std::int64_t>(gridDim.x) * (blockDim.x / kWarp);
  }
  template <typename T, typename Op>
  __device__ static T reduce(T v, Op op, T identity, T* shared) {
    if constexpr (kBlockPerRow) {
      return block_reduce(v, op, identity, shared);
    } else {
      return warp_reduce(v, op);
    }
  }
};

template <typename T, bool kBlockPerRow>
__global__ void softmax_xent_forward_kernel(const T* __restrict__ logits,
                                            const std::int64_t* __restrict__ target, T eps,
                                            T* __restrict__ loss, std::int64_t n, std::int64_t c,
                                            unsigned long long* first_bad_row) {
  using G = RowGroup<kBlockPerRow>;
  __shared__ T shared[kWarp];
  for (std::int64_t row = G::first_row(); row < n; row += G::row_stride()) {
    const T* z = logits + row * c;
    T m = -INFINITY;
    for (std::int64_t j = G::lane(); j < c; j += G::width()) m = Max()(m, z[j]);
    m = G::reduce(m, Max(), T(-INFINITY), shared);
    T s = 0, total = 0;
    for (std::int64_t j = G::lane(); j < c; j += G::width()) {
      s += d_exp(z[j] - m);
      total += z[j];
    }
    s = G::reduce(s, Sum(), T(0), shared);
    total = G::reduce(total, Sum(), T(0), shared);
    if (G::lane() == 0) {
      const std::int64_t t = target[row];
      if (t < 0 || t >= c) {
        loss[row] = T(NAN);
        atomicMin(first_bad_row, static_cast<unsigned long long>(row));
      } else {
        loss[row] = m + d_log(s) - (T(1) - eps) * z[t] - eps * total / T(c);
      }
    }
  }
}

template <typename T, bool kBlockPerRow>
__global__ void softmax_xent_backward_kernel(const T* __restrict__ dloss,
                                             const T* __restrict__ logits,
                                             const std::int64_t* __restrict__ target, T eps,
                                             T* __restrict__ dlogits, std::int64_t n,
                                             std::int64_t c) {
  using G = RowGroup<kBlockPerRow>;
  __shared__ T shared[kWarp];
  for (std::int64_t row = G::first_row(); row < n; row += G::row_stride()) {
    const T* z = logits + row * c;
    T* g = dlogits + row * c;
    T m = -INFINITY;
    for (std::int64_t j = G::lane(); j < c; j += G::width()) m = Max()(m, z[j]);
    m = G::reduce(m, Max(), T(-INFINITY), shared);
    T s = 0;
    for (std::int64_t j = G::lane(); j < c; j += G::width()) s += d_exp(z[j] - m);
    s = G::reduce(s, Sum(), T(0), shared);
    const std::int64_t t = target[row];
    const bool valid = t >= 0 && t < c;
    const T d = dloss[row];
    const T smooth = eps / T(c);
    for (std::int64_t j = G::lane(); j < c; j += G::width()) {
      const T q = (j == t ? T(1) - eps : T(0)) + smooth;
      g[j] = valid ? d * (d_exp(z[j] - m) / s - q) : T(NAN);
    }
  }
}

// ----- Swish-beta -----

template <typename T>
__global__ void swish_forward_kernel(const T* __restrict__ x, const T* __restrict__ beta,
                                     T* __restrict__ y, std::int64_t n) {
  const T b = beta[0];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    y[i] = x[i] * sigmoid(b * x[i]);
  }
}

template <typename T>
__global__ void swish_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      const T* __restrict__ beta, T* __restrict__ dx,
                                      T* __restrict__ partial, std::int64_t n) {
  __shared__ T shared[kWarp];
  const T b = beta[0];
  T acc = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const T xi = x[i];
    const T s = sigmoid(b * xi);
    const T ds = s * (T(1) - s);
    dx[i] = dy[i] * (s + b * xi * ds);
    acc += dy[i] * xi * xi * ds;
  }
  acc = block_reduce(acc, Sum(), T(0), shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block sums the per-block partials (at most kMaxSwishBlocks) in a fixed order.
constexpr int kMaxSwishBlocks = 1024;

template <typename T>
__global__ void sum_partials_kernel(const T* __restrict__ partial, T* __restrict__ out,
                                    std::int64_t count) {
  __shared__ T shared[kWarp];
  T acc = 0;
  for (std::int64_t k = threadIdx.x; k < count; k += blockDim.x) acc += partial[k];
  acc = block_reduce(acc, Sum(), T(0), shared);
  if (threadIdx.x == 0) out[0] = acc;
}

}  // namespace

// ----- launchers -----

template <typename T>
void bias_gelu_forward(const T* x, const T* bias, T* y, std::int64_t rows, std::int64_t cols,
                       cudaStream_t stream) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  bias_gelu_forward_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, bias, y, n, cols);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::int64_t bias_gelu_backward_chunks(std::int64_t rows, std::int64_t cols) {
  // Enough (column tile, row chunk) blocks for about four per SM, each chunk at
  // least 32 rows, at most 1024 chunks (gridDim.y and the final sum stay small).
  const std::int64_t col_tiles = ceil_div(std::max<std::int64_t>(cols, 1), kColTile);
  const std::int64_t wanted = std::max<std::int64_t>(1, 4 * sm_count() / col_tiles);
  const std::int64_t most = std::max<std::int64_t>(1, ceil_div(rows, 32));
  return std::min<std::int64_t>({wanted, most, 1024});
}

template <typename T>
void bias_gelu_backward(const T* dy, const T* x, const T* bias, T* dx, T* dbias, T* workspace,
                        std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const std::int64_t chunks = bias_gelu_backward_chunks(rows, cols);
  const std::int64_t chunk_rows = ceil_div(rows, chunks);
  const dim3 grid(static_cast<unsigned int>(ceil_div(cols, kColTile)),
                  static_cast<unsigned int>(ceil_div(rows, chunk_rows)));
  const dim3 block(kColTile, kRowThreads);
  bias_gelu_backward_kernel<T>
      <<<grid, block, 0, stream>>>(dy, x, bias, dx, workspace, rows, cols, chunk_rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sum_columns_kernel<T><<<elementwise_blocks(cols), kThreads, 0, stream>>>(
      workspace, dbias, static_cast<std::int64_t>(grid.y), cols);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

int row_block_threads(std::int64_t c) { return c >= 8192 ? 512 : 256; }

unsigned int row_grid(std::int64_t n, std::int64_t rows_per_block) {
  return static_cast<unsigned int>(std::max<std::int64_t>(
      1, std::min<std::int64_t>(ceil_div(n, rows_per_block), sm_count() * 16)));
}

}  // namespace

template <typename T>
void softmax_xent_forward(const T* logits, const std::int64_t* target, T eps, T* loss,
                          std::int64_t n, std::int64_t c, unsigned long long* first_bad_row,
                          cudaStream_t stream) {
  if (n == 0) return;
  if (c <= kWarpRowMax) {
    softmax_xent_forward_kernel<T, false>
        <<<row_grid(n, kWarpRowThreads / kWarp), kWarpRowThreads, 0, stream>>>(
            logits, target, eps, loss, n, c, first_bad_row);
  } else {
    softmax_xent_forward_kernel<T, true><<<row_grid(n, 1), row_block_threads(c), 0, stream>>>(
        logits, target, eps, loss, n, c, first_bad_row);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void softmax_xent_backward(const T* dloss, const T* logits, const std::int64_t* target, T eps,
                           T* dlogits, std::int64_t n, std::int64_t c, cudaStream_t stream) {
  if (n == 0 || c == 0) return;
  if (c <= kWarpRowMax) {
    softmax_xent_backward_kernel<T, false>
        <<<row_grid(n, kWarpRowThreads / kWarp), kWarpRowThreads, 0, stream>>>(
            dloss, logits, target, eps, dlogits, n, c);
  } else {
    softmax_xent_backward_kernel<T, true><<<row_grid(n, 1), row_block_threads(c), 0, stream>>>(
        dloss, logits, target, eps, dlogits, n, c);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void swish_forward(const T* x, const T* beta, T* y, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  swish_forward_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, beta, y, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::int64_t swish_backward_blocks(std::int64_t n) {
  return std::max<std::int64_t>(
      1, std::min<std::int64_t>({ceil_div(n, kThreads), std::int64_t{sm_count()} * 4,
                                 kMaxSwishBlocks}));
}

template <typename T>
void swish_backward(const T* dy, const T* x, const T* beta, T* dx, T* dbeta, T* workspace,
                    std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const std::int64_t blocks = swish_backward_blocks(n);
  swish_backward_kernel<T>
      <<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(dy, x, beta, dx, workspace, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sum_partials_kernel<T><<<1, kMaxSwishBlocks, 0, stream>>>(workspace, dbeta, blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define KILN_INSTANTIATE(T)                                                                   \
  template void bias_gelu_forward<T>(const T*, const T*, T*, std::int64_t, std::int64_t,      \
                                     cudaStream_t);                                           \
  template void bias_gelu_backward<T>(const T*, const T*, const T*, T*, T*, T*, std::int64_t, \
                                      std::int64_t, cudaStream_t);                            \
  template void softmax_xent_forward<T>(const T*, const std::int64_t*, T, T*, std::int64_t,   \
                                        std::int64_t, unsigned long long*, cudaStream_t);     \
  template void softmax_xent_backward<T>(const T*, const T*, const std::int64_t*, T, T*,      \
                                         std::int64_t, std::int64_t, cudaStream_t);           \
  template void swish_forward<T>(const T*, const T*, T*, std::int64_t, cudaStream_t);         \
  template void swish_backward<T>(const T*, const T*, const T*, T*, T*, T*, std::int64_t,     \
                                  cudaStream_t);

KILN_INSTANTIATE(float)
KILN_INSTANTIATE(double)

#undef KILN_INSTANTIATE

}  // namespace kiln::ops::cuda
