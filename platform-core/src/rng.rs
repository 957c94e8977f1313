//! Deterministic random number generators for shuffling.
//!
//! * [`SplitMix64`]: Kiln's own seeded generator, behind [`permutation`]
//!   and [`sample_seed`].
//! * [`Mt19937`] and [`torch_randperm`]: PyTorch's CPU generator and its
//!   `torch.randperm`, reproduced bit for bit, behind [`epoch_order`]: the
//!   data order of every loader and of `DistributedSampler`, exactly PyTorch's.

/// SplitMix64 (Steele, Lea & Flood 2014): tiny, fast, and fully determined by
/// its seed. Kiln's own seeded generator: per-sample transforms, per-step
/// seeds, shard and split shuffles and the TensorFlow backend's initial
/// weights draw from it (the loaders' sample order is PyTorch's
/// [`torch_randperm`], through [`epoch_order`]).
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

/// The name of [`epoch_order`]'s order, which Kiln's trainer records in its
/// checkpoints (`kiln.data_order`): a checkpoint written mid-epoch under
/// another order (or none recorded, before this one) cannot resume on the
/// samples it left off at.
///
/// `randperm-v2` is `torch.randperm` of `seed + epoch`; the order before it
/// was a SplitMix64 permutation of `seed` and the epoch.
pub const EPOCH_ORDER: &str = "randperm-v2";

/// The sample order of epoch `epoch` of a loader shuffling with `seed`, or
/// `0..n` without a seed: [`torch_randperm`]`(n, seed + epoch)` (the sum
/// wrapping at 2^64), which is
/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))`.
///
/// This is also the global order of PyTorch's (and Kiln's)
/// `DistributedSampler(shuffle=True, seed=seed)` after `set_epoch(epoch)`,
/// before it is padded or cut for the ranks. Every map-style loader and
/// `kiln_data::DistributedSampler` shuffle with this one function, so one
/// process with batches of `2B` and two ranks with batches of `B` (with
/// `drop_last`) visit the same samples at each step: the union of the ranks'
/// `k`-th batches is the entries `[2Bk, 2B(k+1))` of this order. Its name is
/// [`EPOCH_ORDER`].
///
/// ```
/// use kiln_core::rng::{epoch_order, torch_randperm};
///
/// assert_eq!(epoch_order(4, None, 3), [0, 1, 2, 3]);
/// // torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
/// assert_eq!(epoch_order(10, Some(0), 0), [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]);
/// assert_eq!(epoch_order(10, Some(5), 2), torch_randperm(10, 7));
/// ```
pub fn epoch_order(n: usize, seed: Option<u64>, epoch: u64) -> Vec<usize> {
    match seed {
        None => (0..n).collect(),
        Some(seed) => torch_randperm(n, seed.wrapping_add(epoch)),
    }
}

/// A seed for the randomness of sample `index` in epoch `epoch` under `seed`:
/// each input goes through a SplitMix64 step, so nearby values give unrelated seeds.
pub fn sample_seed(seed: u64, epoch: u64, index: u64) -> u64 {
    let a = SplitMix64::new(seed).next_u64();
    let b = SplitMix64::new(a ^ epoch).next_u64();
    SplitMix64::new(b ^ index).next_u64()
}

/// Words of [`Mt19937`]'s state.
const MT_N: usize = 624;
/// The middle word of the twist.
const MT_M: usize = 397;
/// The twist matrix's last row.
const MT_MATRIX_A: u32 = 0x9908_B0DF;
/// The state word's top bit, and the other 31.
const MT_UPPER: u32 = 0x8000_0000;
const MT_LOWER: u32 = 0x7FFF_FFFF;

/// The 32-bit Mersenne Twister MT19937 (Matsumoto & Nishimura 1998), seeded
/// as in their reference `init_genrand`: the generator behind `std::mt19937`,
/// NumPy's legacy `RandomState` and PyTorch's CPU `torch.Generator`.
///
/// Kiln uses it to reproduce PyTorch's random choices exactly
/// ([`torch_randperm`]); for its own randomness it uses the smaller and faster
/// [`SplitMix64`].
///
/// ```
/// use kiln_core::rng::Mt19937;
///
/// let mut rng = Mt19937::new(5489);
/// assert_eq!(rng.next_u32(), 3_499_211_612); // the reference's first output
/// ```
#[derive(Clone)]
pub struct Mt19937 {
    state: [u32; MT_N],
    /// The next state word to temper; `MT_N` means the state must be twisted first.
    index: usize,
}

