//! ONNX Runtime in the same process as libtorch and TensorFlow (both of which,
//! like ONNX Runtime, carry their own protobuf): one MLP, built by
//! kiln-onnx's `tests/reference/onnx_models.py` as `mlp.onnx`, computed by a
//! libtorch op chain, by a TensorFlow graph and by `kiln::onnx::OnnxModel`,
//! interleaved, each against Python onnxruntime's output (Kiln's ONNX Runtime
//! bitwise, the others to float32 tolerance).
//!
//! Why no protobuf clash is possible, checked with `nm -D` on the pinned wheels:
//! `libonnxruntime.so.1.31.1` exports three dynamic symbols (`OrtGetApiBase`,
//! `OrtSessionOptionsAppendExecutionProvider_CPU` and its version node), so its
//! protobuf is internal, and ort opens it with `RTLD_LOCAL`; TensorFlow's
//! `libtensorflow_framework.so.2` exports ~10,800 protobuf symbols, which ONNX
//! Runtime never binds to.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::collections::BTreeMap;
use std::path::Path;

use kiln::onnx::proto::ModelProto;
use kiln::onnx::OnnxModel;
use kiln::{HostTensor, StateDict};
use prost::Message;
use tensorflow::{Graph, Session, SessionOptions, SessionRunArgs, Tensor};

/// The MLP's weights (`w1` [8, 4], `b1` [8], `w2` [3, 8], `b2` [3]) read from
/// the ONNX file's initializers (little-endian `raw_data`, as numpy_helper writes).
fn weights(path: &Path) -> BTreeMap<String, (Vec<i64>, Vec<f32>)> {
    let model = ModelProto::decode(std::fs::read(path).unwrap().as_slice()).unwrap();
    model
        .graph
        .unwrap()
        .initializer
        .into_iter()
        .map(|t| {
            let values = t
                .raw_data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (t.name().to_string(), (t.dims, values))
        })
        .collect()
}

/// `relu(x @ w1.T + b1) @ w2.T + b2` with libtorch.
fn torch_mlp(w: &BTreeMap<String, (Vec<i64>, Vec<f32>)>, x: &[f32], n: i64) -> Vec<f32> {
    let t = |name: &str| {
        let (dims, v) = &w[name];
        tch::Tensor::from_slice(v).view(dims.as_slice())
    };
    let x = tch::Tensor::from_slice(x).view([n, 4]);
    let h = (x.matmul(&t("w1").tr()) + t("b1")).relu();
    let y = h.matmul(&t("w2").tr()) + t("b2");
    let len = (n * 3) as usize;
    let mut out = vec![0.0f32; len];
    y.copy_data(&mut out, len);
    out
}

