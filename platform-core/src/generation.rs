//! Text generation settings and next-token choice, independent of the backend:
//! [`GenerationConfig`] says how many tokens, when to stop and how to choose;
//! [`Sampler`] turns one row of logits into a token, greedily or by sampling
//! with temperature, top-k and top-p from a seeded generator (so a seed gives
//! the same text on every run and backend).
//!
//! The order of the filters is `transformers`': temperature, then top-k, then
//! top-p. Greedy decoding picks the first maximum, as `argmax` does.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "snake_case", deny_unknown_fields)]
pub enum Decoding {
    /// The most likely token (`do_sample=False`).
    Greedy,
    /// A token drawn from the softmax of `logits / temperature`, restricted to
    /// the `top_k` most likely and to the smallest set whose probability
    /// reaches `top_p` (`do_sample=True`).
    Sample {
        /// Divides the logits; below 1 sharpens, above 1 flattens (default 1).
        #[serde(default = "one")]
        temperature: f64,
        /// Keep only the `k` most likely tokens (ties with the `k`-th kept).
        #[serde(default)]
        top_k: Option<usize>,
        /// Keep the most likely tokens until their probability reaches `p`, in `(0, 1]`.
        #[serde(default)]
        top_p: Option<f64>,
    },
}

fn one() -> f64 {
    1.0
}

/// What to generate: how many tokens at most, when to stop and how to choose.
///
/// ```
/// use kiln_core::generation::{Decoding, GenerationConfig};
///
/// let config = GenerationConfig::greedy(32).with_stop_tokens(vec![2]);
/// config.validate()?;
/// let sampled = GenerationConfig::greedy(32).with_decoding(Decoding::Sample {
///     temperature: 0.8,
///     top_k: Some(50),
///     top_p: Some(0.95),
/// });
/// sampled.validate()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct GenerationConfig {
    /// New tokens per prompt at most (`max_new_tokens`).
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub decoding: Decoding,
    /// Tokens that end a sequence (`eos_token_id`); the stop token is kept.
    pub stop_tokens: Vec<i64>,
    /// The token that pads shorter prompts on the left (never attended to).
    pub pad_token: i64,
    /// Seed of the sampling generator.
    pub seed: u64,
    /// Whether to keep keys and values between steps (default `true`);
    /// without, every step reruns the whole sequence (the reference path).
    pub use_cache: bool,
}

