//! [`export_torchscript`]: a [`TorchModel`] as a TorchScript file that Python's
//! `torch.jit.load` runs and trains, with Kiln's state-dict names.
//!
//! Each Kiln layer becomes one `torch::jit::Module` with a class of its own
//! (`__torch__.kiln.Linear`, `__torch__.kiln.BatchNorm2d`, mangled by libtorch
//! when a name repeats), its parameters and buffers registered under
//! PyTorch's names, and a `forward` written in TorchScript that calls the aten
//! ops kiln-torch's own layers call (`torch.linear`, `torch.batch_norm`,
//! `torch.scaled_dot_product_attention`, ...), so the exported model computes
//! what the Kiln model does, bit for bit on the same device. Containers keep
//! their children as submodules named `"0"`, `"1"`, ... (`Sequential`) and
//! `"block"` (`Residual`), which is what makes the state-dict names Kiln's.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_core::{
    model::{GeluApproximation, Layer, ParamKind},
    module::Module,
    Error, Result,
};
use tch::Tensor;

use super::export_bridge::{forward_mismatch, ExportGraph, NodeId};
use crate::layers::join;
use crate::model::{lock_script, TorchModel};

/// Writes `model` as a TorchScript file (its current weights, on CPU) that
/// Python's `torch.jit.load` runs, and [`ScriptModule::load`](super::ScriptModule::load)
/// loads back into Kiln.
///
/// The file holds one module per Kiln layer, with the model's state-dict names
/// (`0.weight`, `1.running_mean`, `3.block.1.in_proj_weight`) in PyTorch's
/// order, trainable parameters requiring gradients (frozen ones not), and a
/// `forward` that computes what the Kiln model computes: dropout and batch
/// norm follow the module's `training` flag as `nn.Dropout` and
/// `nn.BatchNorm` do (batch statistics, running-statistics update and
/// `num_batches_tracked` in training), so the model trains on in Python like
/// the original; a Kiln batch norm that `keep_frozen_batch_norm_in_eval`
/// pinned to eval behaviour keeps it in the export (one inside a TorchScript
/// layer follows the flag again). The exported `training` flag is the model's
/// mode at export, and `torch.jit.load` keeps it: put the model in eval mode
/// first (`model.set_mode(Mode::Eval)`) for a file that serves, or call
/// `.eval()` / `.train()` on the loaded module.
///
/// Kiln's fused ops `kiln::bias_gelu` and `kiln::swish` export as their
/// composition of standard ops (`gelu(x + bias)`, `x * sigmoid(beta * x)`), so
/// Python needs no Kiln library; a [`Layer::TorchScript`] layer becomes a copy
/// of its TorchScript module with its current weights. A model on CUDA is
/// copied to the CPU for saving; a bfloat16 model exports its bfloat16
/// weights; the precision set by `TorchModel::set_precision` (autocast) is
/// not part of the file.
///
/// Everything is checked before the first byte is written, and the file is
/// written atomically (a temporary directory beside `path`, then a rename):
///
/// - any other [`Layer::Custom`] op (or a `Layer::SavedModel`, or a
///   TorchScript layer whose forward does not take one tensor and return
///   one) is [`Error::Unsupported`] naming the layer's path and op;
/// - a missing parent directory is [`Error::Io`] (`NotFound`);
/// - an existing `path` without `overwrite` is [`Error::Io`] whose source has
///   [`std::io::ErrorKind::AlreadyExists`], and the file is left as it was.
///
/// ```no_run
/// use kiln_core::{backend::Mode, model::{Layer, LinearConfig}, module::Module, Device};
/// use kiln_torch::{export_torchscript, TorchModel};
///
/// let mut model = TorchModel::new(&Layer::sequential([
///     LinearConfig::new(4, 8).into(),
///     Layer::Relu,
///     LinearConfig::new(8, 2).into(),
/// ]), Device::Cpu)?;
/// model.set_mode(Mode::Eval);
/// export_torchscript(&model, "model.pt", false)?;
/// // Python: m = torch.jit.load("model.pt"); m.state_dict().keys() -> 0.weight, 0.bias, 2.weight, 2.bias
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn export_torchscript(
    model: &TorchModel,
    path: impl AsRef<Path>,
    overwrite: bool,
) -> Result<()> {
    let path = path.as_ref();
    let target = Target::check(path, overwrite)?;
    let spec = model.spec();
    check_supported(spec, "")?;

    let mut tensors: HashMap<String, (Tensor, ParamKind)> = HashMap::new();
    for (name, tensor) in model.named_parameters()? {
        tensors.insert(name, (tensor, ParamKind::Parameter));
    }
    for (name, tensor) in model.named_buffers()? {
        tensors.insert(name, (tensor, ParamKind::Buffer));
    }
    let mut exporter = Exporter {
        graph: ExportGraph::new()?,
        tensors: &tensors,
        model,
        pinned: model.eval_pinned_layers().into_iter().collect(),
    };
    let root = tch::no_grad(|| exporter.emit(spec, ""))?;
    target.write(|tmp| exporter.graph.save(root, tmp, model.mode().is_train()))?;
    log::info!("exported the model as TorchScript to {}", path.display());
    Ok(())
}

