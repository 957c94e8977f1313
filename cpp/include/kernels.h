// Kiln's fused ops as plain C++ kernels on raw, contiguous, row-major buffers.
//
// One definition of the math serves every front end: the libtorch ops
// (src/torch_ops.cc, registered with TORCH_LIBRARY under `kiln`) and the
// TensorFlow ops (src/tf_ops.cc). The CUDA kernels (src/cuda/*.cu) implement the
// same formulas. `Par` is a parallel-for: `par(begin, end, grain, fn)` calls
// `fn(b, e)` on disjoint sub-ranges covering [begin, end) (libtorch's parallel_for
// in the torch front end, a thread split in the TensorFlow one).
//
// The ops:
//   bias_gelu(x [rows, cols], bias [cols]) = gelu(x + bias), exact (erf) GELU.
//   softmax_xent(logits [n, c], target [n] int64, eps) = per-row cross-entropy with
//     label smoothing eps: -(sum_j q_j log p_j), q = (1 - eps) onehot(t) + eps / c.
//   swish(x [n], beta [1]) = x * sigmoid(beta * x), beta learned.
//
// Speed. A fused op only pays off if its loops vectorise as well as the built-in
// ops it replaces, so:
// - The loops over elements are in small kernels (the structs in `detail`) with
//   __restrict pointers, no calls, no integer division and no branches, which GCC
//   -O3 vectorises. Reductions keep kLanes independent accumulators: a single float
//   accumulator is a serial chain the compiler may not reorder.
// - For float, exp and erf are branch-free approximations (exp_approx, erf_approx:
//   within 1 and 7 ulp), since std::exp / std::erf are library calls that stop
//   vectorisation. double keeps std::exp / std::erf (the float64 tests compare with
//   finite differences).
// - The build passes no -m flags, so the baseline is SSE2 (4 floats). On x86-64
//   with GCC or Clang each kernel is also compiled for AVX2 and AVX-512 and the
//   best one this CPU runs is picked at run time (`run`), as libtorch does for its
//   own kernels; elsewhere the kernels are compiled once, for the target.
// Every reduction adds its partial sums in an order fixed by the shape alone, never
// by the thread count or the scheduling, so results are deterministic on a machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

// The kernels and their helpers must be inlined into the loops (and, on x86-64,
// into each ISA's copy of them, see `run`), whatever the inliner's size limits.
#if defined(__GNUC__)
#define KILN_KERNELS_INLINE inline __attribute__((always_inline))
#else
#define KILN_KERNELS_INLINE inline
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#define KILN_KERNELS_X86_DISPATCH 1
#endif