impl Mt19937 {
    /// A generator seeded with `seed` (the reference `init_genrand(seed)`).
    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; MT_N];
        state[0] = seed;
        for i in 1..MT_N {
            let prev = state[i - 1];
            // i < 624, so the cast is exact.
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { state, index: MT_N }
    }

    /// The generator of `torch.Generator().manual_seed(seed)` on the CPU.
    ///
    /// ATen's `CPUGeneratorImpl` keeps the 64-bit seed but initialises its
    /// `at::mt19937` from the low 32 bits only (`state[0] = seed & 0xffffffff`
    /// in `aten/src/ATen/core/MT19937RNGEngine.h`), so seeds that differ only
    /// above bit 31 give the same numbers, in PyTorch as here.
    pub fn torch_seeded(seed: u64) -> Self {
        // Truncation to the low 32 bits is ATen's seeding.
        Mt19937::new(seed as u32)
    }

    /// The next 32 random bits (ATen's `CPUGeneratorImpl::random()`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= MT_N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9D2C_5680;
        y ^= (y << 15) & 0xEFC6_0000;
        y ^ (y >> 18)
    }

    /// The next 64 random bits from two 32-bit outputs, the first in the high
    /// half (ATen's `CPUGeneratorImpl::random64()`).
    pub fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32();
        let lo = self.next_u32();
        (u64::from(hi) << 32) | u64::from(lo)
    }

    /// Regenerates all 624 state words.
    fn twist(&mut self) {
        for i in 0..MT_N {
            let y = (self.state[i] & MT_UPPER) | (self.state[(i + 1) % MT_N] & MT_LOWER);
            let mag = if y & 1 == 0 { 0 } else { MT_MATRIX_A };
            self.state[i] = self.state[(i + MT_M) % MT_N] ^ (y >> 1) ^ mag;
        }
        self.index = 0;
    }
}

impl std::fmt::Debug for Mt19937 {
    /// The position in the state, not the 624 state words.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mt19937")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

/// Below this length ATen's CPU `randperm` shuffles with 32-bit draws
/// (`n < std::numeric_limits<uint32_t>::max() / 20`); from it on, with 64-bit ones.
pub const TORCH_RANDPERM_SMALL_LIMIT: usize = (u32::MAX / 20) as usize;

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()`
/// on the CPU (PyTorch 2.x, checked against 2.11): a permutation of `0..n`.
///
/// ATen's `randperm_cpu` (`aten/src/ATen/native/TensorFactories.cpp`) draws
/// from the [`Mt19937`] of [`Mt19937::torch_seeded`]`(seed)` in one of two ways:
///
/// * `n <` [`TORCH_RANDPERM_SMALL_LIMIT`] (214,748,364): start from `0..n`,
///   and for `i` in `0..n - 1` swap positions `i` and `i + z`, where
///   `z = random() % (n - i)` with a 32-bit `random()`;
/// * larger `n`: the "inside-out" Fisher-Yates, for `i` in `0..n`:
///   `z = random64() % (i + 1)`, then `out[i] = out[z]` and `out[z] = i`.
///
/// Both keep the modulo bias of the original, as they must to agree with it.
///
/// ```
/// use kiln_core::rng::torch_randperm;
///
/// // torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
/// assert_eq!(torch_randperm(10, 0), [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]);
/// ```
pub fn torch_randperm(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = Mt19937::torch_seeded(seed);
    if n < TORCH_RANDPERM_SMALL_LIMIT {
        let mut order: Vec<usize> = (0..n).collect();
        for i in 0..n.saturating_sub(1) {
            // n - i < 2^28 here, so both casts are exact.
            let z = u64::from(rng.next_u32()) % (n - i) as u64;
            order.swap(i, i + z as usize);
        }
        order
    } else {
        let mut order = vec![0usize; n];
        for i in 0..n {
            // z <= i < n: the remainder fits in usize.
            let z = (rng.next_u64() % (i as u64 + 1)) as usize;
            order[i] = order[z];
            order[z] = i;
        }
        order
    }
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
        // torch.randperm of seed + epoch: only the sum matters.
        assert_eq!(a, torch_randperm(30, 9));
        assert_eq!(epoch_order(30, Some(7), 2), a);
        assert_eq!(epoch_order(3, Some(u64::MAX), 1), torch_randperm(3, 0));
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

    #[test]
    fn mt19937_matches_the_reference() {
        // mt19937ar.c seeded with init_genrand(5489): the first outputs, and
        // the 10000th that the C++ standard requires of std::mt19937.
        let mut rng = Mt19937::new(5489);
        let first: Vec<u32> = (0..3).map(|_| rng.next_u32()).collect();
        assert_eq!(first, [3_499_211_612, 581_869_302, 3_890_346_734]);
        let mut rng = Mt19937::new(5489);
        let tenth_thousand = (0..10_000).fold(0, |_, _| rng.next_u32());
        assert_eq!(tenth_thousand, 4_123_659_995);
    }

    #[test]
    fn mt19937_u64_puts_the_first_draw_high() {
        let mut a = Mt19937::new(7);
        let mut b = a.clone();
        let hi = u64::from(b.next_u32());
        let lo = u64::from(b.next_u32());
        assert_eq!(a.next_u64(), (hi << 32) | lo);
        assert!(format!("{a:?}").starts_with("Mt19937"));
    }

    #[test]
    fn torch_seeding_keeps_the_low_32_bits() {
        let mut a = Mt19937::torch_seeded(5);
        let mut b = Mt19937::torch_seeded((1 << 32) + 5);
        assert_eq!(a.next_u32(), b.next_u32());
    }

    #[test]
    fn torch_randperm_matches_pytorch_for_small_n() {
        // torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        // with PyTorch 2.11 on the CPU.
        assert_eq!(torch_randperm(10, 0), [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]);
        assert_eq!(torch_randperm(10, 5), [1, 4, 9, 6, 3, 5, 0, 2, 8, 7]);
        assert!(torch_randperm(0, 3).is_empty());
        assert_eq!(torch_randperm(1, 3), [0]);
        let mut sorted = torch_randperm(1000, 12_345);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    }
}
