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
//! their children as submodules named `"0"`, `"1"`, ... (`Sequential`,
//! `Parallel`) and `"block"` (`Residual`), which is what makes the state-dict names Kiln's.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use kiln_core::{
    export::{shown_path, ExportError, ExportFormat, ExportOptions, FileTarget},
    model::{GatedActivation, Layer, ParamKind, SparseMoeConfig},
    module::Module,
    Error,
};
use tch::Tensor;

use crate::custom_layer::torchscript_lowering;
use crate::layers::join;
use crate::layers::script::{script, ScriptLeaf, Scripted};
use crate::model::{lock_script, TorchModel};
use crate::script::export_bridge::{forward_mismatch, ExportGraph, NodeId};

/// The export's result.
type Result<T, E = ExportError> = std::result::Result<T, E>;

/// Writes `model` as a TorchScript file (its current weights, on CPU) that
/// Python's `torch.jit.load` runs, and [`ScriptModule::load`](crate::ScriptModule::load)
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
/// A [`Layer::Custom`] op exports through the TorchScript lowering its crate
/// registered ([`register_torchscript_lowering`](crate::register_torchscript_lowering):
/// kiln-fused-ops' `register_layers` writes `kiln::bias_gelu` and `kiln::swish`
/// as `gelu(x + bias)` and `x * sigmoid(beta * x)`), so Python needs no Kiln
/// library; a [`Layer::TorchScript`] layer becomes a copy of its TorchScript
/// module with its current weights. A model on CUDA is copied to the CPU for
/// saving; a bfloat16 model exports its bfloat16 weights; the precision set by
/// `TorchModel::set_precision` (autocast) is not part of the file.
///
/// Everything is checked before the first byte is written, and the file is
/// written atomically (a temporary directory beside `path`, then a rename):
///
/// - the options ([`ExportOptions::check`]; no input shape is needed, and one
///   given must fit the model, names and a fixed batch are refused);
/// - a custom op without a lowering (or a `Layer::SavedModel`, or a
///   TorchScript layer whose forward does not take one tensor and return
///   one) is [`ExportError::Unsupported`] naming the layer's path and op;
/// - a missing parent directory is [`ExportError::MissingParent`];
/// - an existing `path` is [`ExportError::Exists`] unless the options allow
///   overwriting, and the file is left as it was.
///
/// ```no_run
/// use kiln_core::{backend::Mode, export::ExportOptions, model::{Layer, LinearConfig}, module::Module, Device};
/// use kiln_torch::{export_torchscript, TorchModel};
///
/// let mut model = TorchModel::new(&Layer::sequential([
///     LinearConfig::new(4, 8).into(),
///     Layer::Relu,
///     LinearConfig::new(8, 2).into(),
/// ]), Device::Cpu)?;
/// model.set_mode(Mode::Eval);
/// export_torchscript(&model, "model.pt", &ExportOptions::default())?;
/// // Python: m = torch.jit.load("model.pt"); m.state_dict().keys() -> 0.weight, 0.bias, 2.weight, 2.bias
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn export_torchscript(
    model: &TorchModel,
    path: impl AsRef<Path>,
    options: &ExportOptions,
) -> Result<()> {
    let path = path.as_ref();
    options.check(ExportFormat::TorchScript)?;
    let target = FileTarget::check(path, options.overwrite)?;
    let spec = model.spec();
    if !options.input_shape.is_empty() {
        spec.output_shape(&options.input_shape).map_err(|e| {
            ExportError::invalid(
                "input shape",
                format!("{:?} does not fit the model: {e}", options.input_shape),
            )
        })?;
    }
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
    target.write(|tmp| Ok(exporter.graph.save(root, tmp, model.mode().is_train())?))?;
    log::info!("exported the model as TorchScript to {}", path.display());
    Ok(())
}

/// `2.block.0 (Linear)`, or `<root> (Linear)`.
fn describe(path: &str, layer: &Layer) -> String {
    format!("{} ({})", shown_path(path), layer.kind())
}