namespace kiln::ops::kernels {

namespace detail {

// Independent accumulators per reduction: one AVX-512 register of floats, four SSE
// ones. Lane l of every reduction sums the elements l, l + kLanes, ... in order, so
// the result does not depend on the vector width the kernel was compiled for. The
// loops over the lanes carry `#pragma GCC unroll 1`: GCC otherwise unrolls a small
// one completely before vectorising and turns the lanes into kLanes scalars, which
// it no longer vectorises (that would reorder float sums, as far as it knows).
constexpr std::int64_t kLanes = 16;

template <typename To, typename From>
KILN_KERNELS_INLINE To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// c ? a : b as a bit blend. A plain `?:` is a branch in GCC's middle end, and when
// one arm is a constant its partial-redundancy pass moves the arithmetic that
// follows into the branches; the loop then has control flow around float
// arithmetic that may trap, which GCC won't if-convert, so won't vectorise (short
// of -fno-trapping-math). The blend is a compare and three bit operations.
KILN_KERNELS_INLINE float select(bool c, float a, float b) {
  const std::uint32_t m = 0u - static_cast<std::uint32_t>(c);
  return bit_cast<float>((bit_cast<std::uint32_t>(a) & m) | (bit_cast<std::uint32_t>(b) & ~m));
}

// exp for float, Cephes' expf: exp(x) = 2^n exp(r), n = round(x / ln 2),
// |r| <= ln 2 / 2, exp(r) by a degree-6 polynomial; within 1 ulp of exp. ln 2 is
// split in two (C1 has 9 significant bits, so n * C1 is exact) to keep r accurate.
// 2^n is built from exponent bits as 2^h * 2^(n - h), two normal floats over the
// clamped range, so that results below FLT_MIN come out as correctly rounded
// subnormals and those above FLT_MAX as inf. The clamp maps NaN to the lower bound
// (comparisons with NaN are false), keeping the conversion of n to int defined;
// the last line returns the NaN.
KILN_KERNELS_INLINE float exp_approx(float x) {
  float xc = select(x > -105.0f, x, -105.0f);  // exp(-105) rounds to 0
  xc = select(xc < 89.0f, xc, 89.0f);          // exp(89) overflows to inf
  // Round to nearest without a call: adding 1.5 * 2^23 leaves no fraction bits.
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const std::int32_t ni = static_cast<std::int32_t>(n);  // in [-152, 128]
  const std::int32_t h = ni >> 1;  // floor(n / 2): an arithmetic shift in GCC and Clang
  const float s1 = bit_cast<float>(static_cast<std::uint32_t>(h + 127) << 23);
  const float s2 = bit_cast<float>(static_cast<std::uint32_t>(ni - h + 127) << 23);
  return select(x != x, x, p * s1 * s2);
}

// erf for float, Eigen's generic_fast_erf_float: x P(x^2) / Q(x^2) on [-4, 4]
// (erf(4) rounds to 1 in float); within 7 ulp of erf (4.3e-7 absolute). NaN
// passes through the clamp.
KILN_KERNELS_INLINE float erf_approx(float a) {
  float x = select(a > 4.0f, 4.0f, a);
  x = select(x < -4.0f, -4.0f, x);
  const float x2 = x * x;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 + -2.10102402082508e-06f;
  p = p * x2 + -5.69250639462346e-05f;
  p = p * x2 + -7.34990630326855e-04f;
  p = p * x2 + -2.95459980854025e-03f;
  p = p * x2 + -1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 + -2.13374055278905e-04f;
  q = q * x2 + -1.68282697438203e-03f;
  q = q * x2 + -7.37332916720468e-03f;
  q = q * x2 + -1.42647390514189e-02f;
  return x * p / q;
}

KILN_KERNELS_INLINE float exp_(float x) { return exp_approx(x); }
KILN_KERNELS_INLINE double exp_(double x) { return std::exp(x); }
KILN_KERNELS_INLINE float erf_(float x) { return erf_approx(x); }
KILN_KERNELS_INLINE double erf_(double x) { return std::erf(x); }

}  // namespace detail

template <typename T>
KILN_KERNELS_INLINE T gelu(T z) {
  return z * T(0.5) * (T(1) + detail::erf_(z * T(M_SQRT1_2)));
}

// d/dz gelu(z) = Phi(z) + z * phi(z).
template <typename T>
KILN_KERNELS_INLINE T gelu_grad(T z) {
  const T cdf = T(0.5) * (T(1) + detail::erf_(z * T(M_SQRT1_2)));
  const T pdf = detail::exp_(T(-0.5) * z * z) * T(0.3989422804014327);  // 1/sqrt(2 pi)
  return cdf + z * pdf;
}

template <typename T>
KILN_KERNELS_INLINE T sigmoid(T z) {
  return T(1) / (T(1) + detail::exp_(-z));
}

namespace detail {

// ----- the kernels: loops over contiguous spans, compiled once per ISA by `run` -----

// y = gelu(x + bias) over one span of a row.
template <typename T>
struct BiasGeluSpan {
  static KILN_KERNELS_INLINE void run(const T* __restrict x, const T* __restrict bias,
                                      T* __restrict y, std::int64_t n) {
    for (std::int64_t j = 0; j < n; ++j) y[j] = gelu(x[j] + bias[j]);
  }
};

// dx = dy * gelu'(x + bias) over `rows` whole rows, each also added into `acc`
// (cols partial sums of dbias), in row order.
template <typename T>
struct BiasGeluGradRows {
  static KILN_KERNELS_INLINE void run(const T* __restrict dy, const T* __restrict x,
                                      const T* __restrict bias, T* __restrict dx,
                                      T* __restrict acc, std::int64_t rows,
                                      std::int64_t cols) {
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t o = i * cols;
      for (std::int64_t j = 0; j < cols; ++j) {
        const T g = dy[o + j] * gelu_grad(x[o + j] + bias[j]);
        dx[o + j] = g;
        acc[j] += g;
      }
    }
  }
};

// dst += src.
template <typename T>
struct AddInto {
  static KILN_KERNELS_INLINE void run(T* __restrict dst, const T* __restrict src,
                                      std::int64_t n) {
    for (std::int64_t j = 0; j < n; ++j) dst[j] += src[j];
  }
};

// max and sum of a row, in one pass.
template <typename T>
KILN_KERNELS_INLINE void row_max_sum(const T* __restrict z, std::int64_t n, T* max_out,
                                     T* sum_out) {
  T m[kLanes], s[kLanes];
  for (std::int64_t l = 0; l < kLanes; ++l) {
    m[l] = -std::numeric_limits<T>::infinity();
    s[l] = T(0);
  }
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma GCC unroll 1  // see kLanes
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const T v = z[j + l];
      m[l] = v > m[l] ? v : m[l];
      s[l] += v;
    }
  }
  for (std::int64_t l = 0; j < n; ++j, ++l) {
    m[l] = z[j] > m[l] ? z[j] : m[l];
    s[l] += z[j];
  }
  T mm = m[0], ss = s[0];
  for (std::int64_t l = 1; l < kLanes; ++l) {
    mm = m[l] > mm ? m[l] : mm;
    ss += s[l];
  }
  *max_out = mm;
  *sum_out = ss;
}

