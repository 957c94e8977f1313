//! Rotary position embeddings: [`RopeConfig`] and every frequency scaling
//! `transformers` implements ([`RopeScaling`]: linear, dynamic NTK, YaRN,
//! Llama 3, LongRoPE, proportional), computed once here for every engine and
//! exporter, in `transformers`' float32 arithmetic.

use serde::{Deserialize, Serialize};

use super::FieldCheck;
use crate::error::Result;

/// Rotary position embeddings (RoPE) in the "rotate half" layout of the
/// Hugging Face models: the first `rotary_dim` features of each head are
/// rotated, pairing feature `i` with feature `i + rotary_dim / 2`, at angle
/// `position * inv_freq[i]`, with `inv_freq[i] = theta^(-2i / rotary_dim)`
/// unless [`scaling`](Self::scaling) says otherwise; the rest pass unchanged.
///
/// ```
/// use kiln_core::model::{RopeConfig, RopeScaling};
///
/// // Llama 3.2's rotary embedding.
/// let rope = RopeConfig::new(500_000.0).with_scaling(RopeScaling::Llama3 {
///     factor: 32.0,
///     low_freq_factor: 1.0,
///     high_freq_factor: 4.0,
///     original_max_positions: 8192,
/// });
/// let f = rope.frequencies(64, 10);
/// assert_eq!(f.inverse.len(), 32);
/// assert_eq!(f.inverse[0], 1.0); // high frequencies are left alone
/// assert!(f.inverse[31] < RopeConfig::new(500_000.0).frequencies(64, 10).inverse[31]);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeConfig {
    /// The base of the frequencies (LLaMA 2: 10000, LLaMA 3: 500000; default 10000).
    #[serde(default = "default_theta")]
    pub theta: f64,
    /// How many features of each head rotate (even; default: all, `head_dim`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_dim: Option<usize>,
    /// How the frequencies are scaled for long contexts (default: not at all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<RopeScaling>,
}

/// A scaling of RoPE's frequencies, as `transformers`' `rope_type`s compute
/// them (`ROPE_INIT_FUNCTIONS`). Factors the Hugging Face config leaves to be
/// derived (YaRN's and LongRoPE's `attention_factor`) are resolved by whoever
/// reads the config, so each variant holds exactly what it computes with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RopeScaling {
    /// `linear`: positions divided by `factor`.
    Linear {
        /// The divisor of the positions.
        factor: f64,
    },
    /// `dynamic` (NTK-aware): while the sequence (`max(position) + 1`) is
    /// longer than `max_positions`, the base grows to
    /// `theta * (factor * len / max_positions - (factor - 1))^(dim / (dim - 2))`,
    /// recomputed as the sequence grows; shorter sequences use plain RoPE.
    Dynamic {
        /// The scaling factor.
        factor: f64,
        /// The context length below which nothing is scaled (`max_position_embeddings`).
        max_positions: usize,
    },
    /// `yarn`: interpolation of the low frequencies, extrapolation of the
    /// high, a linear ramp between `beta_fast` and `beta_slow` rotations over
    /// the original context, and cosines and sines scaled by `attention_factor`.
    Yarn {
        /// The context extension factor.
        factor: f64,
        /// The pretraining context (`original_max_position_embeddings`).
        original_max_positions: usize,
        /// The scale of the cosines and sines.
        attention_factor: f64,
        /// Rotations over the original context above which a frequency is kept (default 32).
        beta_fast: f64,
        /// Rotations below which a frequency is fully interpolated (default 1).
        beta_slow: f64,
        /// Whether the ramp's ends are rounded to whole dimensions (default true).
        truncate: bool,
    },
    /// `llama3`: wavelengths longer than `original_max_positions / low_freq_factor`
    /// are divided by `factor`, shorter than `original_max_positions /
    /// high_freq_factor` kept, and those between smoothly interpolated.
    Llama3 {
        /// The divisor of the low frequencies (8 in Llama 3.1, 32 in Llama 3.2).
        factor: f64,
        /// The low-frequency boundary's factor (1).
        low_freq_factor: f64,
        /// The high-frequency boundary's factor (4).
        high_freq_factor: f64,
        /// The pretraining context (8192).
        original_max_positions: usize,
    },
    /// `longrope` (Phi-3, Phi-4): per-frequency divisors, `short_factor` while
    /// the sequence is within `original_max_positions` and `long_factor`
    /// beyond it, with cosines and sines scaled by `attention_factor`.
    #[serde(rename = "longrope")]
    LongRope {
        /// The divisors within the original context (`rotary_dim / 2` of them).
        short_factor: Vec<f64>,
        /// The divisors beyond it.
        long_factor: Vec<f64>,
        /// The pretraining context (`original_max_position_embeddings`).
        original_max_positions: usize,
        /// The scale of the cosines and sines.
        attention_factor: f64,
    },
    /// `proportional`: the first `fraction` of each head's frequency pairs
    /// rotate at `theta^(-2i / head_dim) / factor`, the rest at frequency 0
    /// (they pass unchanged), with pairs spanning the whole head.
    Proportional {
        /// The divisor of the frequencies.
        factor: f64,
        /// The share of frequency pairs that rotate (`partial_rotary_factor`).
        fraction: f64,
    },
}

