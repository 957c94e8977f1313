//! A model summary, as `torchinfo.summary` and Lightning's `ModelSummary`
//! print one: each layer's path, type, output shape, parameters (trainable and
//! frozen) and multiply-accumulates for one sample, and the totals.

use std::fmt::Write as _;

use super::Layer;
use crate::error::Result;

/// One row of a [`ModelSummary`]: a layer and everything under it.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSummary {
    /// The dotted path (`""` for the model itself).
    pub path: String,
    /// The layer type (`"Linear"`, ...).
    pub kind: &'static str,
    /// Nesting depth: 0 for the model, 1 for its layers, ...
    pub depth: usize,
    /// The output shape for a batch of one sample.
    pub output_shape: Vec<usize>,
    /// Parameter elements of the layer and its children.
    pub params: usize,
    /// Of those, the ones the optimizer trains.
    pub trainable: usize,
    /// Multiply-accumulates of the layer and its children for one sample, or
    /// `None` where a layer's cannot be known (a TorchScript, SavedModel or
    /// custom layer inside).
    pub macs: Option<u64>,
}

/// What a model is made of: one [`LayerSummary`] per layer, parents before
/// children, and the totals.
///
/// ```
/// use kiln_core::model::{Layer, LinearConfig, ModelSummary};
///
/// let net = Layer::sequential([LinearConfig::new(4, 8).into(), Layer::Relu,
///                              LinearConfig::new(8, 2).into()]);
/// let params = [("0.weight", 32), ("0.bias", 8), ("2.weight", 16), ("2.bias", 2)];
/// let params: Vec<(String, usize)> = params.iter().map(|(n, c)| (n.to_string(), *c)).collect();
/// let summary = ModelSummary::new(&net, &[4], &params, &["0.weight".to_owned()])?;
/// assert_eq!((summary.total_params(), summary.trainable_params()), (58, 26));
/// assert_eq!(summary.total_macs(), Some(4 * 8 + 8 * 2));
/// assert_eq!(summary.layers()[1].output_shape, [1, 8]);
/// assert!(summary.table(None).contains("params: 58 (26 trainable, 32 frozen)"));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSummary {
    input_shape: Vec<usize>,
    layers: Vec<LayerSummary>,
}

impl ModelSummary {
    /// The summary of `spec` for one sample of shape `sample` (without the
    /// batch dimension), given the built model's parameters with their
    /// element counts (adapters included: each counts in the deepest layer
    /// whose path prefixes its name) and the names of the frozen ones.
    ///
    /// Fails, naming the layer, where the sample does not fit the model.
    pub fn new(
        spec: &Layer,
        sample: &[usize],
        parameters: &[(String, usize)],
        frozen: &[String],
    ) -> Result<Self> {
        let mut input_shape = vec![1];
        input_shape.extend_from_slice(sample);
        let mut layers = Vec::new();
        walk(spec, "", 0, &input_shape, &mut layers)?;
        // Each parameter counts in its deepest layer and every one above it.
        for (name, count) in parameters {
            let trainable = !frozen.contains(name);
            for row in &mut layers {
                if owns(&row.path, name) {
                    row.params += count;
                    if trainable {
                        row.trainable += count;
                    }
                }
            }
        }
        Ok(Self {
            input_shape,
            layers,
        })
    }

    /// The input shape summarised: one sample with its batch dimension.
    pub fn input_shape(&self) -> &[usize] {
        &self.input_shape
    }

    /// Every layer, parents before children.
    pub fn layers(&self) -> &[LayerSummary] {
        &self.layers
    }

    /// All parameter elements.
    pub fn total_params(&self) -> usize {
        self.layers.first().map_or(0, |root| root.params)
    }

    /// The trained parameter elements.
    pub fn trainable_params(&self) -> usize {
        self.layers.first().map_or(0, |root| root.trainable)
    }

    /// Multiply-accumulates for one sample, if every layer's is known.
    pub fn total_macs(&self) -> Option<u64> {
        self.layers.first().and_then(|root| root.macs)
    }

