//! The bridge to the C++ that builds an exported TorchScript module tree
//! (include/script_export.h, src/script/export.cc), behind [`ExportGraph`].

use std::path::Path;

use kiln_core::{Error, Result};
use tch::{CModule, Tensor};

use super::bridge::jit_module;
use crate::cxx_tensor::as_at;

#[allow(unsafe_code)]
#[cxx::bridge(namespace = "kiln::script")]
mod ffi {
    // SAFETY: the declarations match include/script_export.h exactly (cxx checks
    // the signatures at compile time), and every function returns `Result`, so a
    // C++ exception (a TorchScript compile error, an unknown module index, an
    // unwritable file) comes back as an error instead of unwinding into Rust.
    unsafe extern "C++" {
        include!("kiln-torch/include/script_export.h");

        #[namespace = "at"]
        type Tensor = crate::cxx_tensor::AtTensor;
        #[namespace = "torch::jit"]
        type Module = super::super::bridge::JitModule;

        type ExportBuilder;

        fn forward_mismatch(module: &Module) -> Result<String>;
        fn new_export_builder() -> Result<UniquePtr<ExportBuilder>>;
        fn add_module(self: Pin<&mut ExportBuilder>, class_name: &str) -> Result<usize>;
        fn add_script_module(self: Pin<&mut ExportBuilder>, module: &Module) -> Result<usize>;
        fn add_tensor(
            self: Pin<&mut ExportBuilder>,
            node: usize,
            name: &str,
            tensor: &Tensor,
            is_buffer: bool,
            requires_grad: bool,
        ) -> Result<()>;
        fn add_child(
            self: Pin<&mut ExportBuilder>,
            parent: usize,
            name: &str,
            child: usize,
        ) -> Result<()>;
        fn define(self: Pin<&mut ExportBuilder>, node: usize, source: &str) -> Result<()>;
        fn class_name(self: &ExportBuilder, node: usize) -> Result<String>;
        fn save(
            self: Pin<&mut ExportBuilder>,
            root: usize,
            path: &str,
            training: bool,
        ) -> Result<()>;
    }
}

/// `None` when `module`'s forward takes one tensor and returns one (what a
/// layer of an exported model calls); otherwise its schema, for the error.
pub(crate) fn forward_mismatch(module: &CModule) -> Result<Option<String>> {
    let text = ffi::forward_mismatch(jit_module(module))
        .map_err(|e| bridge_error("reading a TorchScript forward's schema", e))?;
    Ok((!text.is_empty()).then_some(text))
}

/// One module of an [`ExportGraph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NodeId(usize);

/// A TorchScript module tree being built in one compilation unit; nothing
/// touches the disk until [`save`](Self::save).
pub(crate) struct ExportGraph {
    builder: cxx::UniquePtr<ffi::ExportBuilder>,
}

fn bridge_error(what: &str, error: cxx::Exception) -> Error {
    Error::backend_with_source("torch", what, error)
}

impl ExportGraph {
    /// An empty graph.
    pub(crate) fn new() -> Result<Self> {
        let builder = ffi::new_export_builder()
            .map_err(|e| bridge_error("creating a TorchScript compilation unit", e))?;
        if builder.is_null() {
            return Err(Error::backend(
                "torch",
                "creating a TorchScript compilation unit",
                "the C++ builder is null",
            ));
        }
        Ok(Self { builder })
    }

    fn pinned(&mut self) -> std::pin::Pin<&mut ffi::ExportBuilder> {
        // Not null: checked in `new`, and never replaced.
        self.builder.pin_mut()
    }

    /// A new empty module of class `__torch__.kiln.<class>` for the layer at `path`.
    pub(crate) fn add_module(&mut self, class: &str, path: &str) -> Result<NodeId> {
        self.pinned()
            .add_module(class)
            .map(NodeId)
            .map_err(|e| bridge_error(&format!("creating the module of {path} ({class})"), e))
    }

    /// A CPU copy of a loaded TorchScript module, with its current weights.
    pub(crate) fn add_script_module(&mut self, module: &CModule, path: &str) -> Result<NodeId> {
        self.pinned()
            .add_script_module(jit_module(module))
            .map(NodeId)
            .map_err(|e| bridge_error(&format!("copying the torchscript layer {path}"), e))
    }

    /// Registers a CPU copy of `tensor` as parameter or buffer `name` of `node`.
    pub(crate) fn add_tensor(
        &mut self,
        node: NodeId,
        name: &str,
        tensor: &Tensor,
        is_buffer: bool,
    ) -> Result<()> {
        let requires_grad = !is_buffer && tensor.requires_grad();
        self.pinned()
            .add_tensor(node.0, name, as_at(tensor), is_buffer, requires_grad)
            .map_err(|e| bridge_error(&format!("registering {name}"), e))
    }

    /// Registers `child` as submodule `name` of `parent`.
    pub(crate) fn add_child(&mut self, parent: NodeId, name: &str, child: NodeId) -> Result<()> {
        self.pinned()
            .add_child(parent.0, name, child.0)
            .map_err(|e| bridge_error(&format!("registering submodule {name}"), e))
    }

    /// Compiles `source` as the methods of `node`'s class; `what` names the
    /// layer in the error (`2.block.0 (Linear)`).
    pub(crate) fn define(&mut self, node: NodeId, source: &str, what: &str) -> Result<()> {
        self.pinned()
            .define(node.0, source)
            .map_err(|e| bridge_error(&format!("compiling the forward of {what}"), e))
    }

    /// The qualified TorchScript class name of `node`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn class_name(&self, node: NodeId) -> Result<String> {
        self.builder
            .class_name(node.0)
            .map_err(|e| bridge_error("reading a class name", e))
    }

    /// Sets `root`'s training flag (and its submodules') and saves it at `path`.
    pub(crate) fn save(&mut self, root: NodeId, path: &Path, training: bool) -> Result<()> {
        let text = path.to_str().ok_or_else(|| {
            Error::invalid_argument(
                "path",
                format!(
                    "{} is not valid UTF-8, which libtorch needs",
                    path.display()
                ),
            )
        })?;
        self.pinned()
            .save(root.0, text, training)
            .map_err(|e| bridge_error(&format!("saving TorchScript to {}", path.display()), e))
    }
}
