"""ONNX models built with onnx.helper, and Python onnxruntime's outputs on
them, for kiln-onnx's tests/runtime.rs (OnnxModel and ModelInfo).

Usage:
    python onnx_models.py DIR

Writes into DIR (IR version 10, default opset 21, checked with
onnx.checker.check_model(full_check=True)):
    mlp.onnx     x: float32 [batch, 4] -> Gemm(8, transB=1) -> Relu
                 -> Gemm(3, transB=1) -> y: float32 [batch, 3]
    embed.onnx   ids: int64 [batch, 5] -> Gather(table float32 [10, 6], axis 0)
                 -> emb: float32 [batch, 5, 6]
    two_io.onnx  a: float64 [n, 3], k: int32 [n, 3] ->
                 s = a + Cast(k, double): float64 [n, 3], m = k * k: int32 [n, 3]
    half.onnx    h: float16 [n, 4] -> sq = h * h: float16 [n, 4],
                 f = Cast(sq, float): float32 [n, 4]
    bool.onnx    mask: bool [n] -> Not -> out: bool [n]  (a dtype Kiln lacks)
    ir14.onnx    mlp.onnx with ir_version 14 (onnxruntime 1.31 refuses it)
    data.safetensors
                 the inputs and onnxruntime's outputs, named <model>.<value>.<case>
                 for the cases b3 (batch 3) and b17 (batch 17); float16
                 values are stored as float32 (exactly).

Prints JSON: for each model, what the file declares, computed with the onnx
package: ir_version, opsets, producer, graph name, inputs (name, Kiln dtype
name or the ONNX type name, shape with ints for fixed dims, strings for
symbolic ones), outputs, node count, op type counts, initializer count and
total initializer elements.
"""

import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

IR_VERSION = 10
OPSET = 21
KILN_NAMES = {
    TensorProto.FLOAT: "float32",
    TensorProto.DOUBLE: "float64",
    TensorProto.INT32: "int32",
    TensorProto.INT64: "int64",
    TensorProto.UINT8: "uint8",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.BOOL: "bool",
}


def model(graph):
    m = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="kiln-onnx-tests",
        producer_version="1.0",
    )
    m.ir_version = IR_VERSION
    onnx.checker.check_model(m, full_check=True)
    return m


def mlp(rng):
    w1 = rng.standard_normal((8, 4)).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32)
    w2 = rng.standard_normal((3, 8)).astype(np.float32)
    b2 = rng.standard_normal(3).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(b1, "b1"),
            numpy_helper.from_array(w2, "w2"),
            numpy_helper.from_array(b2, "b2"),
        ],
    )
    return model(graph)


def embed(rng):
    table = rng.standard_normal((10, 6)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0)],
        "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 5])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", 5, 6])],
        [numpy_helper.from_array(table, "table")],
    )
    return model(graph)


def two_io():
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["k"], ["kd"], to=TensorProto.DOUBLE),
            helper.make_node("Add", ["a", "kd"], ["s"]),
            helper.make_node("Mul", ["k", "k"], ["m"]),
        ],
        "two_io",
        [
            helper.make_tensor_value_info("a", TensorProto.DOUBLE, ["n", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT32, ["n", 3]),
        ],
        [
            helper.make_tensor_value_info("s", TensorProto.DOUBLE, ["n", 3]),
            helper.make_tensor_value_info("m", TensorProto.INT32, ["n", 3]),
        ],
    )
    return model(graph)


def half():
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["h", "h"], ["sq"]),
            helper.make_node("Cast", ["sq"], ["f"], to=TensorProto.FLOAT),
        ],
        "half",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["n", 4])],
        [
            helper.make_tensor_value_info("sq", TensorProto.FLOAT16, ["n", 4]),
            helper.make_tensor_value_info("f", TensorProto.FLOAT, ["n", 4]),
        ],
    )
    return model(graph)


def boolean():
    graph = helper.make_graph(
        [helper.make_node("Not", ["mask"], ["out"])],
        "bool",
        [helper.make_tensor_value_info("mask", TensorProto.BOOL, ["n"])],
        [helper.make_tensor_value_info("out", TensorProto.BOOL, ["n"])],
    )
    return model(graph)


def value_info(v):
    t = v.type.tensor_type
    shape = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        elif d.HasField("dim_param"):
            shape.append(d.dim_param)
        else:
            shape.append(None)
    name = KILN_NAMES.get(t.elem_type)
    return {
        "name": v.name,
        "dtype": None if name in (None, "bool") else name,
        "type_name": name,
        "shape": shape,
    }


def declared(m):
    g = m.graph
    init_names = {t.name for t in g.initializer}
    ops = {}
    for n in g.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {
        "ir_version": m.ir_version,
        "opsets": [[o.domain or "ai.onnx", o.version] for o in m.opset_import],
        "producer_name": m.producer_name,
        "producer_version": m.producer_version,
        "graph_name": g.name,
        "inputs": [value_info(v) for v in g.input if v.name not in init_names],
        "outputs": [value_info(v) for v in g.output],
        "node_count": len(g.node),
        "op_types": ops,
        "initializer_count": len(g.initializer),
        "parameter_count": int(sum(int(np.prod(t.dims)) for t in g.initializer)),
    }


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(20261126)
    models = {
        "mlp": mlp(rng),
        "embed": embed(rng),
        "two_io": two_io(),
        "half": half(),
        "bool": boolean(),
    }
    for name, m in models.items():
        onnx.save(m, os.path.join(out_dir, f"{name}.onnx"))
    ir14 = onnx.ModelProto()
    ir14.CopyFrom(models["mlp"])
    ir14.ir_version = 14
    onnx.save(ir14, os.path.join(out_dir, "ir14.onnx"))

    def inputs(name, n):
        if name == "mlp":
            return {"x": rng.standard_normal((n, 4)).astype(np.float32)}
        if name == "embed":
            return {"ids": rng.integers(0, 10, size=(n, 5), dtype=np.int64)}
        if name == "two_io":
            return {
                "a": rng.standard_normal((n, 3)),
                "k": rng.integers(-1000, 1000, size=(n, 3), dtype=np.int32),
            }
        if name == "half":
            return {"h": rng.standard_normal((n, 4)).astype(np.float16)}
        raise ValueError(name)

    tensors = {}
    for name in ["mlp", "embed", "two_io", "half"]:
        sess = ort.InferenceSession(
            os.path.join(out_dir, f"{name}.onnx"), providers=["CPUExecutionProvider"]
        )
        out_names = [o.name for o in sess.get_outputs()]
        for n in [3, 17]:
            feed = inputs(name, n)
            outs = sess.run(out_names, feed)
            for k, v in list(feed.items()) + list(zip(out_names, outs)):
                if v.dtype == np.float16:
                    v = v.astype(np.float32)
                tensors[f"{name}.{k}.b{n}"] = np.ascontiguousarray(v)
    save_file(tensors, os.path.join(out_dir, "data.safetensors"))

    report = {name: declared(m) for name, m in models.items()}
    report["onnxruntime_version"] = ort.__version__
    print(json.dumps(report))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
