//! The table of model families: one [`Family`] row per family, declared in
//! the family's own file (`llama.rs` declares LLaMA and its Mistral, Qwen2
//! and Qwen3 variants), listed once in [`FAMILIES`]. Everything Kiln needs
//! to know of a family outside its builder is a field of its row, so a new
//! family is one file and one entry here.

use kiln_core::model::Layer;

use crate::config::HfConfig;
use crate::error::Result;
use crate::names::NameMap;

/// What a family's models do, which decides what Kiln offers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FamilyTask {
    /// A causal language model (`*ForCausalLM`, `*LMHeadModel`): it
    /// generates, trains on next tokens, and a classifier replaces its head
    /// on the last token.
    CausalLm,
    /// An encoder with a classifier after its pooling (BERT, ViT).
    Encoder,
}

/// The builder of a family: the definition and the checkpoint's names for a
/// config whose `architectures` are given.
pub(crate) type Build = fn(&HfConfig, &[String]) -> Result<(Layer, NameMap)>;

/// One model family Kiln builds from a `config.json`.
#[derive(Debug)]
pub struct Family {
    /// `config.json`'s `model_type` (`"llama"`, `"gpt2"`).
    pub model_type: &'static str,
    /// The family's name in messages (`"LLaMA"`, `"GPT-2"`).
    pub name: &'static str,
    /// What its models do.
    pub task: FamilyTask,
    /// The endings of the `architectures` Kiln builds (`"ForCausalLM"`); a
    /// config naming another is refused, naming it.
    pub architectures: &'static [&'static str],
    /// The config key of the hidden states' width (`hidden_size`, GPT-2's `n_embd`).
    pub hidden_size_key: &'static str,
    /// PEFT's `fan_in_fan_out`: the checkpoint stores its linear layers as
    /// `[in, out]` (GPT-2's `Conv1D`).
    pub fan_in_fan_out: bool,
    pub(crate) build: Build,
}

impl Family {
    /// The row of a causal language model whose architectures end in
    /// `ForCausalLM` and whose width is `hidden_size`.
    pub(crate) const fn causal_lm(
        model_type: &'static str,
        name: &'static str,
        build: Build,
    ) -> Self {
        Family {
            model_type,
            name,
            task: FamilyTask::CausalLm,
            architectures: &["ForCausalLM"],
            hidden_size_key: "hidden_size",
            fan_in_fan_out: false,
            build,
        }
    }

    /// Whether its models are causal language models (and generate).
    pub fn is_decoder(&self) -> bool {
        self.task == FamilyTask::CausalLm
    }

    /// The family of `model_type`, if Kiln builds it.
    pub fn of(model_type: &str) -> Option<&'static Family> {
        FAMILIES
            .iter()
            .copied()
            .find(|f| f.model_type == model_type)
    }

    /// The `model_type`s of `families`, for messages (`"llama, mistral, ..."`).
    pub fn list(families: impl IntoIterator<Item = &'static Family>) -> String {
        families
            .into_iter()
            .map(|f| f.model_type)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl std::fmt::Display for Family {
    /// The `model_type`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type)
    }
}

/// The model families Kiln builds, one row each.
pub static FAMILIES: &[&Family] = &[
    &crate::llama::LLAMA,
    &crate::llama::MISTRAL,
    &crate::llama::QWEN2,
    &crate::llama::QWEN3,
    &crate::llama::GRANITE,
    &crate::llama::SMOLLM3,
    &crate::phi3::PHI3,
    &crate::moe::MIXTRAL,
    &crate::moe::QWEN2_MOE,
    &crate::moe::QWEN3_MOE,
    &crate::moe::OLMOE,
    &crate::olmo2::OLMO2,
    &crate::stablelm::STABLELM,
    &crate::gemma::GEMMA,
    &crate::gemma::GEMMA2,
    &crate::gemma::GEMMA3_TEXT,
    &crate::gpt_neox::GPT_NEOX,
    &crate::cohere::COHERE,
    &crate::gpt2::GPT2,
    &crate::bert::BERT,
    &crate::vit::VIT,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_listed_once_and_found_by_its_model_type() {
        for family in FAMILIES {
            assert!(std::ptr::eq(
                Family::of(family.model_type).unwrap(),
                *family
            ));
            assert!(!family.architectures.is_empty(), "{family}");
        }
        let mut types: Vec<&str> = FAMILIES.iter().map(|f| f.model_type).collect();
        types.sort_unstable();
        types.dedup();
        assert_eq!(types.len(), FAMILIES.len());
        assert!(Family::of("t5").is_none());
    }
}
