//! `set_thread_counts`: applied to the sessions Kiln creates (the threads
//! TensorFlow starts for them, counted in `/proc/self/task`), and refused once
//! TensorFlow has sized its thread pools. One test in its own binary: the counts
//! are process-wide, and no other test's threads are counted.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::{
    model::{Layer, LinearConfig},
    module::Module,
    Device, Error, HostTensor,
};
use kiln_tf::{set_thread_counts, TfBackend, TfModel, TfTensor};

/// The process's threads: (id, name) from `/proc/self/task/<id>/comm`.
fn threads() -> Vec<(String, String)> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            (
                entry.file_name().to_string_lossy().into_owned(),
                name.trim().to_owned(),
            )
        })
        .collect()
}

#[test]
fn thread_counts_apply_to_the_sessions_and_are_refused_after_the_first() {
    let err = set_thread_counts(usize::MAX, 1).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { .. }) && err.to_string().contains("intra_op"),
        "{err}"
    );
    set_thread_counts(1, 1).unwrap();
    // No session yet: still free to change. Counts that are never TensorFlow's
    // default (one per core, each), so that the check below sees them applied.
    let cores = std::thread::available_parallelism().unwrap().get();
    let (intra, inter) = (cores + 1, cores + 2);
    set_thread_counts(intra, inter).unwrap();

    let before: Vec<String> = threads().into_iter().map(|(id, _)| id).collect();
    let spec = Layer::sequential([LinearConfig::new(3, 2).into()]);
    let model = TfModel::new(&spec, Device::Cpu).unwrap();
    let x = TfTensor::from_host(&HostTensor::new(vec![1.0f32, 2.0, 3.0], [1, 3]).unwrap()).unwrap();
    let y = Module::<TfBackend>::forward(&model, &x)
        .unwrap()
        .to_host()
        .unwrap();
    // The layer's own arithmetic, by hand from its weights.
    let state = Module::<TfBackend>::state_dict(&model).unwrap();
    let w = state.get("0.weight").unwrap().to_f64_vec();
    let b = state.get("0.bias").unwrap().to_f64_vec();
    for (j, got) in y.to_f64_vec().into_iter().enumerate() {
        let want = b[j] + (0..3).map(|i| w[j * 3 + i] * (i + 1) as f64).sum::<f64>();
        assert!((got - want).abs() < 1e-6, "output {j}: {got} vs {want}");
    }

    // The threads the first session started: TensorFlow names its inter-op pool
    // `Compute` (threads `tf_Compute`) and its other threads `tf_...`; the intra-op
    // (Eigen) pool's workers are unnamed, so they keep the name of the thread that
    // started them, this test's.
    let started: Vec<String> = threads()
        .into_iter()
        .filter(|(id, _)| !before.contains(id))
        .map(|(_, name)| name)
        .collect();
    let inter_op = started.iter().filter(|n| *n == "tf_Compute").count();
    let intra_op = started.iter().filter(|n| !n.starts_with("tf_")).count();
    assert_eq!(
        (intra_op, inter_op),
        (intra, inter),
        "threads started by the first session: {started:?}"
    );

    let err = set_thread_counts(4, 4).unwrap_err();
    assert!(
        err.to_string()
            .contains("before building or loading any TensorFlow model"),
        "{err}"
    );
    set_thread_counts(intra, inter).unwrap(); // the counts in force: nothing to change
}
