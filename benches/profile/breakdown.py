"""Where a benchmark worker's CPU time goes, from a `perf record` of it.

Usage (after `cargo xtask cargo bench --bench compare --no-run`, which prints the
binary's path, and one run of the harness, which writes the data directories):

    perf record -e cpu-clock -F 4000 -o W.data BINARY --worker VARIANT \
        --workload cnn --data target/tmp/bench-compare/cnn \
        --steps 40 --warmup 5 --repeats 3 --threads 1
    python benches/profile/breakdown.py W.data [OTHER.data ...]

Each sample is put in a class (matrix multiply / convolution kernels, elementwise
kernels, memory, the framework's dispatch, Kiln's own code, ...) and the table shows
each class per 100 samples of the *anchor* class (`gemm+conv` by default): the same
model does the same matrix work in every variant, so this ratio compares the work
around it without the VM's speed drift, which moves wall-clock times by up to 2x.
`perf` on this VM has no hardware counters; `cpu-clock` sampling needs none.
"""

import argparse
import collections
import re
import subprocess
import sys

# (class, pattern on "dso symbol"), first match wins.
CLASSES = [
    ("gemm+conv", r"^\[JIT\]|sgemm|gemm_|jit_avx\w*_(?:gemm|conv)|brgemm|_conv|conv_|Conv2D|convolution|mkl_blas|dnnl::impl::cpu::x64::(?:jit|brg)|Eigen::internal::gebp|TensorContraction"),
    ("elementwise", r"VectorizedLoop|vectorized_loop|_kernel\b|kernel_impl|mkl_vml|Eigen::internal::(?:Tensor|scalar_)|EigenMetaKernel|BinaryOp|UnaryOp|cwise|_reduce|log_softmax|softmax|layer_norm|LayerNorm|gelu|Gelu|Relu|relu|pool|Pool|map_reduce|Adam|adam"),
    ("memory (copy, alloc, page faults)", r"memcpy|memmove|memset|malloc|free|_int_|unlink_chunk|page|clear_page|folio|xa_load|xas_load|mmap|munmap|brk|direct_copy|copy_impl|Allocator|alloc"),
    ("threads (OpenMP, pools, locks)", r"gomp|omp_|futex|spin|sched|Eigen::ThreadPool|NonBlockingThreadPool|pthread|__lll|syscall|schedule"),
    ("dynamic linking (start-up)", r"^ld-linux|_dl_"),
    ("kiln (Rust side)", r"^compare-|^kiln|kiln_"),
    ("dispatch and autograd (libtorch)", r"libtorch|libc10"),
    ("graph runtime (TensorFlow)", r"libtensorflow"),
    ("kernel (other)", r"kallsyms"),
]


def classify(dso, symbol):
    text = f"{dso} {symbol}"
    for name, pattern in CLASSES:
        if re.search(pattern, text):
            return name
    return "other"


def samples(path):
    out = subprocess.run(
        ["perf", "report", "-i", path, "--no-children", "--sort", "dso,symbol",
         "--stdio", "-g", "none", "--percent-limit", "0"],
        capture_output=True, text=True, check=True,
    ).stdout
    counts = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+(.+?)\s+\[.\]\s+(.*)", line)
        if m:
            counts[classify(m.group(2), m.group(3))] += float(m.group(1))
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+", help="perf.data files, one per variant")
    parser.add_argument("--anchor", default="gemm+conv")
    args = parser.parse_args()
    tables = {p: samples(p) for p in args.data}
    names = [n for n, _ in CLASSES] + ["other"]
    width = max(len(n) for n in names)
    print(f"{'per 100 ' + args.anchor + ' samples':<{width}} " + " ".join(f"{p[-24:]:>24}" for p in args.data))
    for n in names + ["total"]:
        row = []
        for p in args.data:
            c = tables[p]
            anchor = c.get(args.anchor, 0.0)
            value = sum(c.values()) if n == "total" else c.get(n, 0.0)
            row.append(f"{100 * value / anchor:24.1f}" if anchor else f"{'-':>24}")
        print(f"{n:<{width}} " + " ".join(row))


if __name__ == "__main__":
    sys.exit(main())
