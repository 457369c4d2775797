//! Duplicates among pairs: exact ones by a hash of the code's tokens, near ones by MinHash and
//! locality-sensitive hashing over token shingles, confirmed by the exact Jaccard similarity.
//!
//! Tokens are identifiers, numbers and single punctuation characters after comments are removed
//! (`//` and `/* */` anywhere, Python's `#` comments: a `#` followed by white space or the end
//! of the line, so `#include` and `#define` stay), so whitespace, layout and comments never make
//! two programs different. Shingles are runs of [`SHINGLE`] tokens. Two pairs are near
//! duplicates when the Jaccard similarity of their shingle sets is at least the threshold
//! (default [`DEFAULT_THRESHOLD`]). Candidates come from [`BANDS`] bands of [`ROWS`] MinHash
//! values each: a pair with similarity 0.9 shares a band with probability 1 − (1 − 0.9⁸)¹⁶ ≈
//! 0.9999, one with 0.5 with probability 0.06; every candidate is then checked exactly, so the
//! hashing only decides which pairs are compared.

use dice_eval::SplitMix64;
use regex::Regex;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::sync::LazyLock;

/// Tokens per shingle.
pub const SHINGLE: usize = 5;
/// MinHash bands, and hash values per band.
pub const BANDS: usize = 16;
pub const ROWS: usize = 8;
/// Jaccard similarity of shingle sets from which two pairs are near duplicates.
pub const DEFAULT_THRESHOLD: f64 = 0.9;

static COMMENTS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?m)//[^\n]*|(?s:/\*.*?\*/)|(?:^|[ \t])#(?:[ \t][^\n]*)?$").expect("valid regex")
});
static TOKENS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"[A-Za-z_][A-Za-z0-9_]*|[0-9][0-9A-Za-z_.]*|\S").expect("valid regex")
});

/// The tokens of `code` without its comments.
pub fn tokens(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut last = 0;
    for comment in COMMENTS.find_iter(code) {
        out.extend(
            TOKENS
                .find_iter(&code[last..comment.start()])
                .map(|m| m.as_str()),
        );
        last = comment.end();
    }
    out.extend(TOKENS.find_iter(&code[last..]).map(|m| m.as_str()));
    out
}

/// SHA-256 (hex) of a token sequence: equal for programs that differ only in layout and comments.
pub fn token_hash(tokens: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for token in tokens {
        hasher.update(token.as_bytes());
        hasher.update([0x1f]);
    }
    hex::encode(hasher.finalize())
}

/// The hashed shingles of a token sequence (one shingle for sequences shorter than [`SHINGLE`]).
pub fn shingles(tokens: &[&str]) -> BTreeSet<u64> {
    let width = SHINGLE.min(tokens.len()).max(1);
    tokens
        .windows(width)
        .map(|w| {
            w.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, t| {
                t.bytes()
                    .chain([0x1f])
                    .fold(h, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
            })
        })
        .collect()
}

pub fn jaccard(a: &BTreeSet<u64>, b: &BTreeSet<u64>) -> f64 {
    let union = a.union(b).count();
    if union == 0 {
        return 1.0;
    }
    a.intersection(b).count() as f64 / union as f64
}

/// SplitMix64's first output from `x`: the `i`-th hash function of the MinHash family is
/// `mix(x ^ mix(i))`.
fn mix(x: u64) -> u64 {
    SplitMix64(x).next_u64()
}

fn signature(shingles: &BTreeSet<u64>) -> Vec<u64> {
    (0..(BANDS * ROWS) as u64)
        .map(|i| {
            let salt = mix(i);
            shingles.iter().map(|&s| mix(s ^ salt)).min().unwrap_or(0)
        })
        .collect()
}

/// Finds, for each item offered in turn, a similar item among those kept before it.
#[derive(Default)]
pub struct NearDuplicates {
    kept: Vec<BTreeSet<u64>>,
    buckets: HashMap<(usize, Vec<u64>), Vec<usize>>,
}

impl NearDuplicates {
    /// The kept item most similar to `shingles` when that similarity is at least `threshold`
    /// (its index among kept items and the similarity); otherwise `shingles` is kept.
    pub fn offer(&mut self, shingles: BTreeSet<u64>, threshold: f64) -> Option<(usize, f64)> {
        let signature = signature(&shingles);
        let bands: Vec<(usize, Vec<u64>)> = signature
            .chunks(ROWS)
            .enumerate()
            .map(|(band, rows)| (band, rows.to_vec()))
            .collect();
        let candidates: BTreeSet<usize> = bands
            .iter()
            .filter_map(|key| self.buckets.get(key))
            .flatten()
            .copied()
            .collect();
        let best = candidates
            .into_iter()
            .map(|k| (k, jaccard(&self.kept[k], &shingles)))
            .filter(|&(_, j)| j >= threshold)
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        if best.is_none() {
            let index = self.kept.len();
            self.kept.push(shingles);
            for key in bands {
                self.buckets.entry(key).or_default().push(index);
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_layout_do_not_count() {
        let a = "x = 1  # one\n#include <a>\ny = f(x) // call\n/* block\n */";
        assert_eq!(
            tokens(a),
            ["x", "=", "1", "#", "include", "<", "a", ">", "y", "=", "f", "(", "x", ")"]
        );
        let b = "x=1\n#include <a>\n\n\ny =  f( x )\n";
        assert_eq!(token_hash(&tokens(a)), token_hash(&tokens(b)));
        assert_ne!(token_hash(&tokens(a)), token_hash(&tokens("x = 2")));
    }

    #[test]
    fn near_duplicates_are_found_above_the_threshold_only() {
        let base: Vec<String> = (0..200).map(|i| format!("v{i} = f({i});")).collect();
        let text = base.join("\n");
        let mut edited = base.clone();
        edited[100] = "changed = g(1);".into();
        let other: Vec<String> = (0..200).map(|i| format!("w{i} = h({i});")).collect();
        let mut near = NearDuplicates::default();
        let sh = |t: &str| shingles(&tokens(t));
        assert_eq!(near.offer(sh(&text), DEFAULT_THRESHOLD), None);
        let (kept, similarity) = near
            .offer(sh(&edited.join("\n")), DEFAULT_THRESHOLD)
            .unwrap();
        assert_eq!(kept, 0);
        assert!(similarity > 0.9 && similarity < 1.0, "{similarity}");
        assert_eq!(near.offer(sh(&other.join("\n")), DEFAULT_THRESHOLD), None);
        // Half the text changed: kept, not a duplicate.
        let half: Vec<String> = base[..100]
            .iter()
            .cloned()
            .chain(other[100..].iter().cloned())
            .collect();
        assert_eq!(near.offer(sh(&half.join("\n")), DEFAULT_THRESHOLD), None);
    }
}