/// `2.block.0 (Linear)`, or `(root) (Linear)`.
fn describe(path: &str, layer: &Layer) -> String {
    let shown = if path.is_empty() { "(root)" } else { path };
    format!("{shown} ({})", layer.kind())
}

/// The op names whose composition of standard ops the exporter writes, with
/// the parameters they take.
const FUSED_OPS: [(&str, &[&str]); 2] =
    [("kiln::bias_gelu", &["bias"]), ("kiln::swish", &["beta"])];

/// Fails on the first layer that cannot be exported, naming its path.
fn check_supported(layer: &Layer, path: &str) -> Result<()> {
    match layer {
        Layer::Sequential { layers } => layers
            .iter()
            .enumerate()
            .try_for_each(|(i, child)| check_supported(child, &join(path, &i.to_string()))),
        Layer::Residual { block } => check_supported(block, &join(path, "block")),
        Layer::Custom(config) => {
            let Some((_, params)) = FUSED_OPS.iter().find(|(op, _)| *op == config.op) else {
                return Err(Error::unsupported(format!(
                    "exporting {} as TorchScript: its op `{}` is not one Kiln can write as \
                     standard ops (Python cannot load a custom op library); exportable custom \
                     ops: {}",
                    describe(path, layer),
                    config.op,
                    FUSED_OPS.map(|(op, _)| format!("`{op}`")).join(", ")
                )));
            };
            let declared: Vec<&str> = config.params.iter().map(|p| p.name.as_str()).collect();
            if declared != *params {
                return Err(Error::invalid_argument(
                    format!("{}.params", if path.is_empty() { "(root)" } else { path }),
                    format!(
                        "{} declares the parameters {declared:?}; `{}` takes {params:?}",
                        describe(path, layer),
                        config.op
                    ),
                ));
            }
            Ok(())
        }
        Layer::SavedModel(config) => Err(Error::unsupported(format!(
            "exporting {} ({}) as TorchScript: a SavedModel runs on TensorFlow",
            describe(path, layer),
            config.path.display()
        ))),
        _ => Ok(()),
    }
}

/// Builds the module tree of a model in an [`ExportGraph`].
struct Exporter<'a> {
    graph: ExportGraph,
    /// The model's parameters and buffers by full name.
    tensors: &'a HashMap<String, (Tensor, ParamKind)>,
    model: &'a TorchModel,
    /// The batch norms kept in eval behaviour while the model trains.
    pinned: HashSet<String>,
}

