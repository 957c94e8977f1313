//! Kiln's fused ops as [`Layer::Custom`] layers that [`TorchModel`](kiln_torch::TorchModel),
//! `TfModel` (with the `tf` feature) and so the `Trainer` on either backend can use.
//!
//! Call [`register_layers`](crate::register_layers) once at start-up, then build
//! the layers with [`bias_gelu`] and [`swish`] or write them in a config file:
//!
//! ```toml
//! { type = "custom", op = "kiln::swish", params = [{ name = "beta", shape = [1], init = { type = "ones" } }] }
//! ```

use kiln_core::{
    model::{CustomConfig, Init, Layer},
    Error, Result,
};
use kiln_torch::TorchScriptLowering;

/// The op name of the fused bias + GELU layer.
pub const BIAS_GELU: &str = "kiln::bias_gelu";
/// The op name of the Swish-β layer.
pub const SWISH: &str = "kiln::swish";

/// `gelu(x + bias)` on the last dimension, as one kernel, with a learned `bias` of
/// `features` elements starting at zero: a `Linear(.., features, bias=False)`
/// followed by it computes `nn.Linear` + `nn.GELU()` with the bias fused.
///
/// ```
/// use kiln_core::model::{Layer, LinearConfig};
///
/// let net = Layer::sequential([
///     LinearConfig::new(64, 128).with_bias(false).into(),
///     kiln_fused_ops::layer::bias_gelu(128),
///     LinearConfig::new(128, 10).into(),
/// ]);
/// assert_eq!(net.parameter_specs("")?[1].name, "1.bias");
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn bias_gelu(features: usize) -> Layer {
    CustomConfig::new(BIAS_GELU)
        .with_param("bias", [features], Init::Zeros)
        .into()
}

/// Swish-β, `x * sigmoid(beta * x)`, with one learned `beta` starting at `beta`
/// (1 is SiLU).
pub fn swish(beta: f64) -> Layer {
    CustomConfig::new(SWISH)
        .with_param("beta", [1], Init::Constant { value: beta })
        .into()
}

/// Checks that a layer declares exactly the parameters `names`, in order.
fn expect_params(config: &CustomConfig, names: &[&str]) -> Result<()> {
    let declared: Vec<&str> = config.params.iter().map(|p| p.name.as_str()).collect();
    if declared == names {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            format!("{}.params", config.op),
            format!("expected the parameters {names:?}, got {declared:?}"),
        ))
    }
}

/// Registers the ops' lowerings to standard ops with the exporters, so that an
/// exported model needs no Kiln library: `gelu(x + bias)` (exact GELU, bias on
/// the last dimension) and `x * sigmoid(beta * x)`, in ONNX and in TorchScript
/// (the TensorFlow ones are in [`register_tf`]).
pub(crate) fn register_lowerings() {
    use kiln_onnx::export::attr;
    kiln_onnx::register_onnx_lowering(BIAS_GELU, |op| {
        expect_params(op.config(), &["bias"])?;
        let bias = op.param("bias")?;
        let x = op.input().to_owned();
        let z = op.node("Add", &[&x, &bias], vec![]);
        Ok(op.node("Gelu", &[&z], vec![attr::string("approximate", "none")]))
    });
    kiln_onnx::register_onnx_lowering(SWISH, |op| {
        expect_params(op.config(), &["beta"])?;
        let beta = op.param("beta")?;
        let x = op.input().to_owned();
        let bx = op.node("Mul", &[&beta, &x], vec![]);
        let s = op.node("Sigmoid", &[&bx], vec![]);
        Ok(op.node("Mul", &[&x, &s], vec![]))
    });
    kiln_torch::register_torchscript_lowering(BIAS_GELU, |config| {
        expect_params(config, &["bias"])?;
        Ok(TorchScriptLowering {
            class: "BiasGelu".to_owned(),
            forward: "return torch.gelu(torch.add(x, self.bias))".to_owned(),
        })
    });
    kiln_torch::register_torchscript_lowering(SWISH, |config| {
        expect_params(config, &["beta"])?;
        Ok(TorchScriptLowering {
            class: "Swish".to_owned(),
            forward: "return torch.mul(x, torch.sigmoid(torch.mul(self.beta, x)))".to_owned(),
        })
    });
}

pub(crate) fn register_torch() {
    kiln_torch::register_custom_layer(BIAS_GELU, |x, params, config| {
        expect_params(config, &["bias"])?;
        crate::bias_gelu(x, params[0])
    });
    kiln_torch::register_custom_layer(SWISH, |x, params, config| {
        expect_params(config, &["beta"])?;
        crate::swish(x, params[0])
    });
}

#[cfg(feature = "tf")]
pub(crate) fn register_tf() {
    use tensorflow::Output;

    let out0 = |operation| Output {
        operation,
        index: 0,
    };
    kiln_tf::register_custom_layer(BIAS_GELU, move |graph, name, x, params, config| {
        expect_params(config, &["bias"])?;
        crate::tf::bias_gelu(graph, name, x, params[0].clone()).map(out0)
    });
    kiln_tf::register_custom_layer(SWISH, move |graph, name, x, params, config| {
        expect_params(config, &["beta"])?;
        crate::tf::swish(graph, name, x, params[0].clone()).map(out0)
    });
    // What a SavedModel export writes instead: Python's TensorFlow and TF
    // Serving do not load Kiln's op library.
    kiln_tf::register_portable_custom_layer(BIAS_GELU, |graph, name, x, params, config| {
        expect_params(config, &["bias"])?;
        crate::tf::portable_bias_gelu(graph, name, x, params[0].clone())
    });
    kiln_tf::register_portable_custom_layer(SWISH, |graph, name, x, params, config| {
        expect_params(config, &["beta"])?;
        crate::tf::portable_swish(graph, name, x, params[0].clone())
    });
}
