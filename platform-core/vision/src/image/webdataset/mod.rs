//! WebDataset-style `.tar` shards: samples grouped by basename, read with
//! positioned reads from an index of the members.
//!
//! * `dataset`: [`WebDataset`], the index of every shard's samples, and
//!   reading one sample (its image and label);
//! * `tar`: reading a tar's headers (ustar, GNU long names, pax) into an
//!   index of member names, offsets and sizes;
//! * `pattern`: shard patterns (`train-{000000..000099}.tar`), counted
//!   before they are expanded;
//! * `label`: parsing a sample's label and checking it against the classes;
//! * `order`: [`ShardOrder`], an epoch's order over the shards (shuffled
//!   shards, a shuffle buffer, a block per rank).

mod dataset;
mod label;
mod order;
mod pattern;
mod tar;

pub use dataset::WebDataset;
pub use order::ShardOrder;
pub use pattern::MAX_SHARDS;
