//! Text data for language models: rows of JSON Lines, CSV or Parquet files
//! ([`TextRecords`]), turned by a tokenizer into examples for causal language
//! modelling, instruction tuning (prompt templates, the loss on the response
//! only) or classification ([`TextDataset`]), batched by padding to the
//! longest ([`PadCollate`]) or packed into fixed-length blocks ([`PackedText`]).
//!
//! Rows are read and tokenized on the loader's workers, one example at a
//! time, so a JSON Lines or CSV file need not fit in memory (only each row's
//! offset, and with packing each example's length, is kept); the examples are a [`Dataset`](kiln_data::Dataset),
//! so the loaders' seeded shuffling, [`DistributedSampler`](kiln_data::DistributedSampler)
//! sharding and exact mid-epoch resume apply as to any other.
//!
//! ```no_run
//! use std::sync::Arc;
//! use kiln_text::{PadCollate, PromptTemplate, TextDataset, TextOptions, TextTask, TokenizeText};
//! use kiln_data::PrefetchLoader;
//! # fn tokenizer() -> Arc<dyn TokenizeText> { unimplemented!() }
//!
//! let task = TextTask::Instruction {
//!     prompt: PromptTemplate::parse("### Question:\n{question}\n\n### Answer:\n")?,
//!     response: PromptTemplate::parse("{answer}")?,
//! };
//! let options = TextOptions { max_length: Some(512), truncation: false, eos_token: Some(2) };
//! let data = TextDataset::open("train.jsonl", task, options, tokenizer())?;
//! data.check_lengths(4)?; // every row tokenized once: a long row fails here
//! let loader = PrefetchLoader::with_collate(data, 8, PadCollate::new(0))?.shuffle(0);
//! # Ok::<(), kiln_core::Error>(())
//! ```

mod dataset;
mod records;
mod template;

pub use dataset::{
    shift_labels, PackedText, PadCollate, TextDataset, TextOptions, TextTask, TokenizeChat,
    TokenizeText, IGNORE_INDEX,
};
pub use records::{TextFormat, TextRecords};
pub use template::PromptTemplate;
