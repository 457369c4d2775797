//! A bounded excerpt of a byte stream: its first and last bytes, with how many were left out.

use std::collections::VecDeque;

/// Bytes kept from each end of a stream.
pub(crate) const EXCERPT_HEAD: usize = 16 * 1024;
pub(crate) const EXCERPT_TAIL: usize = 16 * 1024;

#[derive(Debug)]
pub struct Excerpt {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    head_limit: usize,
    tail_limit: usize,
    omitted: u64,
}

impl Default for Excerpt {
    fn default() -> Self {
        Excerpt::new(EXCERPT_HEAD, EXCERPT_TAIL)
    }
}

impl Excerpt {
    pub fn new(head_limit: usize, tail_limit: usize) -> Self {
        Excerpt {
            head: Vec::new(),
            tail: VecDeque::new(),
            head_limit,
            tail_limit,
            omitted: 0,
        }
    }

    pub fn push(&mut self, mut bytes: &[u8]) {
        let room = self.head_limit - self.head.len();
        let into_head = room.min(bytes.len());
        self.head.extend_from_slice(&bytes[..into_head]);
        bytes = &bytes[into_head..];
        if bytes.len() >= self.tail_limit {
            self.omitted += (self.tail.len() + bytes.len() - self.tail_limit) as u64;
            self.tail.clear();
            bytes = &bytes[bytes.len() - self.tail_limit..];
        }
        self.tail.extend(bytes);
        let overflow = self.tail.len().saturating_sub(self.tail_limit);
        self.tail.drain(..overflow);
        self.omitted += overflow as u64;
    }

    /// Total bytes seen.
    pub fn total(&self) -> u64 {
        (self.head.len() + self.tail.len()) as u64 + self.omitted
    }

    /// The excerpt as text (invalid UTF-8 replaced), with a marker where bytes were left out.
    pub fn render(&self) -> String {
        let mut text = String::from_utf8_lossy(&self.head).into_owned();
        if self.omitted > 0 {
            text.push_str(&format!("\n[{} bytes omitted]\n", self.omitted));
        }
        let (a, b) = self.tail.as_slices();
        text.push_str(&String::from_utf8_lossy(&[a, b].concat()));
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_both_ends_and_counts_the_middle() {
        let mut e = Excerpt::new(4, 4);
        for chunk in [&b"abc"[..], b"defgh", b"ijklmnop", b"qr"] {
            e.push(chunk);
        }
        assert_eq!(e.total(), 18);
        assert_eq!(e.render(), "abcd\n[10 bytes omitted]\nopqr");
    }

    #[test]
    fn short_streams_are_kept_whole() {
        let mut e = Excerpt::new(4, 4);
        e.push(b"abcdef");
        assert_eq!(e.render(), "abcdef");
    }
}