/// An [`ExportError::Unsupported`] for the layer at `path`.
fn unsupported(path: &str, layer: &Layer, reason: String) -> ExportError {
    ExportError::Unsupported {
        format: ExportFormat::TorchScript,
        path: shown_path(path),
        layer: match layer {
            Layer::Custom(c) => format!("Custom({})", c.op),
            other => other.kind().to_owned(),
        },
        reason,
    }
}

/// Fails on the first layer that cannot be exported, naming its path: a
/// SavedModel, a custom op without a lowering, or one whose lowering refuses
/// its configuration.
fn check_supported(layer: &Layer, path: &str) -> Result<()> {
    match layer {
        Layer::Sequential { layers } | Layer::Parallel { branches: layers } => layers
            .iter()
            .enumerate()
            .try_for_each(|(i, child)| check_supported(child, &join(path, &i.to_string()))),
        Layer::Residual { block } => check_supported(block, &join(path, "block")),
        Layer::Custom(config) => {
            let Some(lowering) = torchscript_lowering(&config.op) else {
                return Err(unsupported(
                    path,
                    layer,
                    format!(
                        "its op `{}` has no TorchScript lowering (Python cannot load a custom \
                         op library); register one with \
                         kiln_torch::register_torchscript_lowering (kiln-fused-ops' \
                         register_layers() registers Kiln's fused ops')",
                        config.op
                    ),
                ));
            };
            lowering(config).map(drop).map_err(|e| {
                unsupported(
                    path,
                    layer,
                    format!("its lowering refuses the layer: {}", e.display_chain()),
                )
            })
        }
        Layer::SavedModel(config) => Err(unsupported(
            path,
            layer,
            format!(
                "a SavedModel ({}) runs on TensorFlow",
                config.path.display()
            ),
        )),
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
                    let _ = writeln!(
                        body,
                        "    x = getattr(self, \"{name}\").forward({})",
                        arguments(child)
                    );
                }
                body.push_str("    return x\n");
                self.graph.define(node, &forward_of(layer, &body), &what)?;
                Ok(node)
            }
            Layer::Parallel { branches } => {
                let node = self.graph.add_module("Parallel", path)?;
                let mut terms = Vec::new();
                for (i, child) in branches.iter().enumerate() {
                    let name = i.to_string();
                    let child_node = self.emit(child, &join(path, &name))?;
                    self.graph.add_child(node, &name, child_node)?;
                    terms.push(format!(
                        "getattr(self, \"{name}\").forward({})",
                        arguments(child)
                    ));
                }
                let mut body = String::new();
                for (i, term) in terms.iter().enumerate() {
                    if i == 0 {
                        let _ = writeln!(body, "    y = {term}");
                    } else {
                        let _ = writeln!(body, "    y = torch.add(y, {term})");
                    }
                }
                body.push_str("    return y\n");
                self.graph.define(node, &forward_of(layer, &body), &what)?;
                Ok(node)
            }
            Layer::Residual { block } => {
                let node = self.graph.add_module("Residual", path)?;
                let child = self.emit(block, &join(path, "block"))?;
                self.graph.add_child(node, "block", child)?;
                let body = format!(
                    "    return torch.add(x, self.block.forward({}))\n",
                    arguments(block)
                );
                self.graph.define(node, &forward_of(layer, &body), &what)?;
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
                    return Err(unsupported(
                        path,
                        layer,
                        format!(
                            "its module ({}) has the forward `{schema}`; a layer of an \
                             exported model takes one tensor and returns one",
                            config.path.display()
                        ),
                    ));
                }
                Ok(self.graph.add_script_module(module.c_module(), path)?)
            }
            Layer::SparseMoe(c) => self.emit_moe(c, path, &what),
            leaf => self.emit_leaf(leaf, path, &what),
        }
    }

    /// A `Linear` module at `path` with its `weight` (and `bias` when the
    /// model has one).
    fn emit_linear(&mut self, path: &str) -> Result<NodeId> {
        let node = self.graph.add_module("Linear", path)?;
        let mut bias = "None";
        for (name, required) in [("weight", true), ("bias", false)] {
            let key = join(path, name);
            match self.tensors.get(&key) {
                Some((tensor, kind)) => {
                    self.graph
                        .add_tensor(node, name, tensor, *kind == ParamKind::Buffer)?;
                    if name == "bias" {
                        bias = "self.bias";
                    }
                }
                None if required => {
                    return Err(Error::MissingKey {
                        key,
                        available: self.tensors.len(),
                    }
                    .into())
                }
                None => {}
            }
        }
        self.graph.define(
            node,
            &forward(&format!(
                "    return torch.linear(x, self.weight, {bias})\n"
            )),
            &format!("{path} (Linear)"),
        )?;
        Ok(node)
    }

    /// An expert's gated MLP at `path`: `gate_proj`, `up_proj`, `down_proj`.
    fn emit_expert(&mut self, path: &str, activation: GatedActivation) -> Result<NodeId> {
        let node = self.graph.add_module("Expert", path)?;
        for name in ["gate_proj", "up_proj", "down_proj"] {
            let child = self.emit_linear(&join(path, name))?;
            self.graph.add_child(node, name, child)?;
        }
        let act = match activation {
            GatedActivation::Silu => "torch.silu(g)",
            GatedActivation::Gelu => "torch.gelu(g)",
            GatedActivation::GeluTanh => "torch.gelu(g, approximate=\"tanh\")",
        };
        let body = format!(
            "    g = self.gate_proj.forward(x)\n    \
             return self.down_proj.forward({act} * self.up_proj.forward(x))\n"
        );
        self.graph
            .define(node, &forward(&body), &format!("{path} (Expert)"))?;
        Ok(node)
    }

    /// A mixture of experts as `SparseMoe`'s libtorch node computes it: the
    /// router's top-k in float32 (renormalised when the config says so), the
    /// assignments sorted by expert, each expert on its tokens, one
    /// `index_add` of their weighted outputs, and the shared expert gated.
    fn emit_moe(&mut self, c: &SparseMoeConfig, path: &str, what: &str) -> Result<NodeId> {
        let node = self.graph.add_module("SparseMoe", path)?;
        let gate = self.emit_linear(&join(path, "gate"))?;
        self.graph.add_child(node, "gate", gate)?;
        let experts_path = join(path, "experts");
        let experts = self.graph.add_module("Experts", &experts_path)?;
        let mut calls = String::new();
        for j in 0..c.num_experts {
            let expert = self.emit_expert(&join(&experts_path, &j.to_string()), c.activation)?;
            self.graph.add_child(experts, &j.to_string(), expert)?;
            let _ = write!(
                calls,
                "    n = counts[{j}]\n    if n > 0:\n        \
                 y = getattr(self.experts, \"{j}\").forward(torch.narrow(inputs, 0, start, n))\n        \
                 outs.append(y * torch.narrow(scales, 0, start, n))\n        \
                 start += n\n"
            );
        }
        self.graph.define(
            experts,
            &forward("    return x\n"),
            &format!("{experts_path} (Experts)"),
        )?;
        self.graph.add_child(node, "experts", experts)?;
        let (shared, gated) = match c.shared_expert_dim {
            Some(_) => {
                let expert = self.emit_expert(&join(path, "shared_expert"), c.activation)?;
                self.graph.add_child(node, "shared_expert", expert)?;
                let gate = self.emit_linear(&join(path, "shared_expert_gate"))?;
                self.graph.add_child(node, "shared_expert_gate", gate)?;
                (
                    "    shared = self.shared_expert.forward(t)\n",
                    "    out = out + torch.sigmoid(self.shared_expert_gate.forward(t)) * shared\n",
                )
            }
            None => ("", ""),
        };
        let renormalise = if c.norm_topk_prob {
            "    w = w / torch.sum(w, -1, True)\n"
        } else {
            ""
        };
        let body = format!(
            "    size = x.size()\n    \
             t = torch.reshape(x, [-1, size[-1]])\n\
             {shared}    \
             logits = self.gate.forward(t)\n    \
             probs = torch.softmax(logits.float(), -1)\n    \
             w, chosen = torch.topk(probs, {k}, -1, True, True)\n\
             {renormalise}    \
             w = w.to(logits.dtype)\n    \
             flat = torch.reshape(chosen, [-1])\n    \
             order = torch.sort(flat, stable=True)[1]\n    \
             counts: List[int] = torch.bincount(flat, None, {e}).tolist()\n    \
             rows = torch.div(order, {k}, rounding_mode=\"floor\")\n    \
             inputs = torch.index_select(t, 0, rows)\n    \
             scales = torch.unsqueeze(torch.index_select(torch.reshape(w, [-1]), 0, order), 1)\n    \
             outs: List[Tensor] = []\n    \
             start = 0\n\
             {calls}    \
             out = torch.zeros_like(t)\n    \
             if len(outs) > 0:\n        \
             out = torch.index_add(out, 0, rows, torch.cat(outs, 0).to(out.dtype))\n\
             {gated}    \
             return torch.reshape(out, size)\n",
            k = c.top_k,
            e = c.num_experts,
        );
        self.graph.define(node, &forward(&body), what)?;
        Ok(node)
    }

    /// A layer without children: its tensors under their local names (a
    /// dotted name, such as the attention's `out_proj.weight` or `q_proj.bias`,
    /// in a submodule of that name), and its forward. A [`Layer::TiedLinear`]
    /// holds the tensor it shares as its `weight` (the one storage, twice).
    fn emit_leaf(&mut self, layer: &Layer, path: &str, what: &str) -> Result<NodeId> {
        let specs = layer.parameter_specs(path)?;
        let mut own = Vec::new();
        let mut submodules: Vec<(String, Vec<LocalTensor<'_>>)> = Vec::new();
        if let Layer::TiedLinear(c) = layer {
            let (tensor, kind) = self
                .tensors
                .get(&c.weight)
                .ok_or_else(|| Error::MissingKey {
                    key: c.weight.clone(),
                    available: self.tensors.len(),
                })?;
            own.push(("weight".to_owned(), tensor, *kind));
        }
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
            match local.split_once('.') {
                Some((child, name)) => {
                    let entry = (name.to_owned(), tensor, *kind);
                    match submodules.iter_mut().find(|(c, _)| c == child) {
                        Some((_, tensors)) => tensors.push(entry),
                        None => submodules.push((child.to_owned(), vec![entry])),
                    }
                }
                None => own.push((local.to_owned(), tensor, *kind)),
            }
        }
        let has = |name: &str| own.iter().any(|(n, _, _)| n == name);
        let leaf = ScriptLeaf {
            has: &has,
            pinned: self.pinned.contains(path),
        };
        let Some(Scripted {
            class,
            body,
            children,
        }) = script(layer, &leaf)?
        else {
            return Err(unsupported(
                path,
                layer,
                "no layer family writes it in TorchScript".to_owned(),
            ));
        };
        let node = self.graph.add_module(&class, path)?;
        for (name, tensor, kind) in &own {
            self.graph
                .add_tensor(node, name, tensor, *kind == ParamKind::Buffer)?;
        }
        for (name, tensors) in &submodules {
            // A projection (nn.MultiheadAttention's out_proj, q_proj, ...) is a
            // Linear submodule unless the family wrote the child's forward.
            let written = children.iter().find(|c| &c.name == name);
            let (class, body) = match written {
                Some(c) => (c.class.clone(), c.body.clone()),
                None => {
                    let bias = if tensors.iter().any(|(n, _, _)| n == "bias") {
                        "self.bias"
                    } else {
                        "None"
                    };
                    (
                        "Linear".to_owned(),
                        format!("    return torch.linear(x, self.weight, {bias})\n"),
                    )
                }
            };
            let child_path = join(path, name);
            let child = self.graph.add_module(&class, &child_path)?;
            for (local, tensor, kind) in tensors {
                self.graph
                    .add_tensor(child, local, tensor, *kind == ParamKind::Buffer)?;
            }
            self.graph
                .define(child, &forward(&body), &format!("{child_path} ({class})"))?;
            self.graph.add_child(node, name, child)?;
        }
        self.graph.define(node, &forward_of(layer, &body), what)?;
        Ok(node)
    }
}

