//! Step 5's bridge: one function, registering the TensorFlow ops
//! (`cpp/squared_relu_tf.h`). Graph nodes are added with the `tensorflow` crate,
//! so nothing else crosses.

#[cxx::bridge(namespace = "example")]
pub(crate) mod bridge {
    // SAFETY: the declaration matches cpp/squared_relu_tf.h (cxx checks it at
    // compile time); the function takes no pointers and reports failure by
    // throwing, which `Result` turns into an error.
    unsafe extern "C++" {
        include!("kiln-example-custom-op/cpp/squared_relu_tf.h");

        fn register_tf_ops() -> Result<()>;
    }
}