impl Exporter<'_> {
    /// The module of `layer` at `path`, with its children, tensors and forward.
    fn emit(&mut self, layer: &Layer, path: &str) -> Result<NodeId> {
        let what = describe(path, layer);
        match layer {
            Layer::Sequential { layers } => {
                let node = self.graph.add_module("Sequential", path)?;
                let mut body = String::new();
                for (i, child) in layers.iter().enumerate() {
                    let name = i.to_string();
                    let child_node = self.emit(child, &join(path, &name))?;
                    self.graph.add_child(node, &name, child_node)?;
                    // TorchScript reaches a submodule with a numeric name this way;
                    // a module is called through its `forward` (C++ TorchScript has no `__call__`).
                    let _ = writeln!(body, "    x = getattr(self, \"{name}\").forward(x)");
                }
                body.push_str("    return x\n");
                self.graph.define(node, &forward(&body), &what)?;
                Ok(node)
            }
            Layer::Residual { block } => {
                let node = self.graph.add_module("Residual", path)?;
                let child = self.emit(block, &join(path, "block"))?;
                self.graph.add_child(node, "block", child)?;
                self.graph.define(
                    node,
                    &forward("    return torch.add(x, self.block.forward(x))\n"),
                    &what,
                )?;
                Ok(node)
            }
            Layer::TorchScript(config) => {
                let module = self.model.script_layer(path).ok_or_else(|| {
                    Error::backend(
                        "torch",
                        format!("exporting {what}"),
                        format!("the model holds no module for {}", config.path.display()),
                    )
                })?;
                let module = lock_script(module)?;
                if let Some(schema) = forward_mismatch(module.c_module())? {
                    return Err(Error::unsupported(format!(
                        "exporting {what} ({}): its forward is `{schema}`; a layer of an \
                         exported model takes one tensor and returns one",
                        config.path.display()
                    )));
                }
                self.graph.add_script_module(module.c_module(), path)
            }
            leaf => self.emit_leaf(leaf, path, &what),
        }
    }

    /// A layer without children: its tensors under their local names (the
    /// attention's `out_proj.*` in an `out_proj` submodule), and its forward.
    fn emit_leaf(&mut self, layer: &Layer, path: &str, what: &str) -> Result<NodeId> {
        let specs = layer.parameter_specs(path)?;
        let mut own = Vec::new();
        let mut out_proj = Vec::new();
        for spec in &specs {
            let local = match path {
                "" => spec.name.as_str(),
                _ => spec
                    .name
                    .strip_prefix(path)
                    .and_then(|rest| rest.strip_prefix('.'))
                    .unwrap_or(spec.name.as_str()),
            };
            let (tensor, kind) = self
                .tensors
                .get(&spec.name)
                .ok_or_else(|| Error::MissingKey {
                    key: spec.name.clone(),
                    available: self.tensors.len(),
                })?;
            match local.strip_prefix("out_proj.") {
                Some(name) => out_proj.push((name.to_owned(), tensor, *kind)),
                None => own.push((local.to_owned(), tensor, *kind)),
            }
        }
        let has = |name: &str| own.iter().any(|(n, _, _)| n == name);
        let (class, body) = leaf_forward(layer, &has, self.pinned.contains(path))?;
        let node = self.graph.add_module(class, path)?;
        for (name, tensor, kind) in &own {
            self.graph
                .add_tensor(node, name, tensor, *kind == ParamKind::Buffer)?;
        }
        if !out_proj.is_empty() {
            // nn.MultiheadAttention's output projection is a Linear submodule.
            let child = self.graph.add_module("Linear", &join(path, "out_proj"))?;
            for (name, tensor, kind) in &out_proj {
                self.graph
                    .add_tensor(child, name, tensor, *kind == ParamKind::Buffer)?;
            }
            let bias = if out_proj.iter().any(|(n, _, _)| n == "bias") {
                "self.bias"
            } else {
                "None"
            };
            let source = forward(&format!(
                "    return torch.linear(x, self.weight, {bias})\n"
            ));
            self.graph.define(
                child,
                &source,
                &format!("{} (Linear)", join(path, "out_proj")),
            )?;
            self.graph.add_child(node, "out_proj", child)?;
        }
        self.graph.define(node, &forward(&body), what)?;
        Ok(node)
    }
}

/// A `forward` of one tensor with `body` (indented four spaces).
fn forward(body: &str) -> String {
    format!("def forward(self, x: Tensor) -> Tensor:\n{body}")
}

/// A float as a TorchScript literal that reads back as the same `f64`.
fn float(v: f64) -> String {
    // Rust's `Debug` is the shortest text that round-trips, always with a `.`
    // or an exponent (`0.1`, `1e-5`, `1.0`), which Python's grammar reads as a float.
    format!("{v:?}")
}

/// `[a, b]` for TorchScript.
fn ints(values: &[usize]) -> String {
    let items: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    format!("[{}]", items.join(", "))
}

/// `True` / `False`.
fn boolean(v: bool) -> &'static str {
    if v {
        "True"
    } else {
        "False"
    }
}