/// Whether `layer` reads a padded batch's attention mask (a `SelfAttention`,
/// a `Select` counting back from each row's last token), or holds a layer
/// that does: its module's `forward` then takes the mask as well.
fn reads_mask(layer: &Layer) -> bool {
    match layer {
        Layer::Sequential { layers } | Layer::Parallel { branches: layers } => {
            layers.iter().any(reads_mask)
        }
        Layer::Residual { block } => reads_mask(block),
        Layer::SelfAttention(_) => true,
        Layer::Select { dim: 1, index } => *index < 0,
        _ => false,
    }
}

/// The arguments a container passes to `child`'s `forward`.
fn arguments(child: &Layer) -> &'static str {
    if reads_mask(child) {
        "x, attention_mask"
    } else {
        "x"
    }
}

/// The `forward` of `layer` with `body`: of one tensor, or of the tensor and
/// an optional attention mask (`[batch, seq]`, nonzero on the tokens) for a
/// layer that [reads one](reads_mask), as `transformers`' models take
/// `attention_mask`.
fn forward_of(layer: &Layer, body: &str) -> String {
    if reads_mask(layer) {
        format!(
            "def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:\n{body}"
        )
    } else {
        forward(body)
    }
}

/// A tensor of a leaf under its local name, with its kind.
type LocalTensor<'a> = (String, &'a Tensor, ParamKind);

