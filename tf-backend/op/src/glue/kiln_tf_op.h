/* The C++ half of kiln-tf-op: what TensorFlow's C API cannot do, behind plain C
 * functions (src/glue/gradient.cc). bindgen reads this header, so Rust and C++
 * agree on the signatures. No function lets a C++ exception escape: each
 * returns 0 on success, or writes a NUL-terminated message of at most
 * `err_len` bytes (truncated) to `err` and returns nonzero. */
#ifndef KILN_TF_OP_H_
#define KILN_TF_OP_H_

#include <stddef.h>
#include <stdint.h>

#ifndef __cplusplus
/* tensorflow/c/ops.h declares these as bare `struct X;` and then uses them
 * without the tag, which only C++ accepts; the typedefs make it valid C (for
 * bindgen, which parses it as C). */
typedef struct TF_DimensionHandle TF_DimensionHandle;
typedef struct TF_OpDefinitionBuilder TF_OpDefinitionBuilder;
typedef struct TF_ShapeHandle TF_ShapeHandle;
typedef struct TF_ShapeInferenceContext TF_ShapeInferenceContext;
#endif

#include "tensorflow/c/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whether TensorFlow's op registry knows `op_type` (1) or not (0), without
 * registering anything: TF_RegisterOpDefinition aborts the process on a
 * duplicate once the registry is initialised, so Kiln asks first. */
int kiln_tf_op_is_registered(const char* op_type);

/* Registers `op_type`'s gradient in TensorFlow's C++ gradient registry (which
 * TF_AddGradients consults): one node of `grad_op_type` fed by the gradients of
 * the `n_outputs` outputs (zeros for an output no gradient reached), the
 * `n_inputs` inputs and, when `save_outputs` is nonzero, the outputs; with every
 * attribute of the forward node (`T` and the op's own) copied. Its `n_inputs`
 * outputs are the inputs' gradients. `grad_op_type` is looked up when the
 * gradient is built, so it may be registered later. Fails when `op_type`
 * already has a gradient. */
int kiln_tf_op_register_gradient(const char* op_type, const char* grad_op_type, int n_inputs,
                                 int n_outputs, int save_outputs, char* err, size_t err_len);

/* Reads the attribute `name` of the node whose shape `ctx` infers (the C API
 * reads only type attributes there): `kind` 0 is a float (TensorFlow stores an
 * f32), written to `*float_value`; 1 an int (int64) and 2 a bool (0 or 1),
 * written to `*int_value`. */
int kiln_tf_op_shape_attr(TF_ShapeInferenceContext* ctx, const char* name, int kind,
                          double* float_value, int64_t* int_value, char* err, size_t err_len);

/* Sets output `i` of the node whose shape `ctx` infers to the shape of `rank`
 * dimensions `dims`, where -1 is an unknown dimension (the C API builds shapes
 * of known sizes only). */
int kiln_tf_op_set_output_shape(TF_ShapeInferenceContext* ctx, int i, const int64_t* dims,
                                int rank, char* err, size_t err_len);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* KILN_TF_OP_H_ */
