//! ONNX models run with ONNX Runtime (to be written).
