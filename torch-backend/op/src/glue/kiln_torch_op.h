// The C interface of kiln-torch-op's C++ glue (kiln_torch_op.cc): what libtorch's
// stable C ABI (torch/csrc/stable/c/shim.h) does not offer in 2.11. Tensors cross
// as AtenTensorHandle (an at::Tensor*, as in the shim). Every function but
// kiln_torch_op_throw catches all C++ exceptions and reports them through its
// return value and `err` (a NUL-terminated message, truncated to `err_len`).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#ifdef __cplusplus
extern "C" {
#endif

// Throws a c10::Error with this message. Called from a Rust kernel (an
// `extern "C-unwind"` function libtorch called), so the exception unwinds
// through that Rust frame back into libtorch's dispatcher, as an error in a
// C++ kernel would.
[[noreturn]] void kiln_torch_op_throw(const char* msg, size_t len);

// Registers, for the Autograd key of `ns::op` (already defined), a kernel that
// runs the op below autograd and, when an input requires grad, records a node
// whose backward calls `ns::grad_op` (looked up when backward runs) with the
// output gradients, the inputs, the outputs when `save_outputs`, and the same
// attributes. An empty `grad_op` makes backward fail with a message naming
// the op. Returns 0, or 1 with a message in `err`.
int kiln_torch_op_register_autograd(
    const char* ns,
    const char* op,
    const char* grad_op,
    size_t n_inputs,
    size_t n_outputs,
    int save_outputs,
    char* err,
    size_t err_len);

// Sets *exists to 1 when the dispatcher has a schema for `name` ("ns::op",
// default overload), else 0 (also on any error).
void kiln_torch_op_exists(const char* name, int* exists);

// Attribute kinds of kiln_torch_op_call (kiln_custom_op::AttrKind).
#define KILN_TORCH_OP_ATTR_FLOAT 0
#define KILN_TORCH_OP_ATTR_INT 1
#define KILN_TORCH_OP_ATTR_BOOL 2

// Calls the op `name` ("ns::op", default overload) through the dispatcher
// (so autograd applies) with the tensors `inputs` (borrowed) and the
// attributes (`kinds[i]` one of KILN_TORCH_OP_ATTR_*, `bits[i]` the f64 bits,
// the i64, or 0/1); arguments the call leaves out take the schema's defaults.
// On success writes up to `max_outputs` new tensors (owned by the caller, to
// free with aoti_torch_delete_tensor_object) and their number to
// `*n_outputs`, and returns 0; else returns 1 with the message in `err`.
int kiln_torch_op_call(
    const char* name,
    const AtenTensorHandle* inputs,
    size_t n_inputs,
    const uint8_t* kinds,
    const uint64_t* bits,
    size_t n_attrs,
    AtenTensorHandle* outputs,
    size_t max_outputs,
    size_t* n_outputs,
    char* err,
    size_t err_len);

#ifdef __cplusplus
} // extern "C"
#endif
