//! A small deterministic random number generator for shuffling.

/// SplitMix64 (Steele, Lea & Flood 2014): tiny, fast, and fully determined by
/// its seed. Kiln's one seeded generator: data order, per-sample transforms,
/// per-step seeds and the TensorFlow backend's initial weights all draw from it.
///
/// ```
/// use kiln_core::rng::SplitMix64;
///
/// let mut rng = SplitMix64::new(1_234_567);
/// assert_eq!(rng.next_u64(), 6_457_827_717_110_365_317); // Vigna's splitmix64.c
/// assert!((0.0..1.0).contains(&rng.uniform()));
/// ```
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..bound` (Lemire's multiply-shift with rejection,
    /// so without modulo bias). `bound` must be positive.
    pub fn below(&mut self, bound: u64) -> u64 {
        debug_assert!(bound > 0);
        let mut m = u128::from(self.next_u64()) * u128::from(bound);
        if (m as u64) < bound {
            let threshold = bound.wrapping_neg() % bound;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (m >> 64) as u64
    }

    /// Uniform on `[0, 1)`, from the top 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller, one value per two uniforms).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            // i + 1 <= items.len() fits in u64, and the result is <= i.
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// A random permutation of `0..n` determined by `seed`.
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    SplitMix64::new(seed).shuffle(&mut order);
    order
}

/// The sample order of epoch `epoch` of a loader shuffling with `seed`, or
/// `0..n` without a seed. Every loader uses this, so two loaders with the same
/// seed visit the samples in the same order.
pub fn epoch_order(n: usize, seed: Option<u64>, epoch: u64) -> Vec<usize> {
    match seed {
        None => (0..n).collect(),
        Some(seed) => {
            let epoch_key = SplitMix64::new(epoch).next_u64();
            permutation(n, seed ^ epoch_key)
        }
    }
}

/// A seed for the randomness of sample `index` in epoch `epoch` under `seed`:
/// each input goes through a SplitMix64 step, so nearby values give unrelated seeds.
pub fn sample_seed(seed: u64, epoch: u64, index: u64) -> u64 {
    let a = SplitMix64::new(seed).next_u64();
    let b = SplitMix64::new(a ^ epoch).next_u64();
    SplitMix64::new(b ^ index).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_reference_sequence() {
        // Reference output of Vigna's splitmix64.c seeded with 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        let got: Vec<u64> = (0..5).map(|_| rng.next_u64()).collect();
        assert_eq!(
            got,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821,
            ]
        );
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(7);
        let mut seen = [0usize; 5];
        for _ in 0..1000 {
            let v = rng.below(5);
            assert!(v < 5);
            seen[v as usize] += 1;
        }
        // each of 5 buckets expects 200 hits
        assert!(seen.iter().all(|&c| (120..280).contains(&c)), "{seen:?}");
        assert_eq!(rng.below(1), 0);
    }

    #[test]
    fn epoch_order_depends_on_seed_and_epoch_only() {
        assert_eq!(epoch_order(5, None, 3), vec![0, 1, 2, 3, 4]);
        let a = epoch_order(30, Some(9), 0);
        assert_eq!(a, epoch_order(30, Some(9), 0));
        assert_ne!(a, epoch_order(30, Some(9), 1));
        assert_ne!(a, epoch_order(30, Some(10), 0));
        // epoch 0's key is the first SplitMix64 output for seed 0
        let key = SplitMix64::new(0).next_u64();
        assert_eq!(a, permutation(30, 9 ^ key));
    }

    #[test]
    fn sample_seeds_differ_per_argument() {
        let base = sample_seed(1, 2, 3);
        assert_eq!(base, sample_seed(1, 2, 3));
        let others = [
            sample_seed(0, 2, 3),
            sample_seed(1, 3, 3),
            sample_seed(1, 2, 4),
            // swapping epoch and index must not collide
            sample_seed(1, 3, 2),
        ];
        assert!(others.iter().all(|&s| s != base), "{others:?}");
    }

    #[test]
    fn permutation_is_deterministic_and_complete() {
        let a = permutation(50, 3);
        assert_eq!(a, permutation(50, 3));
        assert_ne!(a, permutation(50, 4));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(a, sorted, "a shuffle of 50 items left them in order");
        assert!(permutation(0, 1).is_empty());
        assert_eq!(permutation(1, 1), vec![0]);
    }
}
