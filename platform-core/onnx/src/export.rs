//! Kiln model definitions to ONNX (to be written).