/// The frequencies of a [`RopeConfig`] for one sequence length.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFrequencies {
    /// `rotary_dim / 2` inverse frequencies.
    pub inverse: Vec<f32>,
    /// The factor of the cosines and sines (1 unless YaRN or LongRoPE).
    pub attention_factor: f32,
}

fn default_theta() -> f64 {
    10_000.0
}

impl Default for RopeConfig {
    fn default() -> Self {
        RopeConfig::new(default_theta())
    }
}

impl RopeConfig {
    /// RoPE with base `theta` over every feature of a head.
    pub fn new(theta: f64) -> Self {
        RopeConfig {
            theta,
            rotary_dim: None,
            scaling: None,
        }
    }

    /// Rotates only the first `rotary_dim` features of each head.
    pub fn with_rotary_dim(mut self, rotary_dim: usize) -> Self {
        self.rotary_dim = Some(rotary_dim);
        self
    }

    /// Scales the frequencies for long contexts.
    pub fn with_scaling(mut self, scaling: RopeScaling) -> Self {
        self.scaling = Some(scaling);
        self
    }

    /// The rotated features per head, for heads of `head_dim` features.
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        self.rotary_dim.unwrap_or(head_dim)
    }

    /// Whether the frequencies depend on the sequence's length (dynamic NTK
    /// and LongRoPE): each forward pass, and each decoding step, then
    /// computes its own from `max(position) + 1`, as `transformers` does.
    pub fn depends_on_length(&self) -> bool {
        matches!(
            self.scaling,
            Some(RopeScaling::Dynamic { .. } | RopeScaling::LongRope { .. })
        )
    }

    /// The inverse frequencies and the cosines' factor for a sequence of
    /// `len` positions (`max(position) + 1`), as `transformers` computes
    /// them in float32.
    pub fn frequencies(&self, head_dim: usize, len: usize) -> RopeFrequencies {
        let dim = self.rotary_dim(head_dim);
        let theta = self.theta as f32;
        // `base ** (arange(0, dim, 2).float() / dim)`, in float32.
        let powers = |base: f32, dim: usize, pairs: usize| -> Vec<f32> {
            (0..pairs)
                .map(|i| base.powf((2 * i) as f32 / dim as f32))
                .collect()
        };
        let plain = || {
            powers(theta, dim, dim / 2)
                .iter()
                .map(|p| 1.0 / p)
                .collect()
        };
        let mut attention_factor = 1.0;
        let inverse = match &self.scaling {
            None => plain(),
            Some(RopeScaling::Linear { factor }) => {
                let plain: Vec<f32> = plain();
                plain.iter().map(|f| f / *factor as f32).collect()
            }
            Some(RopeScaling::Dynamic {
                factor,
                max_positions,
            }) => {
                if len <= *max_positions {
                    plain()
                } else {
                    let grown = (*factor as f32 * len as f32) / *max_positions as f32
                        - (*factor - 1.0) as f32;
                    let exponent = (dim as f64 / (dim as f64 - 2.0)) as f32;
                    let base = theta * grown.powf(exponent);
                    powers(base, dim, dim / 2).iter().map(|p| 1.0 / p).collect()
                }
            }
            Some(RopeScaling::Yarn {
                factor,
                original_max_positions,
                attention_factor: scale,
                beta_fast,
                beta_slow,
                truncate,
            }) => {
                attention_factor = *scale as f32;
                yarn(
                    self.theta,
                    dim,
                    *factor,
                    *original_max_positions,
                    *beta_fast,
                    *beta_slow,
                    *truncate,
                )
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            }) => llama3(
                plain(),
                *factor,
                *low_freq_factor,
                *high_freq_factor,
                *original_max_positions,
            ),
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_positions,
                attention_factor: scale,
            }) => {
                attention_factor = *scale as f32;
                let ext = if len > *original_max_positions {
                    long_factor
                } else {
                    short_factor
                };
                powers(theta, dim, dim / 2)
                    .iter()
                    .zip(ext)
                    .map(|(p, e)| 1.0 / (*e as f32 * p))
                    .collect()
            }
            Some(RopeScaling::Proportional { factor, fraction }) => {
                let angles = ((fraction * dim as f64) / 2.0).floor() as usize;
                let mut inverse: Vec<f32> = powers(theta, dim, angles.min(dim / 2))
                    .iter()
                    .map(|p| 1.0 / p)
                    .collect();
                inverse.resize(dim / 2, 0.0);
                inverse.iter().map(|f| f / *factor as f32).collect()
            }
        };
        RopeFrequencies {
            inverse,
            attention_factor,
        }
    }

    /// The `[seq, rotary_dim]` row-major cosines and sines of positions
    /// `0..seq` (frequencies of a `seq`-long sequence), scaled by the
    /// attention factor: the tables of a graph built for one length.
    pub fn tables(&self, head_dim: usize, seq: usize) -> (Vec<f32>, Vec<f32>) {
        let rot = self.rotary_dim(head_dim);
        let f = self.frequencies(head_dim, seq);
        let mut cos = Vec::with_capacity(seq * rot);
        let mut sin = Vec::with_capacity(seq * rot);
        for t in 0..seq {
            for i in 0..rot {
                let angle = f64::from(t as f32 * f.inverse[i % (rot / 2)]);
                cos.push(angle.cos() as f32 * f.attention_factor);
                sin.push(angle.sin() as f32 * f.attention_factor);
            }
        }
        (cos, sin)
    }

    /// Checks the fields for heads of `head_dim` features.
    pub(super) fn validate(&self, head_dim: usize, check: &FieldCheck<'_>) -> Result<()> {
        let rotary = self.rotary_dim(head_dim);
        if rotary == 0 || !rotary.is_multiple_of(2) || rotary > head_dim {
            return Err(check.invalid(
                "rope.rotary_dim",
                format!("must be even and in 2..={head_dim} (head_dim), got {rotary}"),
            ));
        }
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return Err(check.invalid(
                "rope.theta",
                format!("must be finite and above 1, got {}", self.theta),
            ));
        }
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(check.invalid(
                    &format!("rope.scaling.{name}"),
                    format!("must be finite and above 0, got {v}"),
                ))
            }
        };
        let context = |name: &str, v: usize| {
            if v > 0 {
                Ok(())
            } else {
                Err(check.invalid(
                    &format!("rope.scaling.{name}"),
                    "must be at least 1, got 0".to_owned(),
                ))
            }
        };
        match &self.scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => positive("factor", *factor)?,
            Some(RopeScaling::Dynamic {
                factor,
                max_positions,
            }) => {
                positive("factor", *factor)?;
                context("max_positions", *max_positions)?;
                if rotary <= 2 {
                    return Err(check.invalid(
                        "rope.rotary_dim",
                        format!(
                            "dynamic NTK scaling needs more than 2 rotated features, got {rotary}"
                        ),
                    ));
                }
            }
            Some(RopeScaling::Yarn {
                factor,
                original_max_positions,
                attention_factor,
                beta_fast,
                beta_slow,
                ..
            }) => {
                positive("factor", *factor)?;
                positive("attention_factor", *attention_factor)?;
                positive("beta_fast", *beta_fast)?;
                positive("beta_slow", *beta_slow)?;
                context("original_max_positions", *original_max_positions)?;
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            }) => {
                positive("factor", *factor)?;
                positive("low_freq_factor", *low_freq_factor)?;
                positive("high_freq_factor", *high_freq_factor)?;
                context("original_max_positions", *original_max_positions)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(check.invalid(
                        "rope.scaling.high_freq_factor",
                        format!(
                            "must be above low_freq_factor ({low_freq_factor}), got {high_freq_factor}"
                        ),
                    ));
                }
            }
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_positions,
                attention_factor,
            }) => {
                positive("attention_factor", *attention_factor)?;
                context("original_max_positions", *original_max_positions)?;
                for (name, factors) in
                    [("short_factor", short_factor), ("long_factor", long_factor)]
                {
                    if factors.len() != rotary / 2 {
                        return Err(check.invalid(
                            &format!("rope.scaling.{name}"),
                            format!(
                                "must hold rotary_dim / 2 = {} factors, one per frequency, got {}",
                                rotary / 2,
                                factors.len()
                            ),
                        ));
                    }
                    if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                        return Err(check.invalid(
                            &format!("rope.scaling.{name}"),
                            format!("must hold finite factors above 0, got {bad}"),
                        ));
                    }
                }
            }
            Some(RopeScaling::Proportional { factor, fraction }) => {
                positive("factor", *factor)?;
                if !(0.0..=1.0).contains(fraction) {
                    return Err(check.invalid(
                        "rope.scaling.fraction",
                        format!("must be in [0, 1], got {fraction}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// YaRN's inverse frequencies (`_compute_yarn_parameters`).
fn yarn(
    base: f64,
    dim: usize,
    factor: f64,
    original: usize,
    beta_fast: f64,
    beta_slow: f64,
    truncate: bool,
) -> Vec<f32> {
    let correction = |rotations: f64| {
        (dim as f64 * (original as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    let base = base as f32;
    (0..dim / 2)
        .map(|i| {
            let pos = base.powf((2 * i) as f32 / dim as f32);
            let extrapolation = 1.0 / pos;
            let interpolation = 1.0 / (factor as f32 * pos);
            let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            interpolation * (1.0 - keep) + extrapolation * keep
        })
        .collect()
}

/// Llama 3's inverse frequencies (`_compute_llama3_parameters`) from the plain ones.
fn llama3(plain: Vec<f32>, factor: f64, low: f64, high: f64, original: usize) -> Vec<f32> {
    let (factor, low, high, original) = (factor as f32, low as f32, high as f32, original as f32);
    let low_wavelen = original / low;
    let high_wavelen = original / high;
    plain
        .into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            let scaled = if wavelen > low_wavelen { f / factor } else { f };
            if wavelen < high_wavelen || wavelen > low_wavelen {
                scaled
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                (1.0 - smooth) * scaled / factor + smooth * scaled
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_frequencies_are_theta_powers() {
        let f = RopeConfig::new(10_000.0).frequencies(8, 100);
        let expected = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in f.inverse.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6 * b.max(1e-3), "{a} vs {b}");
        }
        assert_eq!(f.attention_factor, 1.0);
    }

    #[test]
    fn dynamic_scaling_starts_past_the_context_and_lowers_every_frequency() {
        let rope = RopeConfig::new(10_000.0).with_scaling(RopeScaling::Dynamic {
            factor: 2.0,
            max_positions: 16,
        });
        let plain = RopeConfig::new(10_000.0).frequencies(8, 16);
        assert_eq!(rope.frequencies(8, 16), plain);
        let long = rope.frequencies(8, 32);
        // base * (2 * 32 / 16 - 1)^(8 / 6): the first frequency is always 1.
        assert_eq!(long.inverse[0], 1.0);
        let base = 10_000f64 * 3f64.powf(8.0 / 6.0);
        let expected = 1.0 / base.powf(0.75);
        assert!((f64::from(long.inverse[3]) - expected).abs() < 1e-6 * expected);
    }

    #[test]
    fn longrope_switches_factors_past_the_original_context() {
        let rope = RopeConfig::new(100.0).with_scaling(RopeScaling::LongRope {
            short_factor: vec![1.0, 2.0],
            long_factor: vec![4.0, 8.0],
            original_max_positions: 10,
            attention_factor: 1.5,
        });
        let short = rope.frequencies(4, 10);
        let long = rope.frequencies(4, 11);
        assert_eq!(short.inverse, vec![1.0, 0.05]);
        assert_eq!(long.inverse, vec![0.25, 0.0125]);
        assert_eq!(long.attention_factor, 1.5);
    }
}