/// The class name and the forward body of a layer without children, calling
/// the aten ops kiln-torch's layers (src/layers/) call, with the same
/// arguments. `has(name)` says whether the layer has the tensor `name`;
/// `pinned`, whether it keeps its eval behaviour when the model trains (a
/// frozen batch norm, [`Freeze::keep_frozen_batch_norm_in_eval`](crate::Freeze::keep_frozen_batch_norm_in_eval)),
/// which the exported forward then keeps too, whatever its `training` flag.
fn leaf_forward(
    layer: &Layer,
    has: &dyn Fn(&str) -> bool,
    pinned: bool,
) -> Result<(&'static str, String)> {
    let opt = |name: &str| {
        if has(name) {
            format!("self.{name}")
        } else {
            "None".to_owned()
        }
    };
    let ret = |expr: String| format!("    return {expr}\n");
    Ok(match layer {
        Layer::Linear(_) => (
            "Linear",
            ret(format!("torch.linear(x, self.weight, {})", opt("bias"))),
        ),
        Layer::Conv1d(c) => (
            "Conv1d",
            ret(format!(
                "torch.conv1d(x, self.weight, {}, {}, {}, {}, {})",
                opt("bias"),
                ints(&[c.stride]),
                ints(&[c.padding]),
                ints(&[c.dilation]),
                c.groups
            )),
        ),
        Layer::Conv2d(c) => (
            "Conv2d",
            ret(format!(
                "torch.conv2d(x, self.weight, {}, {}, {}, {}, {})",
                opt("bias"),
                ints(&c.stride),
                ints(&c.padding),
                ints(&c.dilation),
                c.groups
            )),
        ),
        Layer::ConvTranspose2d(c) => (
            "ConvTranspose2d",
            ret(format!(
                "torch.conv_transpose2d(x, self.weight, {}, {}, {}, {}, {}, {})",
                opt("bias"),
                ints(&c.stride),
                ints(&c.padding),
                ints(&c.output_padding),
                c.groups,
                ints(&c.dilation)
            )),
        ),
        Layer::MaxPool2d(c) => (
            "MaxPool2d",
            ret(format!(
                "torch.max_pool2d(x, {}, {}, {}, [1, 1], False)",
                ints(&c.kernel_size),
                ints(&c.effective_stride()),
                ints(&c.padding)
            )),
        ),
        Layer::AvgPool2d(c) => (
            "AvgPool2d",
            ret(format!(
                "torch.avg_pool2d(x, {}, {}, {}, False, True, None)",
                ints(&c.kernel_size),
                ints(&c.effective_stride()),
                ints(&c.padding)
            )),
        ),
        Layer::AdaptiveAvgPool2d { output_size } => (
            "AdaptiveAvgPool2d",
            ret(format!(
                "torch.adaptive_avg_pool2d(x, {})",
                ints(output_size)
            )),
        ),
        Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => {
            let class = if matches!(layer, Layer::BatchNorm1d(_)) {
                "BatchNorm1d"
            } else {
                "BatchNorm2d"
            };
            let tracks = has("running_mean");
            let training = if pinned { "False" } else { "self.training" };
            let mut body = String::new();
            if tracks && has("num_batches_tracked") && !pinned {
                // nn.BatchNorm counts the training batches it normalises.
                body.push_str("    if self.training:\n");
                body.push_str("        self.num_batches_tracked.add_(1)\n");
            }
            // Batch statistics in training, or always without running statistics.
            let batch_stats = if tracks { training } else { "True" };
            body.push_str(&ret(format!(
                "torch.batch_norm(x, {}, {}, {}, {}, {batch_stats}, {}, {}, False)",
                opt("weight"),
                opt("bias"),
                opt("running_mean"),
                opt("running_var"),
                float(c.momentum),
                float(c.eps)
            )));
            (class, body)
        }
        Layer::LayerNorm(c) => (
            "LayerNorm",
            ret(format!(
                "torch.layer_norm(x, {}, {}, {}, {}, False)",
                ints(&c.normalized_shape),
                opt("weight"),
                opt("bias"),
                float(c.eps)
            )),
        ),
        Layer::GroupNorm(c) => (
            "GroupNorm",
            ret(format!(
                "torch.group_norm(x, {}, {}, {}, {}, False)",
                c.num_groups,
                opt("weight"),
                opt("bias"),
                float(c.eps)
            )),
        ),
        Layer::Dropout { p } => (
            "Dropout",
            ret(format!("torch.dropout(x, {}, self.training)", float(*p))),
        ),
        Layer::Embedding(c) => (
            "Embedding",
            ret(format!(
                "torch.embedding(self.weight, x, {}, False, False)",
                c.padding_idx.map_or(-1, |i| i as i64)
            )),
        ),
        Layer::Flatten { start_dim, end_dim } => (
            "Flatten",
            ret(format!("torch.flatten(x, {start_dim}, {end_dim})")),
        ),
        Layer::Relu => ("ReLU", ret("torch.relu(x)".to_owned())),
        Layer::LeakyRelu { negative_slope } => (
            "LeakyReLU",
            // As kiln-torch computes it: x > 0 ? x : slope * x.
            ret(format!(
                "torch.where(torch.gt(x, 0.0), x, torch.mul(x, {}))",
                float(*negative_slope)
            )),
        ),
        Layer::Gelu { approximate } => (
            "GELU",
            ret(format!(
                "torch.gelu(x, approximate=\"{}\")",
                match approximate {
                    GeluApproximation::Tanh => "tanh",
                    _ => "none",
                }
            )),
        ),
        Layer::Silu => ("SiLU", ret("torch.silu(x)".to_owned())),
        Layer::Tanh => ("Tanh", ret("torch.tanh(x)".to_owned())),
        Layer::Sigmoid => ("Sigmoid", ret("torch.sigmoid(x)".to_owned())),
        Layer::Softmax { dim } => ("Softmax", ret(format!("torch.softmax(x, {dim})"))),
        Layer::LogSoftmax { dim } => ("LogSoftmax", ret(format!("torch.log_softmax(x, {dim})"))),
        Layer::MultiHeadSelfAttention(c) => {
            let heads = c.num_heads;
            let mut body = String::new();
            // kiln-torch's attention (src/layers/attention.rs), step by step.
            let _ = write!(
                body,
                "    batch = x.size(0)\n    seq = x.size(1)\n    embed = x.size(2)\n    \
                 head_dim = embed // {heads}\n    \
                 qkv = torch.linear(x, self.in_proj_weight, {})\n    \
                 parts = torch.chunk(qkv, 3, -1)\n    \
                 q = torch.transpose(torch.reshape(parts[0], [batch, seq, {heads}, head_dim]), 1, 2)\n    \
                 k = torch.transpose(torch.reshape(parts[1], [batch, seq, {heads}, head_dim]), 1, 2)\n    \
                 v = torch.transpose(torch.reshape(parts[2], [batch, seq, {heads}, head_dim]), 1, 2)\n    \
                 p = 0.0\n    \
                 if self.training:\n        p = {}\n    \
                 attended = torch.scaled_dot_product_attention(q, k, v, None, p, {})\n    \
                 merged = torch.reshape(torch.transpose(attended, 1, 2), [batch, seq, embed])\n    \
                 return self.out_proj.forward(merged)\n",
                opt("in_proj_bias"),
                float(c.dropout),
                boolean(c.causal)
            );
            ("MultiheadAttention", body)
        }
        Layer::Custom(c) if c.op == "kiln::bias_gelu" => (
            "BiasGelu",
            // kiln-fused-ops: gelu(x + bias), the exact (erf) GELU.
            ret("torch.gelu(torch.add(x, self.bias))".to_owned()),
        ),
        Layer::Custom(c) if c.op == "kiln::swish" => (
            "Swish",
            // kiln-fused-ops: x * sigmoid(beta * x).
            ret("torch.mul(x, torch.sigmoid(torch.mul(self.beta, x)))".to_owned()),
        ),
        other => {
            return Err(Error::unsupported(format!(
                "exporting a {} layer as TorchScript",
                other.kind()
            )))
        }
    })
}