// sum_j exp(z[j] - m); with kStore, also stores the exps in out.
template <typename T, bool kStore>
KILN_KERNELS_INLINE T row_sum_exp(const T* __restrict z, T m, std::int64_t n,
                                  T* __restrict out) {
  T s[kLanes];
  for (std::int64_t l = 0; l < kLanes; ++l) s[l] = T(0);
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma GCC unroll 1  // see kLanes
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const T e = exp_(z[j + l] - m);
      if (kStore) out[j + l] = e;
      s[l] += e;
    }
  }
  for (std::int64_t l = 0; j < n; ++j, ++l) {
    const T e = exp_(z[j] - m);
    if (kStore) out[j] = e;
    s[l] += e;
  }
  T total = s[0];
  for (std::int64_t l = 1; l < kLanes; ++l) total += s[l];
  return total;
}

// loss of the rows [b, e): logsumexp(z) - (1 - eps) z[target] - eps mean(z).
template <typename T>
struct SoftmaxXentRows {
  static KILN_KERNELS_INLINE void run(const T* __restrict logits,
                                      const std::int64_t* __restrict target, T eps,
                                      T* __restrict loss, std::int64_t b, std::int64_t e,
                                      std::int64_t c) {
    for (std::int64_t i = b; i < e; ++i) {
      const T* z = logits + i * c;
      T m, sum;
      row_max_sum(z, c, &m, &sum);
      const T lse = m + std::log(row_sum_exp<T, false>(z, m, c, nullptr));
      loss[i] = lse - (T(1) - eps) * z[target[i]] - eps * sum / T(c);
    }
  }
};