impl GenerationConfig {
    /// Greedy decoding of up to `max_new_tokens`, no stop tokens, pad token 0, seed 0.
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerationConfig {
            max_new_tokens,
            decoding: Decoding::Greedy,
            stop_tokens: Vec::new(),
            pad_token: 0,
            seed: 0,
            use_cache: true,
        }
    }

    /// Sets how tokens are chosen.
    pub fn with_decoding(mut self, decoding: Decoding) -> Self {
        self.decoding = decoding;
        self
    }

    /// Sets the tokens that end a sequence.
    pub fn with_stop_tokens(mut self, stop_tokens: Vec<i64>) -> Self {
        self.stop_tokens = stop_tokens;
        self
    }

    /// Sets the padding token.
    pub fn with_pad_token(mut self, pad_token: i64) -> Self {
        self.pad_token = pad_token;
        self
    }

    /// Sets the sampling seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets whether keys and values are cached between steps.
    pub fn with_cache(mut self, use_cache: bool) -> Self {
        self.use_cache = use_cache;
        self
    }

    /// Refuses settings that cannot work, naming the field.
    pub fn validate(&self) -> Result<()> {
        if let Decoding::Sample {
            temperature,
            top_k,
            top_p,
        } = &self.decoding
        {
            if !(temperature.is_finite() && *temperature > 0.0) {
                return Err(Error::invalid_argument(
                    "temperature",
                    format!(
                        "must be finite and above 0, got {temperature} (use greedy decoding for 0)"
                    ),
                ));
            }
            if *top_k == Some(0) {
                return Err(Error::invalid_argument(
                    "top_k",
                    "must be at least 1, got 0",
                ));
            }
            if let Some(p) = top_p {
                if !(*p > 0.0 && *p <= 1.0) {
                    return Err(Error::invalid_argument(
                        "top_p",
                        format!("must be in (0, 1], got {p}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Chooses tokens from logits as a [`Decoding`] says, drawing from its own
/// seeded generator.
///
/// ```
/// use kiln_core::generation::{Decoding, Sampler};
///
/// let mut greedy = Sampler::new(&Decoding::Greedy, 0);
/// assert_eq!(greedy.pick(&[0.1, 2.0, -1.0])?, 1);
/// let mut top1 = Sampler::new(&Decoding::Sample { temperature: 1.0, top_k: Some(1), top_p: None }, 7);
/// assert_eq!(top1.pick(&[0.1, 2.0, -1.0])?, 1);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Sampler {
    decoding: Decoding,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler for `decoding` whose draws start from `seed`.
    pub fn new(decoding: &Decoding, seed: u64) -> Self {
        Sampler {
            decoding: decoding.clone(),
            rng: SplitMix64::new(seed),
        }
    }

    /// The index of the chosen token in `logits` (one row, the vocabulary).
    /// Fails on an empty row or one whose logits are not numbers.
    pub fn pick(&mut self, logits: &[f32]) -> Result<usize> {
        if logits.is_empty() {
            return Err(Error::invalid_argument(
                "logits",
                "an empty row has no token to pick",
            ));
        }
        if logits.iter().any(|v| v.is_nan()) {
            return Err(Error::invalid_argument(
                "logits",
                "a row holds NaN: the model's output is not a distribution",
            ));
        }
        if let Some(i) = logits.iter().position(|v| *v == f32::INFINITY) {
            return Err(Error::invalid_argument(
                "logits",
                format!("token {i}'s logit is +inf: the model's output is not a distribution"),
            ));
        }
        if logits.iter().all(|v| *v == f32::NEG_INFINITY) {
            return Err(Error::invalid_argument(
                "logits",
                "every logit is -inf: no token can be chosen",
            ));
        }
        let (temperature, top_k, top_p) = match &self.decoding {
            Decoding::Greedy => return Ok(argmax(logits)),
            Decoding::Sample {
                temperature,
                top_k,
                top_p,
            } => (*temperature, *top_k, *top_p),
        };
        let probs = filtered_probabilities(logits, temperature, top_k, top_p);
        let total: f64 = probs.iter().sum();
        if !(total.is_finite() && total > 0.0) || probs.iter().any(|p| !p.is_finite()) {
            return Err(Error::invalid_argument(
                "logits",
                format!(
                    "the sampling distribution at temperature {temperature} is not finite \
                     (it sums to {total})"
                ),
            ));
        }
        let u = self.rng.uniform();
        let mut acc = 0.0;
        let mut last = 0;
        for (i, p) in probs.iter().enumerate() {
            if *p > 0.0 {
                acc += p;
                last = i;
                if u < acc {
                    return Ok(i);
                }
            }
        }
        Ok(last)
    }
}

/// The first index of the largest value.
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// The sampling distribution over `logits` after temperature, top-k and top-p,
/// in float64, summing to 1; filtered tokens have probability 0.
///
/// The largest logit is taken off before dividing by the temperature (the
/// same distribution as `softmax(logits / temperature)`), so that a tiny
/// temperature cannot overflow: `1e-310` is greedy decoding, not NaN. Logits
/// must be finite or `-inf` with at least one finite ([`Sampler::pick`] checks).
pub fn filtered_probabilities(
    logits: &[f32],
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
) -> Vec<f64> {
    let top = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let top = f64::from(top);
    let mut scaled: Vec<f64> = logits
        .iter()
        .map(|&v| (f64::from(v) - top) / temperature)
        .collect();
    let mut order: Vec<usize> = (0..scaled.len()).collect();
    // Most likely first; equal logits keep their index order.
    order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
    if let Some(k) = top_k {
        if k < order.len() {
            let kth = scaled[order[k - 1]];
            for v in scaled.iter_mut() {
                if *v < kth {
                    *v = f64::NEG_INFINITY;
                }
            }
        }
    }
    let softmax = |values: &[f64]| -> Vec<f64> {
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = values.iter().map(|v| (v - max).exp()).collect();
        let total: f64 = exps.iter().sum();
        exps.iter().map(|e| e / total).collect()
    };
    let mut probs = softmax(&scaled);
    if let Some(p) = top_p {
        // Keep the most likely tokens until their mass reaches p (at least one).
        let mut mass = 0.0;
        let mut keep = vec![false; probs.len()];
        for &i in &order {
            if mass >= p {
                break;
            }
            keep[i] = true;
            mass += probs[i];
        }
        for (i, k) in keep.iter().enumerate() {
            if !k {
                scaled[i] = f64::NEG_INFINITY;
            }
        }
        probs = softmax(&scaled);
    }
    probs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(&Decoding::Greedy, 1);
        assert_eq!(s.pick(&[1.0, 3.0, 3.0, 0.0]).expect("picks"), 1);
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        // softmax of ln([0.5, 0.3, 0.15, 0.05]) is that distribution.
        let logits: Vec<f32> = [0.5f64, 0.3, 0.15, 0.05]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let p = filtered_probabilities(&logits, 1.0, Some(2), None);
        assert!(
            (p[0] - 0.625).abs() < 1e-6 && (p[1] - 0.375).abs() < 1e-6,
            "{p:?}"
        );
        assert_eq!(&p[2..], &[0.0, 0.0]);
        // 0.5 < 0.8, 0.5 + 0.3 >= 0.8: the two most likely remain.
        let p = filtered_probabilities(&logits, 1.0, None, Some(0.8));
        assert!((p[0] - 0.625).abs() < 1e-6, "{p:?}");
        assert_eq!(p[2], 0.0);
        // Temperature 2 is the square root of the probabilities, renormalised.
        let p = filtered_probabilities(&logits, 2.0, None, None);
        let roots: Vec<f64> = [0.5f64, 0.3, 0.15, 0.05].iter().map(|v| v.sqrt()).collect();
        let total: f64 = roots.iter().sum();
        for (a, b) in p.iter().zip(&roots) {
            assert!((a - b / total).abs() < 1e-6);
        }
    }

    #[test]
    fn draws_follow_the_distribution_and_the_seed() {
        let logits: Vec<f32> = [0.5f64, 0.3, 0.2].iter().map(|p| p.ln() as f32).collect();
        let decoding = Decoding::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: None,
        };
        let mut s = Sampler::new(&decoding, 42);
        let mut counts = [0usize; 3];
        let draws: Vec<usize> = (0..20_000)
            .map(|_| s.pick(&logits).expect("picks"))
            .collect();
        for d in &draws {
            counts[*d] += 1;
        }
        // Binomial standard deviation at n = 20000 is at most 0.0036: 4 sigma.
        for (c, p) in counts.iter().zip([0.5, 0.3, 0.2]) {
            assert!((*c as f64 / 20_000.0 - p).abs() < 0.015, "{counts:?}");
        }
        let mut again = Sampler::new(&decoding, 42);
        let replay: Vec<usize> = (0..100)
            .map(|_| again.pick(&logits).expect("picks"))
            .collect();
        assert_eq!(replay, draws[..100]);
    }

    #[test]
    fn bad_settings_and_rows_are_refused() {
        let bad = GenerationConfig::greedy(4).with_decoding(Decoding::Sample {
            temperature: 0.0,
            top_k: None,
            top_p: None,
        });
        assert!(bad
            .validate()
            .expect_err("t = 0")
            .to_string()
            .contains("temperature"));
        let mut s = Sampler::new(&Decoding::Greedy, 0);
        assert!(s.pick(&[]).is_err());
        assert!(s.pick(&[f32::NAN]).is_err());
        assert!(s.pick(&[f32::NEG_INFINITY; 3]).is_err());
        let err = s.pick(&[0.0, f32::INFINITY]).expect_err("+inf");
        assert!(err.to_string().contains("token 1's logit is +inf"), "{err}");
    }

    #[test]
    fn a_tiny_temperature_is_greedy_not_nan() {
        // 3 / 1e-310 overflows float64; the largest logit is taken off first.
        for temperature in [1e-310, 1e-300, 1e-30] {
            let decoding = Decoding::Sample {
                temperature,
                top_k: None,
                top_p: Some(0.9),
            };
            let mut s = Sampler::new(&decoding, 3);
            for _ in 0..20 {
                assert_eq!(
                    s.pick(&[-1.0, 3.0, 2.5, f32::NEG_INFINITY]).expect("picks"),
                    1
                );
            }
        }
        let p = filtered_probabilities(&[1.0, 1.0, -5.0], 1e-310, None, None);
        assert_eq!(p, [0.5, 0.5, 0.0]);
    }
}