    /// The table, as `torchinfo` prints it: layers down to `max_depth` (all
    /// with `None`; deeper ones count in their parent's row), then the totals.
    pub fn table(&self, max_depth: Option<usize>) -> String {
        let rows: Vec<&LayerSummary> = self
            .layers
            .iter()
            .filter(|l| max_depth.is_none_or(|d| l.depth <= d))
            .collect();
        let name = |l: &LayerSummary| {
            let indent = "  ".repeat(l.depth);
            if l.path.is_empty() {
                format!("{indent}{}", l.kind)
            } else {
                format!("{indent}{} ({})", l.path, l.kind)
            }
        };
        let width = rows.iter().map(|l| name(l).len()).max().unwrap_or(0).max(5);
        let shape = |l: &LayerSummary| format!("{:?}", l.output_shape);
        let shape_width = rows
            .iter()
            .map(|l| shape(l).len())
            .max()
            .unwrap_or(0)
            .max(12);
        let mut out = String::new();
        let header = format!(
            "{:<width$}  {:<shape_width$}  {:>14}  {:>14}  {:>16}",
            "layer", "output shape", "params", "trainable", "mult-adds"
        );
        let rule = "=".repeat(header.len());
        let _ = writeln!(out, "{rule}\n{header}\n{rule}");
        for l in &rows {
            let _ = writeln!(
                out,
                "{:<width$}  {:<shape_width$}  {:>14}  {:>14}  {:>16}",
                name(l),
                shape(l),
                thousands(l.params as u64),
                thousands(l.trainable as u64),
                l.macs.map_or_else(|| "?".to_owned(), thousands),
            );
        }
        let (total, trainable) = (self.total_params(), self.trainable_params());
        let _ = writeln!(out, "{rule}");
        let _ = writeln!(
            out,
            "params: {} ({} trainable, {} frozen)",
            thousands(total as u64),
            thousands(trainable as u64),
            thousands((total - trainable) as u64)
        );
        let opaque: Vec<&str> = self
            .layers
            .iter()
            .filter(|l| is_opaque(l.kind))
            .map(|l| l.path.as_str())
            .collect();
        let _ = match self.total_macs() {
            Some(macs) => writeln!(
                out,
                "mult-adds for one sample of {:?}: {}",
                self.input_shape,
                thousands(macs)
            ),
            None => {
                let known: u64 = self
                    .layers
                    .iter()
                    .filter(|l| !is_container(l.kind))
                    .filter_map(|l| l.macs)
                    .sum();
                writeln!(
                    out,
                    "mult-adds for one sample of {:?}: {} and those of {} (not measurable)",
                    self.input_shape,
                    thousands(known),
                    opaque.join(", ")
                )
            }
        };
        let _ = write!(out, "{rule}");
        out
    }
}

/// Whether `name` belongs to the layer at `path`.
fn owns(path: &str, name: &str) -> bool {
    path.is_empty()
        || name
            .strip_prefix(path)
            .is_some_and(|rest| rest.starts_with('.'))
}

fn is_container(kind: &str) -> bool {
    matches!(kind, "Sequential" | "Residual" | "Parallel")
}

fn is_opaque(kind: &str) -> bool {
    matches!(kind, "TorchScript" | "SavedModel" | "Custom")
}

/// Adds the rows of `layer` at `path` for an input of `input`; returns its output shape.
fn walk(
    layer: &Layer,
    path: &str,
    depth: usize,
    input: &[usize],
    rows: &mut Vec<LayerSummary>,
) -> Result<Vec<usize>> {
    let at = rows.len();
    rows.push(LayerSummary {
        path: path.to_owned(),
        kind: layer.kind(),
        depth,
        output_shape: Vec::new(),
        params: 0,
        trainable: 0,
        macs: Some(0),
    });
    let join = |child: &str| super::layers::join(path, child);
    let (output, macs) = match layer {
        Layer::Sequential { layers } => {
            let mut shape = input.to_vec();
            let mut macs = Some(0u64);
            for (i, child) in layers.iter().enumerate() {
                let first = rows.len();
                shape = walk(child, &join(&i.to_string()), depth + 1, &shape, rows)?;
                macs = macs.zip(rows[first].macs).map(|(a, b)| a + b);
            }
            (shape, macs)
        }
        Layer::Residual { block } => {
            let first = rows.len();
            walk(block, &join("block"), depth + 1, input, rows)?;
            (layer.output_shape(input)?, rows[first].macs)
        }
        Layer::Parallel { branches } => {
            let mut macs = Some(0u64);
            for (i, child) in branches.iter().enumerate() {
                let first = rows.len();
                walk(child, &join(&i.to_string()), depth + 1, input, rows)?;
                macs = macs.zip(rows[first].macs).map(|(a, b)| a + b);
            }
            (layer.output_shape(input)?, macs)
        }
        leaf => {
            let output = leaf.infer(path, input)?;
            let macs = leaf_macs(leaf, input, &output);
            (output, macs)
        }
    };
    rows[at].output_shape = output.clone();
    rows[at].macs = macs;
    Ok(output)
}

