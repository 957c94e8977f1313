// CudaGraph (include/cuda_graph.h): at::cuda::CUDAGraph with the stream handling
// that PyTorch's `torch.cuda.graph` context manager does in Python. Compiled only
// with kiln-torch's `cuda` feature, by the host compiler with the CUDA headers.

#include "../../include/cuda_graph.h"

#include <optional>
#include <stdexcept>
#include <string>

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "kiln/rethrowing.h"

namespace kiln::torch {
namespace {

// Makes `waiting` wait for the work queued so far on `done` (as torch's
// Stream.wait_stream does: an event recorded on one, waited for by the other).
void wait_for(const c10::cuda::CUDAStream& waiting, const c10::cuda::CUDAStream& done) {
  cudaEvent_t event = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const auto recorded = cudaEventRecord(event, done.stream());
  const auto waited = recorded == cudaSuccess ? cudaStreamWaitEvent(waiting.stream(), event, 0)
                                              : recorded;
  C10_CUDA_CHECK(cudaEventDestroy(event));
  C10_CUDA_CHECK(waited);
}

// libtorch's graph, plus the clean-up its capture_end does only on success.
struct Graph : at::cuda::CUDAGraph {
  // After a failed capture: stop routing this stream's allocations to the graph's
  // pool, and tell the random generators registered by capture_begin that the
  // capture is over (else the next random op on the device fails with "Offset
  // increment outside graph capture encountered unexpectedly").
  void abandon_capture() {
    if (capture_dev_ != UNDEFINED_DEVICE) {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_);
    }
    for (auto& entry : captured_generator_states_) entry.first->capturing_ = false;
  }
};

}  // namespace

struct CudaGraph::Impl {
  c10::DeviceIndex device;
  c10::cuda::CUDAStream side;
  std::optional<c10::cuda::CUDAStreamGuard> guard;
  std::optional<c10::cuda::CUDAStream> previous;
  std::unique_ptr<Graph> graph;
  bool captured = false;
};

CudaGraph::CudaGraph(std::int8_t device) {
  rethrowing("creating a CUDA graph", [&] {
    const auto count = c10::cuda::device_count();
    if (device < 0 || device >= count) {
      throw std::invalid_argument("CUDA device " + std::to_string(device) +
                                  " does not exist (this machine has " +
                                  std::to_string(count) + ")");
    }
    const c10::cuda::CUDAGuard device_guard(device);
    impl_.reset(new Impl{device, c10::cuda::getStreamFromPool(false, device), std::nullopt,
                         std::nullopt, std::make_unique<Graph>(), false});
  });
}

CudaGraph::~CudaGraph() = default;

void CudaGraph::enter_side_stream() {
  rethrowing("switching to the capture stream", [&] {
    if (impl_->guard) throw std::logic_error("already on the capture stream");
    const auto current = c10::cuda::getCurrentCUDAStream(impl_->device);
    wait_for(impl_->side, current);
    impl_->previous = current;
    impl_->guard.emplace(impl_->side);
  });
}

void CudaGraph::leave_side_stream() {
  rethrowing("leaving the capture stream", [&] {
    if (!impl_->guard) return;
    impl_->guard.reset();
    if (impl_->previous) wait_for(*impl_->previous, impl_->side);
    impl_->previous.reset();
  });
}

void CudaGraph::capture_begin() {
  if (impl_->captured) throw std::logic_error("this CUDA graph has already been captured");
  // As torch.cuda.graph does: nothing of earlier work may still run while capturing.
  rethrowing("synchronizing before the capture",
             [&] { c10::cuda::device_synchronize(); });
  enter_side_stream();
  try {
    // Thread-local capture mode: CUDA work that other threads of the program do
    // meanwhile (a data loader, an eager model) neither breaks this capture nor
    // fails itself. libtorch's autograd thread still launches onto the capture
    // stream, so the backward pass is captured.
    rethrowing("beginning the CUDA graph capture", [&] {
      impl_->graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    });
  } catch (...) {
    leave_side_stream();
    throw;
  }
}

void CudaGraph::capture_end() {
  try {
    rethrowing("ending the CUDA graph capture", [&] { impl_->graph->capture_end(); });
  } catch (...) {
    // A capture that failed (an op that synchronizes, say) leaves the stream in
    // capture mode: end it and drop what was captured, so the device stays usable.
    cudaGraph_t broken = nullptr;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(impl_->side.stream(), &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusNone) {
      if (cudaStreamEndCapture(impl_->side.stream(), &broken) == cudaSuccess && broken) {
        cudaGraphDestroy(broken);
      }
    }
    (void)cudaGetLastError();
    impl_->graph->abandon_capture();
    impl_->graph = std::make_unique<Graph>();
    leave_side_stream();
    throw;
  }
  impl_->captured = true;
  leave_side_stream();
}

void CudaGraph::replay() {
  if (!impl_->captured) throw std::logic_error("replay of a CUDA graph that was never captured");
  rethrowing("replaying the CUDA graph", [&] {
    const c10::cuda::CUDAGuard device_guard(impl_->device);
    impl_->graph->replay();
  });
}

bool CudaGraph::is_captured() const { return impl_->captured; }

std::unique_ptr<CudaGraph> new_cuda_graph(std::int8_t device) {
  return std::make_unique<CudaGraph>(device);
}

}  // namespace kiln::torch
