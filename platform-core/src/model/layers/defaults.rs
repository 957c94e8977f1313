//! Serde defaults and size readers shared by the configs' fields.

use serde::{Deserialize, Deserializer};

pub(super) fn yes() -> bool {
    true
}

pub(super) fn ones2() -> [usize; 2] {
    [1, 1]
}

pub(super) fn default_eps() -> f64 {
    1e-5
}

pub(super) fn default_bn_momentum() -> f64 {
    0.1
}

pub(super) fn one_usize() -> usize {
    1
}

/// Reads a 2-d size written either as one number (`3`, meaning `[3, 3]`) or as a pair.
pub(crate) fn pair<'de, D: Deserializer<'de>>(d: D) -> Result<[usize; 2], D::Error> {
    #[derive(Deserialize)]
    #[serde(
        untagged,
        expecting = "a size: one non-negative integer or a pair [h, w]"
    )]
    enum Pair {
        One(usize),
        Two([usize; 2]),
    }
    Ok(match Pair::deserialize(d)? {
        Pair::One(v) => [v, v],
        Pair::Two(p) => p,
    })
}

/// Like [`pair`], for an optional size.
pub(super) fn opt_pair<'de, D: Deserializer<'de>>(d: D) -> Result<Option<[usize; 2]>, D::Error> {
    pair(d).map(Some)
}
