//! LoRA adapters in PEFT's format: a directory with `adapter_config.json` and
//! `adapter_model.safetensors`, whose tensors are named after the base
//! model's modules (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`),
//! which `peft.PeftModel.from_pretrained(base, dir)` loads.

use std::path::Path;

use kiln_core::lora::{LoraConfig, LORA_A, LORA_B};
use kiln_core::state_dict::StateDict;
use kiln_core::HostTensor;
use serde_json::{json, Value};

use crate::error::{HfError, Result};
use crate::peft_fused::{self, Pair, Part};
use crate::peft_targets::PeftTargets;
use crate::{write_new, Pretrained};

/// The adapter's settings, as PEFT names the file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's tensors, as PEFT names the file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The prefix PEFT's saved tensor names carry.
const PREFIX: &str = "base_model.model.";

impl Pretrained {
    /// The checkpoint module (`model.layers.0.self_attn.q_proj`) of the Kiln
    /// projection `module` (`1.0.block.1.q_proj`), when the checkpoint stores
    /// its weight as one tensor.
    fn hf_module(&self, module: &str) -> Option<&str> {
        let weight = format!("{module}.weight");
        self.names
            .mappings
            .iter()
            .find(|m| m.kiln.len() == 1 && m.kiln[0] == weight)
            .and_then(|m| m.hf.strip_suffix(".weight"))
    }

    /// The fused checkpoint module (`model.layers.0.self_attn.qkv_proj`)
    /// holding the Kiln projection `module` with others, and its parts in
    /// row order.
    fn fused_of(&self, module: &str) -> Option<(String, Vec<Part>)> {
        let weight = format!("{module}.weight");
        let mapping = self
            .names
            .mappings
            .iter()
            .find(|m| m.kiln.len() > 1 && m.kiln.contains(&weight))?;
        let specs = self.layer.parameter_specs("").ok()?;
        let parts = mapping
            .kiln
            .iter()
            .map(|k| {
                let rows = specs
                    .iter()
                    .find(|s| &s.name == k)?
                    .shape
                    .first()
                    .copied()?;
                Some(Part {
                    module: k.strip_suffix(".weight")?.to_owned(),
                    rows,
                })
            })
            .collect::<Option<Vec<Part>>>()?;
        Some((mapping.hf.strip_suffix(".weight")?.to_owned(), parts))
    }

    /// `lora_B` of the checkpoint module `hf` with its rows in Kiln's order
    /// (`to_kiln`) or the checkpoint's, where the checkpoint orders the
    /// module's rows otherwise ([`crate::RowOrder`]: GPT-NeoX's
    /// `query_key_value`, Cohere's `q_proj` and `k_proj`).
    fn rows_of(&self, hf: &str, b: &HostTensor, to_kiln: bool) -> Result<HostTensor, String> {
        let Some(mapping) = self.names.find(&format!("{hf}.weight")) else {
            return Ok(b.clone());
        };
        if mapping.rows == crate::RowOrder::Concatenated {
            return Ok(b.clone());
        }
        let first = mapping
            .kiln
            .first()
            .map_or("", |k| k.strip_suffix(".weight").unwrap_or(k));
        let parts = match self.fused_of(first) {
            Some((_, parts)) => parts.iter().map(|p| p.rows).collect(),
            None => vec![b.dims().first().copied().unwrap_or(0)],
        };
        crate::names::reorder_tensor(&mapping.rows, &parts, b, to_kiln)
    }

    /// The checkpoint module PEFT adapts for the Kiln projection `module`:
    /// its own, or the fused one holding it.
    fn peft_module(&self, module: &str) -> Option<String> {
        self.hf_module(module)
            .map(str::to_owned)
            .or_else(|| self.fused_of(module).map(|(hf, _)| hf))
    }

