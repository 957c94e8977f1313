//! What an ONNX file declares (to be written).
