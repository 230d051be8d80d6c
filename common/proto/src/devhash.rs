//! gpusnap-sum64: the chunk hash the agent computes on the GPU, defined here once for every
//! side that must agree on it (the agent's kernel `cuda-backend/agent/src/devhash/sum64.ptx`, built from
//! `gpu/devhash/sum64.cu`; the stand-in driver that plays that kernel in CI; `gpusnap verify`'s
//! host pass). `docs/image-format.md` ("Device hash") states the same in words.
//!
//! For the 8-byte little-endian words `w[0..n)` of a chunk of `len = 8n` bytes:
//! `sum = Σ fmix64(w[i] ^ i·K) mod 2^64`, `any = OR of all w[i]`, and the recorded hash is
//! [`finish`]`(sum, len) = fmix64(sum ^ fmix64(len + K))`. `fmix64` is MurmurHash3's 64-bit
//! finalizer, a bijection, so one changed word always changes the sum; the position term makes
//! moved words count. An integrity check against damage, not a defence against forgery. The
//! sum is order-free, so the GPU adds in any order; `any == 0` means the chunk is all zeros.

/// The position multiplier (2^64 / golden ratio).
pub const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// MurmurHash3's 64-bit finalizer.
pub const fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// What the kernel leaves in its two output words for one chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sum64Parts {
    pub sum: u64,
    pub any: u64,
}

impl Sum64Parts {
    /// Adds words `w` whose first has index `first` in the chunk (a trailing part of `w` shorter
    /// than a word is ignored).
    ///
    /// Four independent lanes, and the position term `i·K` kept as a running sum instead of a
    /// multiply: 1.3–1.4× the word-at-a-time loop on the host that checks a parent image (the
    /// check runs beside the job's pause). The result is the same sum, whatever the split.
    pub fn add_words(&mut self, first: u64, w: &[u8]) {
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let mut ik = first.wrapping_mul(K);
        let (k2, k3, k4) = (K.wrapping_mul(2), K.wrapping_mul(3), K.wrapping_mul(4));
        let mut sums = [0u64; 4];
        let (mut any_a, mut any_b) = (0u64, 0u64);
        let mut quads = w.chunks_exact(32);
        for q in &mut quads {
            let (x0, x1, x2, x3) = (
                word(&q[..8]),
                word(&q[8..16]),
                word(&q[16..24]),
                word(&q[24..]),
            );
            any_a |= x0 | x1;
            any_b |= x2 | x3;
            sums[0] = sums[0].wrapping_add(fmix64(x0 ^ ik));
            sums[1] = sums[1].wrapping_add(fmix64(x1 ^ ik.wrapping_add(K)));
            sums[2] = sums[2].wrapping_add(fmix64(x2 ^ ik.wrapping_add(k2)));
            sums[3] = sums[3].wrapping_add(fmix64(x3 ^ ik.wrapping_add(k3)));
            ik = ik.wrapping_add(k4);
        }
        for b in quads.remainder().chunks_exact(8) {
            let x = word(b);
            any_a |= x;
            sums[0] = sums[0].wrapping_add(fmix64(x ^ ik));
            ik = ik.wrapping_add(K);
        }
        self.any |= any_a | any_b;
        self.sum = sums.iter().fold(self.sum, |acc, &s| acc.wrapping_add(s));
    }
}

/// The recorded device hash of a chunk of `len` bytes from its kernel outputs.
pub const fn finish(sum: u64, len: u64) -> u64 {
    fmix64(sum ^ fmix64(len.wrapping_add(K)))
}

/// The device hash of `bytes` computed on the host, or `None` when the length is not a
/// multiple of 8 (the agent hashes no such chunk on the GPU).
pub fn device_hash(bytes: &[u8]) -> Option<u64> {
    if !bytes.len().is_multiple_of(8) {
        return None;
    }
    let mut p = Sum64Parts::default();
    p.add_words(0, bytes);
    Some(finish(p.sum, bytes.len() as u64))
}

/// The device hash of `len` zero bytes, without touching memory (every word is 0, so the sum
/// is `Σ fmix64(i·K)`, which still needs the loop).
pub fn zero_hash(len: u64) -> Option<u64> {
    zero_hashes(&[len])[0].1
}

/// [`zero_hash`] of every length in `lens`, as (length, hash) in ascending order of length
/// without repeats, from one running sum up to the largest: however many lengths, the cost is
/// that of the longest.
pub fn zero_hashes(lens: &[u64]) -> Vec<(u64, Option<u64>)> {
    let mut sorted = lens.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let (mut words, mut sum) = (0u64, 0u64);
    sorted
        .into_iter()
        .map(|len| {
            while words < len / 8 {
                sum = sum.wrapping_add(fmix64(words.wrapping_mul(K)));
                words += 1;
            }
            (len, len.is_multiple_of(8).then(|| finish(sum, len)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fmix64_is_murmur3s_finalizer() {
        assert_eq!(fmix64(0), 0);
        // Computed independently with arbitrary-precision integers (Python).
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
    }

    #[test]
    fn one_changed_or_moved_word_changes_the_hash() {
        let mut a = vec![0u8; 4096];
        for (i, b) in a.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let h = device_hash(&a).unwrap();
        let mut b = a.clone();
        b[100] ^= 1;
        assert_ne!(device_hash(&b).unwrap(), h);
        let mut c = a.clone();
        c.copy_within(0..8, 8);
        c[..8].copy_from_slice(&a[8..16]);
        assert_ne!(device_hash(&c).unwrap(), h, "two words swapped");
        assert_eq!(device_hash(&a[..4095]), None);
        assert_ne!(device_hash(&a[..4088]).unwrap(), h, "the length counts");
    }

    /// The definition word by word, as the module's comment states it.
    fn reference(first: u64, w: &[u8]) -> Sum64Parts {
        let mut p = Sum64Parts::default();
        for (j, b) in w.chunks_exact(8).enumerate() {
            let x = u64::from_le_bytes(b.try_into().unwrap());
            p.any |= x;
            p.sum = p
                .sum
                .wrapping_add(fmix64(x ^ (first + j as u64).wrapping_mul(K)));
        }
        p
    }

    #[test]
    fn the_four_lane_sum_is_the_definition() {
        let data: Vec<u8> = (0..4133u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        // Every length around the 32-byte step, odd tails and offsets included.
        for len in (0..300).chain([4096, 4128, 4133]) {
            for first in [0u64, 1, 3, 511, u64::MAX / K] {
                let mut got = Sum64Parts::default();
                got.add_words(first, &data[..len]);
                assert_eq!(
                    got,
                    reference(first, &data[..len]),
                    "len {len}, first {first}"
                );
            }
        }
    }

    #[test]
    fn parts_add_up_in_any_split() {
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 256) as u8).collect();
        let mut whole = Sum64Parts::default();
        whole.add_words(0, &data);
        let mut split = Sum64Parts::default();
        split.add_words(512, &data[4096..]);
        split.add_words(0, &data[..4096]);
        assert_eq!(whole, split);
        assert_eq!(zero_hash(4096), device_hash(&[0u8; 4096]));
        let many = zero_hashes(&[4096, 8, 4096, 12, 64]);
        assert_eq!(
            many,
            vec![
                (8, device_hash(&[0u8; 8])),
                (12, None),
                (64, device_hash(&[0u8; 64])),
                (4096, device_hash(&[0u8; 4096])),
            ]
        );
        let mut z = Sum64Parts::default();
        z.add_words(0, &[0u8; 64]);
        assert_eq!(z.any, 0);
    }
}