    /// Checks, before any training, that adapters on the Kiln projections
    /// `modules` (`3.0.block.1.q_proj`, as [`LoraConfig::targets`] finds them)
    /// can be saved in PEFT's format for this checkpoint: each must be a
    /// checkpoint module of its own or a part of a fused one (GPT-2's
    /// `c_attn`, Phi-3's `qkv_proj`), whose adapter then holds its parts'.
    pub fn check_adapter_modules<'m>(
        &self,
        modules: impl IntoIterator<Item = &'m str>,
    ) -> Result<()> {
        let Some(first) = modules.into_iter().find(|m| self.peft_module(m).is_none()) else {
            return Ok(());
        };
        Err(HfError::Adapter {
            path: self.dir.clone(),
            reason: format!(
                "the LoRA target `{first}` cannot be saved as a PEFT adapter: the {} \
                 checkpoint has no module for it",
                self.family,
            ),
        })
    }

    /// The `target_modules` PEFT needs to adapt exactly the checkpoint
    /// modules `adapted`: their last names (`q_proj`) when every module of
    /// those names is adapted, as PEFT writes them, else the full names.
    fn target_modules_of(&self, adapted: &[String]) -> Result<Vec<String>> {
        let leaf = |m: &str| m.rsplit('.').next().unwrap_or(m).to_owned();
        let mut leaves: Vec<String> = adapted.iter().map(|m| leaf(m)).collect();
        leaves.sort();
        leaves.dedup();
        let mut complete = true;
        for projection in kiln_core::lora::projections(&self.layer)? {
            if let Some(hf) = self.peft_module(&projection.module) {
                if leaves.contains(&leaf(&hf)) && !adapted.contains(&hf) {
                    complete = false;
                }
            }
        }
        if complete {
            return Ok(leaves);
        }
        let mut full = adapted.to_vec();
        full.sort();
        Ok(full)
    }

    /// Writes the LoRA adapters in `weights` (Kiln's names, as
    /// [`LoraConfig::adapter_weights`] finds them) to the new directory `dir`
    /// in PEFT's format, `lora`'s settings in `adapter_config.json`:
    /// `PeftModel.from_pretrained(base, dir)` on this checkpoint's model then
    /// computes what Kiln's adapted model does. The base weights are not
    /// written. A file already in `dir` is never replaced.
    ///
    /// ```no_run
    /// use kiln_core::lora::LoraConfig;
    /// use kiln_hf::Pretrained;
    /// # fn trained() -> kiln_core::state_dict::StateDict { unimplemented!() }
    ///
    /// let base = Pretrained::open("models/tiny-llama")?;
    /// let lora = LoraConfig::new(8, 16.0);
    /// base.save_adapter(&lora, &trained(), "runs/adapter")?;
    /// # Ok::<(), kiln_hf::HfError>(())
    /// ```
    pub fn save_adapter(
        &self,
        lora: &LoraConfig,
        weights: &StateDict,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        let dir = dir.as_ref();
        let adapters = LoraConfig::adapter_weights(weights);
        let fail = |reason: String| HfError::Adapter {
            path: dir.to_owned(),
            reason,
        };
        if adapters.is_empty() {
            return Err(fail(
                "the weights hold no LoRA adapter (no `*.lora_A.weight` tensor)".into(),
            ));
        }
        if self.head_replaced {
            return Err(fail(
                "the model has a new head, which an adapter file does not hold: save Kiln's \
                 checkpoint instead"
                    .into(),
            ));
        }
        let mut out = StateDict::new();
        let mut adapted: Vec<String> = Vec::new();
        let mut fused: Vec<(String, Vec<Part>)> = Vec::new();
        for (name, tensor) in adapters.iter() {
            let (module, suffix) = match name.strip_suffix(&format!(".{LORA_A}")) {
                Some(m) => (m, LORA_A),
                None => (
                    name.strip_suffix(&format!(".{LORA_B}")).unwrap_or(name),
                    LORA_B,
                ),
            };
            if let Some(hf) = self.hf_module(module) {
                if !adapted.iter().any(|a| a == hf) {
                    adapted.push(hf.to_owned());
                }
                let tensor = if suffix == LORA_B {
                    self.rows_of(hf, tensor, false)
                        .map_err(|e| fail(format!("`{name}`: {e}")))?
                } else {
                    tensor.clone()
                };
                out.insert(format!("{PREFIX}{hf}.{suffix}"), tensor);
                continue;
            }
            let (hf, parts) = self.fused_of(module).ok_or_else(|| {
                fail(format!(
                    "`{name}`: the {} checkpoint has no module `{module}`",
                    self.family
                ))
            })?;
            if !fused.iter().any(|(h, _)| *h == hf) {
                fused.push((hf, parts));
            }
        }
        // A fused module's adapter holds its parts' as blocks, with the rank
        // and alpha that keep each part's scale.
        let (mut rank_pattern, mut alpha_pattern) =
            (serde_json::Map::new(), serde_json::Map::new());
        for (hf, parts) in &fused {
            let pairs: Vec<Option<Pair>> = parts
                .iter()
                .map(|p| {
                    let get = |suffix: &str| adapters.get(&format!("{}.{suffix}", p.module));
                    match (get(LORA_A), get(LORA_B)) {
                        (Some(a), Some(b)) => Some((a.clone(), b.clone())),
                        _ => None,
                    }
                })
                .collect();
            let blocks: Vec<(usize, Option<&Pair>)> = parts
                .iter()
                .zip(&pairs)
                .map(|(p, pair)| (p.rows, pair.as_ref()))
                .collect();
            let (a, b) = peft_fused::fuse(&blocks).map_err(|e| fail(format!("`{hf}`: {e}")))?;
            let b = self
                .rows_of(hf, &b, false)
                .map_err(|e| fail(format!("`{hf}`: {e}")))?;
            out.insert(format!("{PREFIX}{hf}.{LORA_A}"), a);
            out.insert(format!("{PREFIX}{hf}.{LORA_B}"), b);
            adapted.push(hf.clone());
            let n = parts.len() as f64;
            rank_pattern.insert(hf.clone(), json!(lora.r * parts.len()));
            let alpha = if lora.use_rslora {
                lora.alpha * n.sqrt()
            } else {
                lora.alpha * n
            };
            alpha_pattern.insert(hf.clone(), json!(alpha));
        }
        let targets = self.target_modules_of(&adapted)?;
        for file in [ADAPTER_CONFIG, ADAPTER_WEIGHTS] {
            if dir.join(file).exists() {
                return Err(fail(format!(
                    "{file} exists; Kiln never replaces a file it did not write (choose a new \
                     directory)"
                )));
            }
        }
        let alpha = if lora.alpha.fract() == 0.0 {
            json!(lora.alpha as i64)
        } else {
            json!(lora.alpha)
        };
        let config = json!({
            "alpha_pattern": alpha_pattern,
            "auto_mapping": null,
            "base_model_name_or_path": self.dir.display().to_string(),
            "bias": "none",
            "fan_in_fan_out": self.family.fan_in_fan_out,
            "inference_mode": true,
            "init_lora_weights": true,
            "layers_pattern": null,
            "layers_to_transform": null,
            "lora_alpha": alpha,
            "lora_dropout": lora.dropout,
            "modules_to_save": null,
            "peft_type": "LORA",
            "r": lora.r,
            "rank_pattern": rank_pattern,
            "revision": null,
            "target_modules": targets,
            "task_type": if self.is_decoder() { json!("CAUSAL_LM") } else { Value::Null },
            "use_dora": false,
            "use_rslora": lora.use_rslora,
        });
        std::fs::create_dir_all(dir).map_err(|e| kiln_core::Error::io(dir, e))?;
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| fail(format!("writing {ADAPTER_CONFIG}: {e}")))?;
        let metadata = std::collections::BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
        out.save_safetensors(dir.join(ADAPTER_WEIGHTS), &metadata)?;
        write_new(&dir.join(ADAPTER_CONFIG), text.as_bytes())?;
        log::info!(
            "saved {} LoRA tensors for the {} model to {}",
            out.len(),
            self.family,
            dir.display()
        );
        Ok(())
    }

    /// Reads a PEFT LoRA adapter directory made for this checkpoint's model:
    /// its settings, with `target_modules` the Kiln projections the file
    /// adapts (so [`LoraConfig::targets`] finds exactly those), and its tensors
    /// under Kiln's names, in float32.
    ///
    /// An adapter for another base model (a module this model lacks, or
    /// tensors of other shapes), another PEFT method (`peft_type` other than
    /// `LORA`, DoRA), trained biases, `modules_to_save`, or per-module ranks is
    /// [`HfError::Adapter`] naming what does not fit.
    pub fn load_adapter(&self, dir: impl AsRef<Path>) -> Result<(LoraConfig, StateDict)> {
        let dir = dir.as_ref();
        let (lora, claimed, patterns) = read_adapter_config(dir)?;
        self.load_adapter_weights(dir, lora, &claimed, &patterns)
    }

    /// The tensors of the adapter in `dir` for `lora` (its config, `claimed`
    /// its target modules), checked against this model and renamed to
    /// Kiln's; `lora.target_modules` become the modules they adapt.
    fn load_adapter_weights(
        &self,
        dir: &Path,
        mut lora: LoraConfig,
        claimed: &PeftTargets,
        patterns: &Patterns,
    ) -> Result<(LoraConfig, StateDict)> {
        let weights_path = dir.join(ADAPTER_WEIGHTS);
        if !weights_path.is_file() {
            return Err(HfError::Adapter {
                path: dir.to_owned(),
                reason: format!(
                    "no {ADAPTER_WEIGHTS} (an adapter_model.bin is a pickle, which Kiln does not \
                     read: save with safe_serialization=True)"
                ),
            });
        }
        let (tensors, _) = StateDict::load_safetensors(&weights_path)?;
        let specs = self.layer.parameter_specs("")?;
        let shape_of = |name: &str| {
            specs
                .iter()
                .find(|s| s.name == name)
                .map(|s| s.shape.clone())
        };
        let wrong = |reason: String| HfError::Adapter {
            path: weights_path.clone(),
            reason,
        };
        let mut out = StateDict::new();
        // The Kiln projections adapted, with the checkpoint's module of each.
        let mut modules: Vec<(String, String)> = Vec::new();
        // Fused modules: the name, a part's Kiln module, lora_A and lora_B.
        type Fused = (String, String, Option<HostTensor>, Option<HostTensor>);
        let mut fused: Vec<Fused> = Vec::new();
        for (key, tensor) in tensors {
            let local = key.strip_prefix(PREFIX).unwrap_or(&key);
            let (hf, suffix) = match local.strip_suffix(&format!(".{LORA_A}")) {
                Some(m) => (m, LORA_A),
                None => match local.strip_suffix(&format!(".{LORA_B}")) {
                    Some(m) => (m, LORA_B),
                    None => {
                        return Err(wrong(format!(
                            "`{key}` is not a LoRA tensor (`*.lora_A.weight` or \
                             `*.lora_B.weight`); Kiln reads linear LoRA adapters only"
                        )))
                    }
                },
            };
            let hf_weight = format!("{hf}.weight");
            let mapping = self.names.find(&hf_weight).ok_or_else(|| {
                wrong(format!(
                    "`{key}` adapts `{hf}`, which the {} model in {} does not have: an adapter \
                     for another base model?",
                    self.family,
                    self.dir.display()
                ))
            })?;
            if !claimed.adapts(hf) {
                return Err(wrong(format!(
                    "`{key}` adapts `{hf}`, which {ADAPTER_CONFIG}'s target_modules ({}) does \
                     not name: the config and the weights disagree",
                    claimed.written()
                )));
            }
            if let Some(bad) = non_finite(&tensor) {
                return Err(wrong(format!(
                    "`{key}` holds {bad}: the adapter is damaged"
                )));
            }
            let module = match mapping.kiln.as_slice() {
                [one] => one.strip_suffix(".weight").unwrap_or(one).to_owned(),
                parts => {
                    // A fused module's adapter, split once both tensors are read.
                    if !fused.iter().any(|(h, ..)| h == hf) {
                        let first = parts
                            .first()
                            .map_or("", |p| p.strip_suffix(".weight").unwrap_or(p));
                        fused.push((hf.to_owned(), first.to_owned(), None, None));
                    }
                    if let Some(entry) = fused.iter_mut().find(|(h, ..)| h == hf) {
                        if suffix == LORA_A {
                            entry.2 = Some(tensor);
                        } else {
                            entry.3 = Some(tensor);
                        }
                    }
                    continue;
                }
            };
            if Patterns::of(&patterns.rank, hf).is_some()
                || Patterns::of(&patterns.alpha, hf).is_some()
            {
                return Err(wrong(format!(
                    "{ADAPTER_CONFIG}'s rank_pattern or alpha_pattern names `{hf}`: per-module \
                     ranks and alphas are read for fused modules only (as Kiln writes them)"
                )));
            }
            let base = shape_of(&format!("{module}.weight")).unwrap_or_default();
            let (out_f, in_f) = match base.as_slice() {
                [o, i] => (*o, *i),
                _ => (0, 0),
            };
            let expected = if suffix == LORA_A {
                vec![lora.r, in_f]
            } else {
                vec![out_f, lora.r]
            };
            if tensor.dims() != expected.as_slice() {
                return Err(wrong(format!(
                    "`{key}` has shape {:?}; rank {} on `{hf}` ({out_f} x {in_f} in the model in \
                     {}) needs {expected:?}: an adapter for another base model?",
                    tensor.dims(),
                    lora.r,
                    self.dir.display()
                )));
            }
            if !modules.iter().any(|(m, _)| *m == module) {
                modules.push((module.clone(), hf.to_owned()));
            }
            let tensor = if suffix == LORA_B {
                self.rows_of(hf, &tensor, true)
                    .map_err(|e| wrong(format!("`{key}`: {e}")))?
            } else {
                tensor
            };
            out.insert(
                format!("{module}.{suffix}"),
                tensor.to_dtype(kiln_core::DType::F32),
            );
        }
        for (hf, first, a, b) in fused {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(wrong(format!(
                    "`{PREFIX}{hf}`: each adapted module needs both lora_A and lora_B"
                )));
            };
            let (_, parts) = self
                .fused_of(&first)
                .ok_or_else(|| wrong(format!("`{hf}`: its parts are not in the model")))?;
            let rows: Vec<usize> = parts.iter().map(|p| p.rows).collect();
            let b = self
                .rows_of(&hf, &b, true)
                .map_err(|e| wrong(format!("`{PREFIX}{hf}`: {e}")))?;
            let split = peft_fused::split(&a, &b, &rows, lora.r)
                .map_err(|e| wrong(format!("the adapter of the fused `{hf}`: {e}")))?;
            // A block per part keeps each part's scale only with the alpha
            // (and rank) Kiln writes for it.
            let n = parts.len() as f64;
            let blocks = a.dims().first().copied() != Some(lora.r);
            let want_alpha = if lora.use_rslora {
                lora.alpha * n.sqrt()
            } else {
                lora.alpha * n
            };
            let (rank, alpha) = (
                Patterns::of(&patterns.rank, &hf),
                Patterns::of(&patterns.alpha, &hf),
            );
            let consistent = if blocks {
                rank == a.dims().first().map(|&r| r as f64)
                    && alpha.is_some_and(|al| (al - want_alpha).abs() <= 1e-9 * want_alpha)
            } else {
                rank.is_none_or(|r| r == lora.r as f64)
                    && alpha.is_none_or(|al| (al - lora.alpha).abs() <= 1e-9 * lora.alpha)
            };
            if !consistent {
                return Err(wrong(format!(
                    "the adapter of the fused `{hf}` has rank {} with rank_pattern {rank:?} and \
                     alpha_pattern {alpha:?}: Kiln reads a rank-{r} adapter of it at the file's \
                     lora_alpha, or one block of rank {r} per part at rank {} and alpha \
                     {want_alpha} (as Kiln writes it)",
                    a.dims().first().copied().unwrap_or(0),
                    parts.len() * lora.r,
                    r = lora.r,
                )));
            }
            for (part, (pa, pb)) in parts.iter().zip(split) {
                out.insert(format!("{}.{LORA_A}", part.module), pa);
                out.insert(format!("{}.{LORA_B}", part.module), pb);
                modules.push((part.module.clone(), hf.clone()));
            }
        }
        if modules.is_empty() {
            return Err(wrong("the file holds no tensor".into()));
        }
        for (module, hf) in &modules {
            for suffix in [LORA_A, LORA_B] {
                if !out.contains_key(&format!("{module}.{suffix}")) {
                    return Err(wrong(format!(
                        "`{PREFIX}{hf}.{suffix}` is missing: each adapted module needs both \
                         lora_A and lora_B"
                    )));
                }
            }
        }
        // Every module the config names has its tensors (PEFT would start a
        // missing one afresh, with a warning).
        for projection in kiln_core::lora::projections(&self.layer)? {
            let Some(hf) = self.peft_module(&projection.module) else {
                continue;
            };
            if claimed.adapts(&hf) && !modules.iter().any(|(_, h)| *h == hf) {
                return Err(wrong(format!(
                    "`{PREFIX}{hf}.{LORA_A}` is missing: {ADAPTER_CONFIG}'s target_modules ({}) \
                     names `{hf}`, but the file holds no adapter of it",
                    claimed.written()
                )));
            }
        }
        lora.target_modules = modules.into_iter().map(|(m, _)| m).collect();
        Ok((lora, out))
    }
}