// dlogits of the rows [b, e): the exps go straight into dlogits (one exp per
// element), then one pass turns them into dloss * (exp / sum - eps / c), and the
// target's element takes the one-hot part.
template <typename T>
struct SoftmaxXentGradRows {
  static KILN_KERNELS_INLINE void run(const T* __restrict dloss, const T* __restrict logits,
                                      const std::int64_t* __restrict target, T eps,
                                      T* __restrict dlogits, std::int64_t b, std::int64_t e,
                                      std::int64_t c) {
    for (std::int64_t i = b; i < e; ++i) {
      const T* z = logits + i * c;
      T* g = dlogits + i * c;
      T m, unused;
      row_max_sum(z, c, &m, &unused);
      const T s = row_sum_exp<T, true>(z, m, c, g);
      const T d = dloss[i];
      const T scale = d / s, shift = d * (eps / T(c));
      for (std::int64_t j = 0; j < c; ++j) g[j] = g[j] * scale - shift;
      g[target[i]] -= d * (T(1) - eps);
    }
  }
};

template <typename T>
struct SwishSpan {
  static KILN_KERNELS_INLINE void run(const T* __restrict x, T b0, T* __restrict y,
                                      std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] * sigmoid(b0 * x[i]);
  }
};

// dx over a span; returns the span's share of dbeta.
template <typename T>
struct SwishGradSpan {
  static KILN_KERNELS_INLINE T run(const T* __restrict dy, const T* __restrict x, T b0,
                                   T* __restrict dx, std::int64_t n) {
    T acc[kLanes];
    for (std::int64_t l = 0; l < kLanes; ++l) acc[l] = T(0);
    std::int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
#pragma GCC unroll 1  // see kLanes
      for (std::int64_t l = 0; l < kLanes; ++l) {
        const T xi = x[i + l], gi = dy[i + l];
        const T s = sigmoid(b0 * xi);
        const T ds = s * (T(1) - s);
        dx[i + l] = gi * (s + b0 * xi * ds);
        acc[l] += gi * xi * xi * ds;
      }
    }
    for (std::int64_t l = 0; i < n; ++i, ++l) {
      const T s = sigmoid(b0 * x[i]);
      const T ds = s * (T(1) - s);
      dx[i] = dy[i] * (s + b0 * x[i] * ds);
      acc[l] += dy[i] * x[i] * x[i] * ds;
    }
    T total = acc[0];
    for (std::int64_t l = 1; l < kLanes; ++l) total += acc[l];
    return total;
  }
};

// ----- run: Kernel::run compiled for the best ISA of this CPU -----

#ifdef KILN_KERNELS_X86_DISPATCH

// The kernels are always_inline, so each of these copies compiles its own for its
// target. GCC also fuses multiply-adds there (AVX2 comes with FMA), so float
// results may differ in the last bits from the SSE2 copy; which copy runs depends
// on the CPU only.
#if defined(__clang__)
#define KILN_KERNELS_AVX512 "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"
#else
// GCC compiles AVX-512 loops with 256-bit vectors unless told otherwise.
#define KILN_KERNELS_AVX512 "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,prefer-vector-width=512"
#endif

template <typename Kernel, typename... Args>
__attribute__((target(KILN_KERNELS_AVX512))) auto run_avx512(Args... args) {
  return Kernel::run(args...);
}

template <typename Kernel, typename... Args>
__attribute__((target("avx2,fma"))) auto run_avx2(Args... args) {
  return Kernel::run(args...);
}

template <typename Kernel, typename... Args>
auto run_baseline(Args... args) {
  return Kernel::run(args...);
}

enum class Isa { baseline, avx2, avx512 };

// Checked once; __builtin_cpu_supports also checks that the OS saves the registers.
inline Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
      return Isa::avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
    return Isa::baseline;
  }();
  return isa;
}

template <typename Kernel, typename... Args>
auto run(Args... args) {
  switch (best_isa()) {
    case Isa::avx512:
      return run_avx512<Kernel>(args...);
    case Isa::avx2:
      return run_avx2<Kernel>(args...);
    default:
      return run_baseline<Kernel>(args...);
  }
}

