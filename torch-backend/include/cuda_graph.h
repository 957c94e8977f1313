// A CUDA graph of libtorch work (at::cuda::CUDAGraph), for the `graph` module of
// kiln-torch (feature `cuda`). Every method can throw and is declared `Result` in the
// cxx bridge (src/graph/bridge.rs); c10 errors are rethrown without their backtrace.
//
// The class holds no CUDA type in this header, so the bridge's generated code
// compiles without the CUDA headers; cuda_graph.cc (built with them) defines Impl.
#pragma once

#include <cstdint>
#include <memory>

namespace kiln::torch {

class CudaGraph {
 public:
  explicit CudaGraph(std::int8_t device);
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Makes a stream from libtorch's pool the current one on the device, after the
  // work already queued on the current stream (capture cannot use the default
  // stream, and warm-up runs where the capture will).
  void enter_side_stream();
  // Makes the previous stream current again, after the side stream's work.
  void leave_side_stream();
  // enter_side_stream, then begins capturing into the graph's private memory pool.
  void capture_begin();
  // Ends the capture and instantiates the graph, then leave_side_stream. After a
  // failed capture the stream is restored and the graph left empty.
  void capture_end();
  // Launches the captured work on the device's current stream.
  void replay();
  // Whether a capture has ended successfully.
  bool is_captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::unique_ptr<CudaGraph> new_cuda_graph(std::int8_t device);

}  // namespace kiln::torch
