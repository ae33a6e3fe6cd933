//! Block hashing of a canonical prompt byte stream.
//!
//! The stream is cut into fixed-size blocks; block `i`'s hash is block `i-1`'s hash linked with
//! xxh3 of block `i`'s bytes, so one 64-bit value names the whole prefix up to and including
//! block `i`.
//! Two prompts share their first `k` block hashes exactly when they share their first `k` blocks
//! of bytes, which is what makes turn n+1 of a conversation find turn n's blocks.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The chain step. Not `xxh3_64_with_seed(block, prev)`: for inputs over 240 bytes a seeded
/// xxh3 derives a fresh 192-byte secret on every call, which cost as much as hashing the block
/// itself. The block is hashed unseeded and only its 8-byte digest is seeded with the chain.
#[inline]
fn link(prev: u64, block: &[u8]) -> u64 {
    xxh3_64_with_seed(&xxh3_64(block).to_le_bytes(), prev)
}

/// Default block size in bytes (about 64 tokens of English text).
pub use crate::config::BLOCK_BYTES as DEFAULT_BLOCK_BYTES;

/// Streaming block hasher: feed bytes in any split, get the same hashes.
pub struct BlockHasher {
    block: usize,
    buf: Vec<u8>,
    prev: u64,
    hashes: Vec<u64>,
}

impl BlockHasher {
    pub fn new(block: usize) -> Self {
        BlockHasher::seeded(block, 0)
    }

    /// A chain that starts from `seed` instead of 0: the same bytes under another seed share
    /// no block.
    pub fn seeded(block: usize, seed: u64) -> Self {
        let block = block.max(1);
        BlockHasher {
            block,
            buf: Vec::with_capacity(block),
            prev: seed,
            hashes: Vec::new(),
        }
    }

    /// Pre-size the output for a stream of about `bytes` bytes.
    pub fn reserve_for(&mut self, bytes: usize) {
        self.hashes.reserve(bytes / self.block + 1);
    }

    pub fn write(&mut self, mut data: &[u8]) {
        if !self.buf.is_empty() {
            let take = (self.block - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == self.block {
                self.prev = link(self.prev, &self.buf);
                self.hashes.push(self.prev);
                self.buf.clear();
            }
        }
        let mut chunks = data.chunks_exact(self.block);
        for chunk in &mut chunks {
            self.prev = link(self.prev, chunk);
            self.hashes.push(self.prev);
        }
        self.buf.extend_from_slice(chunks.remainder());
    }

    /// How many full blocks have been hashed so far.
    pub fn full_blocks(&self) -> usize {
        self.hashes.len()
    }

    /// Hashes of the full blocks. A trailing partial block is not hashed: it can still change
    /// as the conversation grows, so it names no stable prefix.
    pub fn finish(self) -> Vec<u64> {
        self.hashes
    }

    /// The full blocks' hashes, and where the stream stands after them (to be continued).
    pub fn split(self) -> (Vec<u64>, BlockTail) {
        let tail = BlockTail {
            block: self.block,
            buf: self.buf,
            prev: self.prev,
        };
        (self.hashes, tail)
    }
}

/// A block hasher's state past its last full block: what continuing the same stream needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTail {
    block: usize,
    buf: Vec<u8>,
    prev: u64,
}

impl BlockTail {
    /// The hashes of the stream continued with `parts`: `prefix` (the hashes the stream had
    /// at this tail) followed by those of the blocks the new bytes complete.
    pub fn continued(&self, prefix: &[u64], parts: &[&[u8]]) -> Vec<u64> {
        let mut h = BlockHasher {
            block: self.block,
            buf: self.buf.clone(),
            prev: self.prev,
            hashes: Vec::with_capacity(prefix.len() + 1),
        };
        h.hashes.extend_from_slice(prefix);
        for p in parts {
            h.write(p);
        }
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hash_all(data: &[u8], block: usize) -> Vec<u64> {
        let mut h = BlockHasher::new(block);
        h.write(data);
        h.finish()
    }

    #[test]
    fn full_blocks_only() {
        assert_eq!(hash_all(&[7u8; 255], 256).len(), 0);
        assert_eq!(hash_all(&[7u8; 256], 256).len(), 1);
        assert_eq!(hash_all(&[7u8; 1000], 256).len(), 3);
    }

    #[test]
    fn chained_not_positional() {
        // Identical block bytes at different depths get different hashes.
        let h = hash_all(&[1u8; 512], 256);
        assert_ne!(h[0], h[1]);
    }

    proptest! {
        #[test]
        fn split_invariant(data in proptest::collection::vec(any::<u8>(), 0..3000),
                           cuts in proptest::collection::vec(0usize..3000, 0..8)) {
            let whole = hash_all(&data, 64);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.sort_unstable();
            let mut h = BlockHasher::new(64);
            let mut at = 0;
            for c in cuts {
                h.write(&data[at..c]);
                at = c;
            }
            h.write(&data[at..]);
            prop_assert_eq!(h.finish(), whole);
        }

        #[test]
        fn prefix_stable(a in proptest::collection::vec(any::<u8>(), 0..2000),
                         b in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let short = hash_all(&a, 64);
            let mut longer = a.clone();
            longer.extend_from_slice(&b);
            let long = hash_all(&longer, 64);
            prop_assert_eq!(&long[..short.len()], &short[..]);
        }
    }
}