#undef KILN_KERNELS_AVX512

#else

template <typename Kernel, typename... Args>
auto run(Args... args) {
  return Kernel::run(args...);
}

#endif

}  // namespace detail

template <typename T, typename Par>
void bias_gelu_forward(const T* x, const T* bias, T* y, std::int64_t rows,
                       std::int64_t cols, Par par) {
  // Split the flat range (rows may be few and long), then walk it row segment by row
  // segment: one division per segment instead of `i % cols` per element.
  par(0, rows * cols, 4096, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e;) {
      const std::int64_t j = i % cols;
      const std::int64_t len = std::min(e - i, cols - j);
      detail::run<detail::BiasGeluSpan<T>>(x + i, bias + j, y + i, len);
      i += len;
    }
  });
}

// dx = dy * gelu'(x + bias); dbias[j] = sum_i dx[i, j]. One pass over the rows: each
// fixed chunk of rows adds its dx rows into its own partial dbias vector
// (contiguous, vectorised), then the partial vectors are added in chunk order.
// Chunks hold at least ~16k elements and are at most 64, bounding the partial
// vectors to min(rows, 64) * cols values.
template <typename T, typename Par>
void bias_gelu_backward(const T* dy, const T* x, const T* bias, T* dx, T* dbias,
                        std::int64_t rows, std::int64_t cols, Par par) {
  if (cols == 0) return;
  const std::int64_t chunk_rows = std::max<std::int64_t>({1, 16384 / cols, (rows + 63) / 64});
  const std::int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  std::vector<T> partial(static_cast<std::size_t>(std::max<std::int64_t>(chunks, 1) * cols),
                         T(0));
  par(0, chunks, 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t k = b; k < e; ++k) {
      const std::int64_t first = k * chunk_rows;
      const std::int64_t o = first * cols;
      detail::run<detail::BiasGeluGradRows<T>>(dy + o, x + o, bias, dx + o,
                                               partial.data() + k * cols,
                                               std::min(rows, first + chunk_rows) - first, cols);
    }
  });
  par(0, cols, 1024, [&](std::int64_t b, std::int64_t e) {
    std::copy(partial.data() + b, partial.data() + e, dbias + b);
    for (std::int64_t k = 1; k < chunks; ++k) {
      detail::run<detail::AddInto<T>>(dbias + b, partial.data() + k * cols + b, e - b);
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
    detail::run<detail::SoftmaxXentRows<T>>(logits, target, eps, loss, b, e, c);
  });
}

// dlogits[i, j] = dloss[i] * (softmax(z_i)_j - q_ij).
template <typename T, typename Par>
void softmax_xent_backward(const T* dloss, const T* logits, const std::int64_t* target,
                           T eps, T* dlogits, std::int64_t n, std::int64_t c, Par par) {
  check_targets(target, n, c);
  par(0, n, 16, [&](std::int64_t b, std::int64_t e) {
    detail::run<detail::SoftmaxXentGradRows<T>>(dloss, logits, target, eps, dlogits, b, e, c);
  });
}

template <typename T, typename Par>
void swish_forward(const T* x, const T* beta, T* y, std::int64_t n, Par par) {
  const T b0 = beta[0];
  par(0, n, 4096, [&](std::int64_t b, std::int64_t e) {
    detail::run<detail::SwishSpan<T>>(x + b, b0, y + b, e - b);
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
      const std::int64_t first = k * chunk;
      partial[k] = detail::run<detail::SwishGradSpan<T>>(dy + first, x + first, b0, dx + first,
                                                        std::min(n, first + chunk) - first);
    }
  });
  T total = 0;
  for (std::int64_t k = 0; k < chunks; ++k) total += partial[k];
  dbeta[0] = total;
}

}  // namespace kiln::ops::kernels

#undef KILN_KERNELS_INLINE
#ifdef KILN_KERNELS_X86_DISPATCH
#undef KILN_KERNELS_X86_DISPATCH
#endif
