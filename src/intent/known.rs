//! Keys this relay has seen recorded: a hint that sends a repeat of one straight to the stored
//! key's read, rather than through the intent insert first (where its conflict would only say
//! what the hint says, after the whole row was sent and parsed).
//!
//! A hint is never trusted for an answer: the repeat is still classified against the row the
//! read finds, under the same lock. When the read does not find a key (pruned past retention
//! since it was remembered), the batch's keys are forgotten and it is recorded again without
//! the hint.

use std::collections::HashSet;
use std::sync::Mutex;

/// Remembers up to twice `per_generation` keys, the most recently seen first: a key seen again
/// moves to the current generation, and when that fills, the older one is dropped whole.
pub struct KnownKeys {
    per_generation: usize,
    generations: Mutex<Generations>,
}

#[derive(Default)]
struct Generations {
    current: HashSet<String>,
    previous: HashSet<String>,
}

impl Generations {
    fn add(&mut self, key: String, per_generation: usize) {
        if self.current.len() >= per_generation {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key);
    }
}

/// Keys remembered per generation by default: about 6 MiB for two generations of 40-byte keys
/// (at most about 20 MiB, keys being at most 255 bytes), and seconds to minutes of a busy
/// relay's new keys, which is when repeats come (a client's retry, an orchestrator's, a resumed
/// run).
pub const PER_GENERATION: usize = 32_768;

impl Default for KnownKeys {
    fn default() -> Self {
        KnownKeys::new(PER_GENERATION)
    }
}

impl KnownKeys {
    pub fn new(per_generation: usize) -> Self {
        KnownKeys {
            per_generation: per_generation.max(1),
            generations: Mutex::new(Generations::default()),
        }
    }

    fn generations(&self) -> std::sync::MutexGuard<'_, Generations> {
        // A panic elsewhere cannot leave the sets inconsistent: each change is one insert or
        // one swap.
        self.generations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `key` was recorded, as far as this relay has seen.
    pub fn contains(&self, key: &str) -> bool {
        let mut g = self.generations();
        if g.current.contains(key) {
            return true;
        }
        match g.previous.take(key) {
            Some(k) => {
                g.add(k, self.per_generation);
                true
            }
            None => false,
        }
    }

    /// Remembers keys a committed transaction recorded or found recorded.
    pub fn remember(&self, keys: impl IntoIterator<Item = String>) {
        let mut g = self.generations();
        for k in keys {
            if !g.current.contains(&k) {
                g.previous.remove(&k);
                g.add(k, self.per_generation);
            }
        }
    }

    /// Forgets a key found missing.
    pub fn forget(&self, key: &str) {
        let mut g = self.generations();
        g.current.remove(key);
        g.previous.remove(key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        let g = self.generations();
        g.current.len() + g.previous.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<usize>) -> impl Iterator<Item = String> {
        range.map(|i| format!("k{i}"))
    }

    #[test]
    fn remembers_at_most_two_generations_and_keeps_what_is_seen_again() {
        let known = KnownKeys::new(3);
        known.remember(keys(0..3));
        assert!((0..3).all(|i| known.contains(&format!("k{i}"))));
        // A fourth key starts a new generation; the first three are the previous one.
        known.remember(keys(3..4));
        assert_eq!(known.len(), 4);
        // k0 seen again moves to the current generation, so it outlives k1 and k2.
        assert!(known.contains("k0"));
        known.remember(keys(4..6));
        assert_eq!(
            known.len(),
            4,
            "a full generation replaced the previous one"
        );
        assert!(known.contains("k0") && known.contains("k3") && known.contains("k5"));
        assert!(!known.contains("k1") && !known.contains("k2"));
        assert!(!known.contains("k9"), "never seen");
    }

    #[test]
    fn a_forgotten_key_is_not_known_and_remembering_twice_keeps_one() {
        let known = KnownKeys::new(8);
        known.remember(keys(0..2));
        known.remember(keys(0..2));
        assert_eq!(known.len(), 2);
        known.forget("k1");
        assert!(known.contains("k0"));
        assert!(!known.contains("k1"));
        assert_eq!(known.len(), 1);
    }
}