/// The LoRA settings and target modules of the adapter config in `dir`,
/// refusing what Kiln does not implement (another PEFT method, DoRA, biases,
/// `modules_to_save`, per-module ranks, LoRA's extensions) by key.
fn read_adapter_config(dir: &Path) -> Result<(LoraConfig, PeftTargets, Patterns)> {
    let config_path = dir.join(ADAPTER_CONFIG);
    let fail = |reason: String| HfError::Adapter {
        path: config_path.clone(),
        reason,
    };
    let text = std::fs::read_to_string(&config_path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            HfError::Adapter {
                path: dir.to_owned(),
                reason: format!("not a PEFT adapter directory: no {ADAPTER_CONFIG}"),
            }
        } else {
            kiln_core::Error::io(&config_path, e).into()
        }
    })?;
    let config: Value = serde_json::from_str(&text).map_err(|e| fail(format!("not JSON: {e}")))?;
    let get = |key: &str| config.get(key).filter(|v| !v.is_null());
    match get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        Some(other) => {
            return Err(fail(format!(
                "`peft_type` is \"{other}\": Kiln reads LoRA adapters (\"LORA\")"
            )))
        }
        None => {
            return Err(fail(
                "`peft_type` is missing: Kiln reads LoRA adapters (\"LORA\")".into(),
            ))
        }
    }
    if get("use_dora").and_then(Value::as_bool) == Some(true) {
        return Err(fail(
            "`use_dora` = true: DoRA adapters are not implemented".into(),
        ));
    }
    for key in ["lora_bias", "use_qalora", "use_bdlora"] {
        if get(key).and_then(Value::as_bool) == Some(true) {
            return Err(fail(format!("`{key}` = true is not implemented")));
        }
    }
    for key in [
        "trainable_token_indices",
        "target_parameters",
        "layer_replication",
    ] {
        if get(key).is_some() {
            return Err(fail(format!(
                "`{key}` is set: Kiln reads adapters of linear projections only"
            )));
        }
    }
    if let Some(bias) = get("bias").and_then(Value::as_str).filter(|b| *b != "none") {
        return Err(fail(format!(
            "`bias` = {bias:?}: Kiln's adapters train no biases (\"none\")"
        )));
    }
    if get("modules_to_save")
        .and_then(Value::as_array)
        .is_some_and(|m| !m.is_empty())
    {
        return Err(fail(
            "`modules_to_save` is set: Kiln reads the LoRA tensors only, not whole modules".into(),
        ));
    }
    // Per-module ranks and alphas: read for fused modules only (checked
    // against them once the weights are read).
    let pattern = |key: &str| -> Result<Vec<(String, f64)>> {
        let Some(map) = get(key) else {
            return Ok(Vec::new());
        };
        let map = map.as_object().ok_or_else(|| {
            fail(format!(
                "`{key}` is not an object of module names to numbers"
            ))
        })?;
        map.iter()
            .map(|(k, v)| {
                v.as_f64()
                    .map(|v| (k.clone(), v))
                    .ok_or_else(|| fail(format!("`{key}`: `{k}` is not a number")))
            })
            .collect()
    };
    let patterns = Patterns {
        rank: pattern("rank_pattern")?,
        alpha: pattern("alpha_pattern")?,
    };
    let number = |key: &str| {
        get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| fail(format!("`{key}` is missing or not a number")))
    };
    let r = number("r")?;
    if r < 1.0 || r.fract() != 0.0 {
        return Err(fail(format!("`r` = {r} is not a rank")));
    }
    let alpha = number("lora_alpha")?;
    // PEFT takes any number; a scale that is 0, negative or past float32
    // would silently give another (or a broken) model once merged.
    if !(alpha > 0.0 && alpha <= f64::from(f32::MAX) / r) {
        return Err(fail(format!(
            "`lora_alpha` = {alpha}: the update's scale alpha / r must be a positive, finite \
                 float32 number"
        )));
    }
    for key in [
        "alora_invocation_tokens",
        "velora_config",
        "monteclora_config",
        "arrow_config",
        "kasa_config",
    ] {
        if get(key).is_some() {
            return Err(fail(format!(
                "`{key}` is set: that PEFT extension of LoRA is not implemented (merging it as \
                     plain LoRA would change the model)"
            )));
        }
    }
    let claimed = PeftTargets::from_config(get).map_err(fail)?;
    let lora = LoraConfig::new(r as usize, alpha)
        .with_dropout(get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0))
        .with_rslora(get("use_rslora").and_then(Value::as_bool) == Some(true));
    Ok((lora, claimed, patterns))
}

