//! LoRA on a [`TorchModel`]: adapters added to its linear layers (PEFT's
//! `get_peft_model`), the base weights frozen.

use std::collections::HashMap;

use kiln_core::{lora::LoraConfig, model::ParamKind, Error, Result};
use tch::Kind;

use crate::convert::kind_from_dtype;
use crate::device::device_to_tch;
use crate::error::torch_error;

use super::build::init_tensor;
use super::{build, has_sharded, Entry, TorchModel};

impl TorchModel {
    /// Adds LoRA adapters to the projections `lora` targets and freezes
    /// everything else, as `peft.get_peft_model` does: each targeted
    /// projection gains `{module}.lora_A.weight` (`[r, in]`, PEFT's
    /// initialisation) and `{module}.lora_B.weight` (`[out, r]`, zero), so
    /// the model computes what it did until the adapters train. Returns the
    /// adapters' parameter names. Call it before [`set_precision`](TorchModel::set_precision)
    /// and before building the optimizer, which then holds the adapters only.
    ///
    /// A target that matches no projection, a model that already has
    /// adapters, or one with TorchScript layers, is an error; the model is
    /// unchanged then.
    ///
    /// ```no_run
    /// use kiln_core::{lora::LoraConfig, model::{Layer, LinearConfig}, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let spec = Layer::sequential([LinearConfig::new(64, 64).into(), Layer::Relu,
    ///                               LinearConfig::new(64, 10).into()]);
    /// let mut model = TorchModel::new(&spec, Device::Cpu)?;
    /// let adapters = model.add_lora(&LoraConfig::new(8, 16.0).with_target_modules(["0"]))?;
    /// assert_eq!(adapters, ["0.lora_A.weight", "0.lora_B.weight"]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn add_lora(&mut self, lora: &LoraConfig) -> Result<Vec<String>> {
        if has_sharded(&self.root) {
            return Err(Error::invalid_argument(
                "lora",
                "the model is sharded: add the adapters before sharding it (the units are \
                 planned over the parameters there are)",
            ));
        }
        if let Some(existing) = &self.lora {
            return Err(Error::invalid_argument(
                "lora",
                format!(
                    "the model already has LoRA adapters (r = {}, on {:?})",
                    existing.r, existing.target_modules
                ),
            ));
        }
        if self.has_scripts() {
            return Err(Error::unsupported(
                "LoRA adapters on a model with torchscript layers: Kiln adapts its own \
                 linear, attention and MLP projections",
            ));
        }
        let specs = lora.parameter_specs(&self.spec)?;
        let target = device_to_tch(self.device)?;
        let kind = self
            .float_dtype
            .map(kind_from_dtype)
            .transpose()?
            .unwrap_or(Kind::Float);
        let mut added = Vec::with_capacity(specs.len());
        tch::no_grad(|| -> Result<()> {
            for spec in &specs {
                let tensor = init_tensor(spec, target)
                    .and_then(|t| t.f_to_kind(kind))
                    .and_then(|t| t.f_set_requires_grad(true))
                    .map_err(|e| torch_error(&format!("initialising {}", spec.name), e))?;
                added.push(Entry {
                    name: spec.name.clone(),
                    kind: ParamKind::Parameter,
                    tensor,
                });
            }
            Ok(())
        })?;
        let mut entries: Vec<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
        entries.extend(added.iter().map(|e| e.name.as_str()));
        let index: HashMap<&str, usize> =
            entries.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let root = build(
            &self.spec,
            "",
            &index,
            Some((lora.scale(), lora.dropout)),
            &mut HashMap::new(),
        )?;
        // Built: now the model changes, all at once.
        for entry in &mut self.entries {
            if entry.kind == ParamKind::Parameter && entry.tensor.requires_grad() {
                let _ = entry
                    .tensor
                    .f_set_requires_grad(false)
                    .map_err(|e| torch_error(&format!("freezing {}", entry.name), e))?;
            }
        }
        let names = added.iter().map(|e| e.name.clone()).collect();
        self.entries.extend(added);
        self.root = root;
        self.lora = Some(lora.clone());
        // The rebuilt tree's parts, checkpointed again.
        let patterns = std::mem::take(&mut self.checkpointed);
        if !patterns.is_empty() {
            let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
            self.checkpoint_activations(&patterns)?;
        }
        Ok(names)
    }

    /// The LoRA adapters added by [`add_lora`](TorchModel::add_lora), if any.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }
}
