//! What the commands that train share, each part once: the model and data
//! prepared from a config ([`prepare`]), the model put under the config's
//! strategy ([`strategy`]), the training state and the trainer with its
//! sinks, checkpointer and callbacks assembled from the config
//! ([`assemble`]), and the run directory's files ([`directory`]). The
//! commands (`train.rs`, `tune_lr.rs`, `inspect.rs`) each take what they need.

pub(crate) mod assemble;
pub(crate) mod directory;
pub(crate) mod prepare;
pub(crate) mod strategy;