/// The same MLP as a TensorFlow graph (MatMul with transpose_b, AddV2, Relu).
fn tf_mlp(w: &BTreeMap<String, (Vec<i64>, Vec<f32>)>, x: &[f32], n: u64) -> Vec<f32> {
    let mut graph = Graph::new();
    let placeholder = |graph: &mut Graph, name: &str| {
        let mut op = graph.new_operation("Placeholder", name).unwrap();
        op.set_attr_type("dtype", tensorflow::DataType::Float)
            .unwrap();
        op.finish().unwrap()
    };
    let binary = |graph: &mut Graph,
                  kind: &str,
                  name: &str,
                  a: &tensorflow::Operation,
                  b: &tensorflow::Operation| {
        let mut op = graph.new_operation(kind, name).unwrap();
        op.add_input(a.clone());
        op.add_input(b.clone());
        if kind == "MatMul" {
            op.set_attr_bool("transpose_b", true).unwrap();
        }
        op.finish().unwrap()
    };
    let names = ["x", "w1", "b1", "w2", "b2"];
    let ph: Vec<tensorflow::Operation> = names
        .iter()
        .map(|name| placeholder(&mut graph, name))
        .collect();
    let m1 = binary(&mut graph, "MatMul", "m1", &ph[0], &ph[1]);
    let a1 = binary(&mut graph, "AddV2", "a1", &m1, &ph[2]);
    let r1 = {
        let mut op = graph.new_operation("Relu", "r1").unwrap();
        op.add_input(a1);
        op.finish().unwrap()
    };
    let m2 = binary(&mut graph, "MatMul", "m2", &r1, &ph[3]);
    let y = binary(&mut graph, "AddV2", "y", &m2, &ph[4]);
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let mut feeds = vec![Tensor::new(&[n, 4]).with_values(x).unwrap()];
    for name in &names[1..] {
        let (dims, v) = &w[*name];
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        feeds.push(Tensor::new(&dims).with_values(v).unwrap());
    }
    let mut args = SessionRunArgs::new();
    for (op, t) in ph.iter().zip(&feeds) {
        args.add_feed(op, 0, t);
    }
    let fetch = args.request_fetch(&y, 0);
    session.run(&mut args).unwrap();
    let out: Tensor<f32> = args.fetch(fetch).unwrap();
    out.to_vec()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn onnx_runtime_beside_libtorch_and_tensorflow() {
    let Some(python) = kiln_testkit::python("onnx_runtime_beside_libtorch_and_tensorflow") else {
        return;
    };
    let dir = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "onnx-in-kiln");
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("platform-core/onnx/tests/reference/onnx_models.py");
    kiln_testkit::run_reference(&python, &script, &[&dir]);
    let (data, _) = StateDict::load_safetensors(dir.join("data.safetensors")).unwrap();
    let mlp = dir.join("mlp.onnx");
    let w = weights(&mlp);

    for (case, n) in [("b3", 3usize), ("b17", 17)] {
        let x: &HostTensor = data.get(&format!("mlp.x.{case}")).unwrap();
        let expected = data.get(&format!("mlp.y.{case}")).unwrap();
        let expected = expected.as_slice::<f32>().unwrap();
        let xs = x.as_slice::<f32>().unwrap();

        // libtorch and TensorFlow first, so ONNX Runtime loads into a process
        // that already holds both (and their protobufs).
        let by_torch = torch_mlp(&w, xs, n as i64);
        let by_tf = tf_mlp(&w, xs, n as u64);
        let model = OnnxModel::load(&mlp).unwrap();
        let by_ort = model.predict(x).unwrap();
        let by_ort = by_ort.as_slice::<f32>().unwrap();
        // And each again after ONNX Runtime ran.
        let by_torch_again = torch_mlp(&w, xs, n as i64);
        let by_tf_again = tf_mlp(&w, xs, n as u64);

        let ort_diff = max_diff(by_ort, expected);
        let torch_diff = max_diff(&by_torch, expected);
        let tf_diff = max_diff(&by_tf, expected);
        eprintln!(
            "{case}: max |diff| vs Python onnxruntime: Kiln's ONNX Runtime {ort_diff:e}, \
             libtorch {torch_diff:e}, TensorFlow {tf_diff:e}"
        );
        assert!(ort_diff <= 1e-6, "ONNX Runtime: {ort_diff}");
        let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let tol = kiln_testkit::tolerance::F32;
        kiln_testkit::assert_close(
            "libtorch MLP",
            &f64s(&by_torch),
            &f64s(expected),
            tol,
            "onnxruntime",
        );
        kiln_testkit::assert_close(
            "TensorFlow MLP",
            &f64s(&by_tf),
            &f64s(expected),
            tol,
            "onnxruntime",
        );
        assert_eq!(by_torch, by_torch_again, "libtorch after ONNX Runtime");
        assert_eq!(by_tf, by_tf_again, "TensorFlow after ONNX Runtime");
    }

    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for lib in ["libtorch_cpu.so", "libtensorflow", "libonnxruntime.so"] {
        assert!(maps.contains(lib), "{lib} is not mapped in this process");
    }
}
