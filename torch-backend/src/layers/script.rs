//! The TorchScript each layer family writes for
//! [`export_torchscript`](crate::export_torchscript): a leaf layer's module
//! class and the body of its `forward`, calling the aten ops the family's
//! node calls, with the same arguments. Each family's `script` sits beside
//! its `build`, so adding a layer to a family touches only that family's file.

use kiln_core::{model::Layer, Result};

/// What a family's `script` sees of the leaf it writes.
pub(crate) struct ScriptLeaf<'a> {
    /// Whether the layer has the tensor `name` (an optional bias, running
    /// statistics).
    pub(crate) has: &'a dyn Fn(&str) -> bool,
    /// Whether the layer keeps its eval behaviour while the model trains (a
    /// frozen batch norm, [`Freeze::keep_frozen_batch_norm_in_eval`](crate::Freeze::keep_frozen_batch_norm_in_eval)),
    /// which the exported forward then keeps too, whatever its `training` flag.
    pub(crate) pinned: bool,
}

impl ScriptLeaf<'_> {
    /// `self.name` when the layer has the tensor `name`, else `None`.
    pub(crate) fn opt(&self, name: &str) -> String {
        if (self.has)(name) {
            format!("self.{name}")
        } else {
            "None".to_owned()
        }
    }
}

/// A leaf layer in TorchScript: its module's class name and its `forward`'s
/// body (statements indented four spaces, ending in a `return`), and the
/// forwards of the submodules its dotted tensors go into (`q_norm.weight`)
/// other than linear projections, which the exporter writes itself.
#[derive(Debug)]
pub(crate) struct Scripted {
    pub(crate) class: String,
    pub(crate) body: String,
    pub(crate) children: Vec<ScriptChild>,
}

/// A submodule of a [`Scripted`] leaf: its attribute name, class and `forward` body.
#[derive(Debug)]
pub(crate) struct ScriptChild {
    pub(crate) name: String,
    pub(crate) class: String,
    pub(crate) body: String,
}

impl Scripted {
    /// A class whose `forward` returns `expr`.
    pub(crate) fn returning(class: &str, expr: String) -> Self {
        Scripted {
            class: class.to_owned(),
            body: ret(expr),
            children: Vec::new(),
        }
    }
}

/// `    return expr` and a newline.
pub(crate) fn ret(expr: String) -> String {
    format!("    return {expr}\n")
}

/// A float as a TorchScript literal that reads back as the same `f64`.
pub(crate) fn float(v: f64) -> String {
    // Rust's `Debug` is the shortest text that round-trips, always with a `.`
    // or an exponent (`0.1`, `1e-5`, `1.0`), which Python's grammar reads as a float.
    format!("{v:?}")
}

/// `[a, b]` for TorchScript.
pub(crate) fn ints(values: &[usize]) -> String {
    let items: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    format!("[{}]", items.join(", "))
}

/// `True` / `False`.
pub(crate) fn boolean(v: bool) -> &'static str {
    if v {
        "True"
    } else {
        "False"
    }
}

/// Writes one family's layer, or `None` when the layer belongs to another family.
type Script = fn(&Layer, &ScriptLeaf<'_>) -> Result<Option<Scripted>>;

/// Every family's [`Script`].
const FAMILIES: [Script; 11] = [
    super::linear::script,
    super::conv::script,
    super::pool::script,
    super::norm::script,
    super::dropout::script,
    super::embedding::script,
    super::structure::script,
    super::activation::script,
    super::attention::script,
    super::custom::script,
    super::transformer_script::script,
];

/// The class and forward of `layer`, a layer without children; `None` for a
/// layer no family writes (which the exporter refuses, naming it).
pub(crate) fn script(layer: &Layer, leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    for script in FAMILIES {
        if let Some(scripted) = script(layer, leaf)? {
            return Ok(Some(scripted));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_back_as_python_floats() {
        assert_eq!(float(0.1), "0.1");
        assert_eq!(float(1e-5), "1e-5");
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(0.0), "0.0");
    }
}
