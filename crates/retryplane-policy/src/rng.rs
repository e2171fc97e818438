//! Injectable randomness.
//!
//! Every random choice the engine makes (jitter) goes through [`Rng`], so tests pass a seeded or
//! scripted source and get the same numbers every run. [`SeededRng`] is the default: a small,
//! fast, seedable generator (`fastrand`'s wyrand), not suitable for secrets and not meant to be.

/// A source of uniformly distributed 64-bit values.
pub trait Rng {
    /// The next uniformly distributed value.
    fn next_u64(&mut self) -> u64;

    /// A uniform value in `0..=max`.
    fn below_inclusive(&mut self, max: u64) -> u64 {
        if max == u64::MAX {
            return self.next_u64();
        }
        // Lemire's multiply-shift: maps a 64-bit value onto 0..=max with negligible bias
        // for the ranges used here (nanosecond pauses), and no division.
        ((u128::from(self.next_u64()) * u128::from(max + 1)) >> 64) as u64
    }
}

/// The default seedable generator.
#[derive(Clone, Debug)]
pub struct SeededRng(fastrand::Rng);

impl SeededRng {
    /// A generator that yields the same sequence for the same seed.
    pub fn with_seed(seed: u64) -> Self {
        Self(fastrand::Rng::with_seed(seed))
    }

    /// A generator seeded from the process's entropy source.
    pub fn from_entropy() -> Self {
        Self(fastrand::Rng::new())
    }
}

impl Rng for SeededRng {
    fn next_u64(&mut self) -> u64 {
        self.0.u64(..)
    }
}

impl<R: Rng + ?Sized> Rng for &mut R {
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_same_sequence() {
        let mut a = SeededRng::with_seed(7);
        let mut b = SeededRng::with_seed(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    #[test]
    fn below_inclusive_stays_in_range_and_reaches_both_ends() {
        let mut rng = SeededRng::with_seed(1);
        let mut seen = [false; 4];
        for _ in 0..1000 {
            let v = rng.below_inclusive(3);
            assert!(v <= 3);
            seen[v as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(rng.below_inclusive(0), 0);
    }
}