/// A `forward` of one tensor with `body` (indented four spaces).
fn forward(body: &str) -> String {
    format!("def forward(self, x: Tensor) -> Tensor:\n{body}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::model::{CustomConfig, Init, LinearConfig};

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
        assert!(matches!(err, ExportError::Unsupported { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with("1.block.1 (Custom(user::thing))"),
            "{text}"
        );
        assert!(text.contains("`user::thing`"), "{text}");
        assert!(
            text.contains("kiln_torch::register_torchscript_lowering"),
            "{text}"
        );
    }

    #[test]
    fn a_lowering_that_refuses_its_layer_refuses_the_export() {
        crate::register_torchscript_lowering("test::picky", |config| {
            if config.params.len() != 1 {
                return Err(Error::invalid_argument(
                    "test::picky.params",
                    "expected one parameter",
                ));
            }
            Ok(crate::TorchScriptLowering {
                class: "Picky".to_owned(),
                forward: "return torch.mul(x, self.w)".to_owned(),
            })
        });
        let good = Layer::from(CustomConfig::new("test::picky").with_param("w", [1], Init::Ones));
        check_supported(&good, "").unwrap();
        let bad = Layer::from(CustomConfig::new("test::picky"));
        let err = check_supported(&bad, "").unwrap_err();
        assert!(matches!(err, ExportError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("expected one parameter"), "{err}");
    }

    #[test]
    fn every_leaf_class_compiles_and_is_named_after_its_layer() {
        let mut graph = ExportGraph::new().unwrap();
        let node = graph.add_module("Linear", "0").unwrap();
        let weight = Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu));
        graph.add_tensor(node, "weight", &weight, false).unwrap();
        let has = |n: &str| n == "weight";
        let leaf = ScriptLeaf {
            has: &has,
            pinned: false,
        };
        let scripted = script(&LinearConfig::new(3, 2).with_bias(false).into(), &leaf)
            .unwrap()
            .unwrap();
        graph
            .define(node, &forward(&scripted.body), "0 (Linear)")
            .unwrap();
        assert_eq!(scripted.class, "Linear");
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
