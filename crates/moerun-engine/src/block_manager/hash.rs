//! The identity of a full KV block for prefix caching: a hash chain, `hash(parent hash, the
//! block's token ids)`, so that equal hashes stand for equal *prefixes*, not merely equal blocks.
//!
//! The hash is only an index. [`super::BlockManager`] confirms every hit by comparing the block's
//! token ids and its parent's identity, so a collision costs a cache miss, never wrong KV. That
//! is what lets the default hasher be FNV-1a: tiny, fixed, and the same on every platform and
//! Rust version (unlike `std::hash::DefaultHasher`, whose algorithm is unspecified), which keeps
//! hashes stable in logs and leaves room for sharing them across processes later.

/// Computes the chain hash of one full block.
pub trait BlockHasher {
    /// The hash of a block holding `tokens` whose preceding blocks hash to `parent` (`None` for
    /// a sequence's first block).
    fn hash_block(&self, parent: Option<u64>, tokens: &[u32]) -> u64;
}

/// 64-bit FNV-1a over: one tag byte (0 = first block, 1 = has a parent), the parent hash as 8
/// little-endian bytes when there is one, then each token id as 4 little-endian bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fnv1a64;

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a_bytes(mut state: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        state ^= u64::from(b);
        state = state.wrapping_mul(FNV_PRIME);
    }
    state
}

impl BlockHasher for Fnv1a64 {
    fn hash_block(&self, parent: Option<u64>, tokens: &[u32]) -> u64 {
        // The tag keeps "no parent" distinct from "a parent that happens to hash to 0".
        let mut state = match parent {
            None => fnv1a_bytes(FNV_OFFSET_BASIS, &[0]),
            Some(p) => fnv1a_bytes(fnv1a_bytes(FNV_OFFSET_BASIS, &[1]), &p.to_le_bytes()),
        };
        for &t in tokens {
            state = fnv1a_bytes(state, &t.to_le_bytes());
        }
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // From the FNV reference: FNV-1a 64 of "" and of "a".
        assert_eq!(fnv1a_bytes(FNV_OFFSET_BASIS, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_bytes(FNV_OFFSET_BASIS, b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn block_hash_depends_on_parent_and_on_token_order() {
        let h = Fnv1a64;
        let a = h.hash_block(None, &[1, 2, 3]);
        assert_eq!(a, h.hash_block(None, &[1, 2, 3]), "deterministic");
        assert_ne!(a, h.hash_block(None, &[3, 2, 1]));
        assert_ne!(a, h.hash_block(Some(0), &[1, 2, 3]));
        assert_ne!(h.hash_block(Some(a), &[4]), h.hash_block(Some(a ^ 1), &[4]));
    }
}