/// Where the file goes, checked before anything is written.
struct Target {
    path: PathBuf,
    file_name: String,
    overwrite: bool,
}

impl Target {
    /// The path must name a file (valid UTF-8, for libtorch) in an existing
    /// directory, and be free unless `overwrite`; a directory is never replaced.
    fn check(path: &Path, overwrite: bool) -> Result<Self> {
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|_| path.to_str().is_some())
            .ok_or_else(|| {
                Error::invalid_argument(
                    "path",
                    format!(
                        "{} must name a file, in UTF-8 (libtorch takes the path as text)",
                        path.display()
                    ),
                )
            })?
            .to_owned();
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        match std::fs::metadata(&parent) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::io(
                    &parent,
                    std::io::Error::new(
                        std::io::ErrorKind::NotADirectory,
                        "the export's parent is not a directory",
                    ),
                ))
            }
            Err(e) => return Err(Error::io(&parent, e)),
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => Err(Error::io(
                path,
                std::io::Error::new(
                    std::io::ErrorKind::IsADirectory,
                    "is a directory; give the path of a .pt file",
                ),
            )),
            Ok(_) if !overwrite => Err(already_exists(path)),
            Ok(_) => Ok(Self {
                path: path.to_path_buf(),
                file_name,
                overwrite,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self {
                path: path.to_path_buf(),
                file_name,
                overwrite,
            }),
            Err(e) => Err(Error::io(path, e)),
        }
    }

    /// Calls `save` on a temporary path beside the target, under the target's
    /// own file name (a TorchScript archive's records are named after its
    /// file), then moves the file into place: with a rename when replacing is
    /// allowed, otherwise with a hard link, which fails rather than replace a
    /// file that appeared since the check. The temporary directory is removed
    /// either way.
    fn write(&self, save: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
        // Unique per process and call: two exports never share a temporary.
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let tmp_dir = self.path.with_file_name(format!(
            ".{}.export-{}-{}",
            self.file_name,
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&tmp_dir).map_err(|e| Error::io(&tmp_dir, e))?;
        let tmp = tmp_dir.join(&self.file_name);
        let result = save(&tmp).and_then(|()| {
            if self.overwrite {
                std::fs::rename(&tmp, &self.path).map_err(|e| Error::io(&self.path, e))
            } else {
                match std::fs::hard_link(&tmp, &self.path) {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        Err(already_exists(&self.path))
                    }
                    // A file system without hard links: the path was free at the check.
                    Err(_) => {
                        std::fs::rename(&tmp, &self.path).map_err(|e| Error::io(&self.path, e))
                    }
                }
            }
        });
        if let Err(e) = std::fs::remove_dir_all(&tmp_dir) {
            log::warn!("cannot remove the temporary {}: {e}", tmp_dir.display());
        }
        result
    }
}

