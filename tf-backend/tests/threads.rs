//! `set_thread_counts`: applied to the sessions Kiln creates, and refused once
//! TensorFlow has sized its thread pools. One test in its own binary: the counts
//! are process-wide.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use kiln_core::{
    model::{Layer, LinearConfig},
    module::Module,
    Device, Error, HostTensor,
};
use kiln_tf::{set_thread_counts, TfBackend, TfModel, TfTensor};

#[test]
fn thread_counts_are_set_before_the_first_session_and_refused_after() {
    let err = set_thread_counts(usize::MAX, 1).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { .. }) && err.to_string().contains("intra_op"),
        "{err}"
    );
    set_thread_counts(1, 1).unwrap();
    set_thread_counts(2, 1).unwrap(); // no session yet: still free to change

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

    let err = set_thread_counts(4, 4).unwrap_err();
    assert!(
        err.to_string()
            .contains("before building or loading any TensorFlow model"),
        "{err}"
    );
    set_thread_counts(2, 1).unwrap(); // the counts in force: nothing to change
}