/// Multiply-accumulates of one layer's matrix products and convolutions
/// (elementwise work, normalisation and pooling count as none); `None` for a
/// layer whose work cannot be known.
fn leaf_macs(layer: &Layer, input: &[usize], output: &[usize]) -> Option<u64> {
    let numel = |dims: &[usize]| dims.iter().product::<usize>() as u64;
    let (out, inp) = (numel(output), numel(input));
    let last = |dims: &[usize]| dims.last().copied().unwrap_or(1) as u64;
    Some(match layer {
        Layer::Linear(c) => out * c.in_features as u64,
        Layer::TiedLinear(c) => out * c.in_features as u64,
        Layer::Conv1d(c) => out * (c.in_channels / c.groups.max(1) * c.kernel_size) as u64,
        Layer::Conv2d(c) => {
            out * (c.in_channels / c.groups.max(1) * c.kernel_size[0] * c.kernel_size[1]) as u64
        }
        Layer::ConvTranspose2d(c) => {
            inp * (c.out_channels / c.groups.max(1) * c.kernel_size[0] * c.kernel_size[1]) as u64
        }
        Layer::MultiHeadSelfAttention(c) => {
            // In, out projections and the two products over `tokens` positions
            // of `seq` (the batch of one times the sequence).
            let e = c.embed_dim as u64;
            let tokens = inp / e.max(1);
            let seq = input
                .get(input.len().saturating_sub(2))
                .copied()
                .unwrap_or(1) as u64;
            4 * tokens * e * e + 2 * tokens * seq * e
        }
        Layer::SelfAttention(c) => {
            let e = c.embed_dim as u64;
            let (heads, kv, d) = (c.num_heads as u64, c.kv_heads() as u64, c.head_dim() as u64);
            let tokens = inp / e.max(1);
            let seq = input
                .get(input.len().saturating_sub(2))
                .copied()
                .unwrap_or(1) as u64;
            tokens * e * (heads + 2 * kv) * d
                + 2 * tokens * seq * heads * d
                + tokens * heads * d * e
        }
        Layer::GatedMlp(c) => {
            let tokens = inp / last(input).max(1);
            3 * tokens * (c.dim * c.hidden_dim) as u64
        }
        Layer::SparseMoe(c) => {
            // The router, each token's top_k experts, and the shared expert.
            let tokens = inp / last(input).max(1);
            let expert = 3 * (c.dim * c.hidden_dim) as u64;
            let shared = c.shared_expert_dim.map_or(0, |s| (3 * s + 1) * c.dim) as u64;
            tokens * ((c.num_experts * c.dim) as u64 + c.top_k as u64 * expert + shared)
        }
        Layer::TorchScript(_) | Layer::SavedModel(_) | Layer::Custom(_) => return None,
        _ => 0,
    })
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{BatchNormConfig, Conv2dConfig, LinearConfig, Pool2dConfig};

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    /// A small CNN's rows, counted by hand.
    #[test]
    fn a_cnn_by_hand() -> Result<()> {
        let net = Layer::sequential([
            Conv2dConfig::new(1, 4, [3, 3]).with_padding([1, 1]).into(),
            Layer::BatchNorm2d(BatchNormConfig::new(4)),
            Layer::Relu,
            Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
            Layer::Flatten {
                start_dim: 1,
                end_dim: -1,
            },
            Layer::residual(Layer::sequential([LinearConfig::new(64, 64).into()])),
            LinearConfig::new(64, 10).into(),
        ]);
        let specs = net.parameter_specs("")?;
        let params: Vec<(String, usize)> = specs
            .iter()
            .filter(|s| s.kind == crate::model::ParamKind::Parameter)
            .map(|s| (s.name.clone(), s.shape.iter().product()))
            .collect();
        let summary = ModelSummary::new(&net, &[1, 8, 8], &params, &["0.weight".to_owned()])?;
        let rows = summary.layers();
        let paths: Vec<&str> = rows.iter().map(|r| r.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "",
                "0",
                "1",
                "2",
                "3",
                "4",
                "5",
                "5.block",
                "5.block.0",
                "6"
            ]
        );
        assert_eq!(rows[1].output_shape, [1, 4, 8, 8]);
        // 4 * 8 * 8 outputs, each 1 * 3 * 3 products.
        assert_eq!(rows[1].macs, Some(256 * 9));
        assert_eq!((rows[1].params, rows[1].trainable), (40, 4));
        assert_eq!(
            rows[2].params, 8,
            "batch norm's weight and bias; buffers do not count"
        );
        assert_eq!(rows[4].output_shape, [1, 4, 4, 4]);
        assert_eq!(rows[5].output_shape, [1, 64]);
        assert_eq!(
            (rows[6].params, rows[6].macs),
            (64 * 64 + 64, Some(64 * 64))
        );
        assert_eq!(rows[6].depth, 1);
        assert_eq!(rows[8].depth, 3);
        let total = 40 + 8 + 64 * 65 + 650;
        assert_eq!(summary.total_params(), total);
        assert_eq!(summary.trainable_params(), total - 36);
        assert_eq!(summary.total_macs(), Some(256 * 9 + 64 * 64 + 640));
        let table = summary.table(Some(1));
        assert!(table.contains("5 (Residual)"), "{table}");
        assert!(!table.contains("5.block"), "{table}");
        assert!(
            table.contains(&format!("params: {} ", thousands(total as u64))),
            "{table}"
        );
        Ok(())
    }

    #[test]
    fn a_sample_that_does_not_fit_names_the_layer() {
        let net = Layer::sequential([
            LinearConfig::new(4, 8).into(),
            LinearConfig::new(16, 2).into(),
        ]);
        let err = ModelSummary::new(&net, &[4], &[], &[])
            .unwrap_err()
            .to_string();
        assert_eq!(err, "1 (Linear): expected shape [*, 16], got [1, 8]");
    }
}
