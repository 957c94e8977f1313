// Kiln's fused ops as plain C++ kernels on raw, contiguous, row-major buffers.
//
// One definition of the math serves every front end: the libtorch ops
// (src/torch_ops.cc, registered with TORCH_LIBRARY under `kiln`) and the
// TensorFlow ops (src/tf_ops.cc). The CUDA kernels (src/cuda/*.cu) implement the
// same formulas. `Par` is a parallel-for: `par(begin, end, grain, fn)` calls
// `fn(b, e)` on disjoint sub-ranges covering [begin, end) (at::parallel_for in the
// torch front end, a thread split in the TensorFlow one).
//
// The ops:
//   bias_gelu(x [rows, cols], bias [cols]) = gelu(x + bias), exact (erf) GELU.
//   softmax_xent(logits [n, c], target [n] int64, eps) = per-row cross-entropy with
//     label smoothing eps: -(sum_j q_j log p_j), q = (1 - eps) onehot(t) + eps / c.
//   swish(x [n], beta [1]) = x * sigmoid(beta * x), beta learned.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln::ops::kernels {

template <typename T>
inline T gelu(T z) {
  return z * T(0.5) * (T(1) + std::erf(z * T(M_SQRT1_2)));
}

// d/dz gelu(z) = Phi(z) + z * phi(z).
template <typename T>
inline T gelu_grad(T z) {
  const T cdf = T(0.5) * (T(1) + std::erf(z * T(M_SQRT1_2)));
  const T pdf = std::exp(T(-0.5) * z * z) * T(0.3989422804014327);  // 1/sqrt(2 pi)
  return cdf + z * pdf;
}

template <typename T>
inline T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

template <typename T, typename Par>
void bias_gelu_forward(const T* x, const T* bias, T* y, std::int64_t rows,
                       std::int64_t cols, Par par) {
  par(0, rows * cols, 4096, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) y[i] = gelu(x[i] + bias[i % cols]);
  });
}

// dx = dy * gelu'(x + bias); dbias[j] = sum_i dx[i, j] (columns split across workers).
template <typename T, typename Par>
void bias_gelu_backward(const T* dy, const T* x, const T* bias, T* dx, T* dbias,
                        std::int64_t rows, std::int64_t cols, Par par) {
  par(0, rows * cols, 4096, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) dx[i] = dy[i] * gelu_grad(x[i] + bias[i % cols]);
  });
  par(0, cols, 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t j = b; j < e; ++j) {
      T acc = 0;
      for (std::int64_t i = 0; i < rows; ++i) acc += dx[i * cols + j];
      dbias[j] = acc;
    }
  });
}

inline void check_targets(const std::int64_t* target, std::int64_t n, std::int64_t c) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (target[i] < 0 || target[i] >= c) {
      throw std::out_of_range("kiln::softmax_xent: target " + std::to_string(target[i]) +
                              " at row " + std::to_string(i) + " is outside [0, " +
                              std::to_string(c) + ")");
    }
  }
}

// loss[i] = logsumexp(z_i) - sum_j q_ij z_ij  (sum_j q_ij = 1).
template <typename T, typename Par>
void softmax_xent_forward(const T* logits, const std::int64_t* target, T eps, T* loss,
                          std::int64_t n, std::int64_t c, Par par) {
  check_targets(target, n, c);
  par(0, n, 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const T* z = logits + i * c;
      T m = -std::numeric_limits<T>::infinity();
      for (std::int64_t j = 0; j < c; ++j) m = std::max(m, z[j]);
      T s = 0, mean = 0;
      for (std::int64_t j = 0; j < c; ++j) {
        s += std::exp(z[j] - m);
        mean += z[j];
      }
      const T lse = m + std::log(s);
      const T picked = z[target[i]];
      loss[i] = lse - (T(1) - eps) * picked - eps * mean / T(c);
    }
  });
}

// dlogits[i, j] = dloss[i] * (softmax(z_i)_j - q_ij).
template <typename T, typename Par>
void softmax_xent_backward(const T* dloss, const T* logits, const std::int64_t* target,
                           T eps, T* dlogits, std::int64_t n, std::int64_t c, Par par) {
  check_targets(target, n, c);
  par(0, n, 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const T* z = logits + i * c;
      T* g = dlogits + i * c;
      T m = -std::numeric_limits<T>::infinity();
      for (std::int64_t j = 0; j < c; ++j) m = std::max(m, z[j]);
      T s = 0;
      for (std::int64_t j = 0; j < c; ++j) s += std::exp(z[j] - m);
      for (std::int64_t j = 0; j < c; ++j) {
        const T q = (j == target[i] ? T(1) - eps : T(0)) + eps / T(c);
        g[j] = dloss[i] * (std::exp(z[j] - m) / s - q);
      }
    }
  });
}

template <typename T, typename Par>
void swish_forward(const T* x, const T* beta, T* y, std::int64_t n, Par par) {
  const T b0 = beta[0];
  par(0, n, 4096, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) y[i] = x[i] * sigmoid(b0 * x[i]);
  });
}

// dx = dy * (s + beta x s (1 - s)); dbeta = sum dy * x^2 s (1 - s), s = sigmoid(beta x).
// `partial` holds one partial sum of dbeta per chunk of `chunk` elements.
template <typename T, typename Par>
void swish_backward(const T* dy, const T* x, const T* beta, T* dx, T* dbeta,
                    std::int64_t n, Par par) {
  const T b0 = beta[0];
  const std::int64_t chunk = 4096;
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  std::vector<T> partial(static_cast<std::size_t>(std::max<std::int64_t>(chunks, 1)), T(0));
  par(0, chunks, 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t k = b; k < e; ++k) {
      T acc = 0;
      const std::int64_t end = std::min(n, (k + 1) * chunk);
      for (std::int64_t i = k * chunk; i < end; ++i) {
        const T s = sigmoid(b0 * x[i]);
        const T ds = s * (T(1) - s);
        dx[i] = dy[i] * (s + b0 * x[i] * ds);
        acc += dy[i] * x[i] * x[i] * ds;
      }
      partial[k] = acc;
    }
  });
  T total = 0;
  for (std::int64_t k = 0; k < chunks; ++k) total += partial[k];
  dbeta[0] = total;
}

}  // namespace kiln::ops::kernels
