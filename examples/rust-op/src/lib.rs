//! Ops written in Rust (see `ops`).
pub mod ops;