/// An adapter config's `rank_pattern` and `alpha_pattern`: module names (or
/// their last names) and the rank or alpha PEFT gives them.
#[derive(Debug, Default)]
struct Patterns {
    rank: Vec<(String, f64)>,
    alpha: Vec<(String, f64)>,
}

impl Patterns {
    /// The value `pattern` gives checkpoint module `hf`: the entry of its
    /// full name, else of a name it ends with.
    fn of(pattern: &[(String, f64)], hf: &str) -> Option<f64> {
        pattern
            .iter()
            .find(|(k, _)| k == hf)
            .or_else(|| pattern.iter().find(|(k, _)| hf.ends_with(&format!(".{k}"))))
            .map(|(_, v)| *v)
    }
}

/// `"3 NaN and 1 infinite of 64 values"` when a floating-point `tensor` holds
/// values that are not finite, else `None`.
pub(crate) fn non_finite(tensor: &kiln_core::HostTensor) -> Option<String> {
    if !tensor.dtype().is_float() {
        return None;
    }
    let values = tensor.to_f64_vec();
    let nan = values.iter().filter(|v| v.is_nan()).count();
    let infinite = values.iter().filter(|v| v.is_infinite()).count();
    let what = match (nan, infinite) {
        (0, 0) => return None,
        (n, 0) => format!("{n} NaN"),
        (0, i) => format!("{i} infinite"),
        (n, i) => format!("{n} NaN and {i} infinite"),
    };
    Some(format!("{what} of {} values", values.len()))
}