/// The typed error for an existing target without `overwrite`.
fn already_exists(path: &Path) -> Error {
    Error::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "already exists; pass overwrite = true to replace it",
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::model::{CustomConfig, Init, LinearConfig};

    #[test]
    fn floats_read_back_as_python_floats() {
        assert_eq!(float(0.1), "0.1");
        assert_eq!(float(1e-5), "1e-5");
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(0.0), "0.0");
    }

    #[test]
    fn an_unknown_custom_op_is_named_with_its_path() {
        let spec = Layer::sequential([
            LinearConfig::new(3, 3).into(),
            Layer::residual(Layer::sequential([
                Layer::Relu,
                CustomConfig::new("user::thing")
                    .with_param("w", [3], Init::Ones)
                    .into(),
            ])),
        ]);
        let err = check_supported(&spec, "").unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("1.block.1 (Custom)"), "{text}");
        assert!(text.contains("`user::thing`"), "{text}");
    }

    #[test]
    fn a_fused_op_with_other_parameters_is_refused() {
        let spec =
            Layer::from(CustomConfig::new("kiln::swish").with_param("gamma", [1], Init::Ones));
        let err = check_supported(&spec, "").unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert!(err.to_string().contains("[\"beta\"]"), "{err}");
    }

    #[test]
    fn every_leaf_class_compiles_and_is_named_after_its_layer() {
        let mut graph = ExportGraph::new().unwrap();
        let node = graph.add_module("Linear", "0").unwrap();
        let weight = Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
        graph.add_tensor(node, "weight", &weight, false).unwrap();
        let (class, body) = leaf_forward(
            &LinearConfig::new(3, 2).with_bias(false).into(),
            &|n| n == "weight",
            false,
        )
        .unwrap();
        graph.define(node, &forward(&body), "0 (Linear)").unwrap();
        assert_eq!(class, "Linear");
        assert_eq!(graph.class_name(node).unwrap(), "__torch__.kiln.Linear");
        let again = graph.add_module("Linear", "1").unwrap();
        assert_ne!(graph.class_name(again).unwrap(), "__torch__.kiln.Linear");
        let err = graph
            .define(
                again,
                "def forward(self, x: Tensor) -> Tensor:\n    return torch.no_such_op(x)\n",
                "1 (Linear)",
            )
            .unwrap_err();
        assert!(err.to_string().contains("1 (Linear)"), "{err}");
    }
}
