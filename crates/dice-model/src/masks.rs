//! Attention masks of spec §3 as predicates, and the additive f32 tensors built from them
//! (0 where attention is allowed, -inf where it is not). A mask tensor never carries a head
//! dimension: it is broadcast over heads.

use candle_core::{Device, Result, Tensor};

/// Block-causal attention among `t` tokens that start on a block boundary (spec §3.2): a token
/// of block b sees every token of blocks <= b.
pub fn block_causal_allowed(query: usize, key: usize, block_size: usize) -> bool {
    key / block_size <= query / block_size
}

/// The two-stream SFT mask of spec §3.1 for one sample of `n` tokens laid out as
/// [noisy (n) ⧺ clean (n)]; `query` and `key` index that 2n-long layout.
pub fn two_stream_allowed(query: usize, key: usize, n: usize, block_size: usize) -> bool {
    let (q_noisy, k_noisy) = (query < n, key < n);
    let q_block = (query % n) / block_size;
    let k_block = (key % n) / block_size;
    match (q_noisy, k_noisy) {
        (true, true) => q_block == k_block,
        (true, false) => k_block < q_block,
        (false, true) => false,
        (false, false) => k_block <= q_block,
    }
}

/// Additive [rows, cols] f32 mask from a predicate.
fn additive_mask(
    rows: usize,
    cols: usize,
    allowed: impl Fn(usize, usize) -> bool,
    device: &Device,
) -> Result<Tensor> {
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| {
            if allowed(i / cols, i % cols) {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    Tensor::from_vec(data, (rows, cols), device)
}

/// [2n, 2n] additive two-stream mask of one SFT sample.
pub fn two_stream_mask(n: usize, block_size: usize, device: &Device) -> Result<Tensor> {
    additive_mask(
        2 * n,
        2 * n,
        |q, k| two_stream_allowed(q, k, n, block_size),
        device,
    )
}

/// Mask for `t` new tokens (a multiple of the block size) appended to cached rows of lengths
/// `lens` (each a multiple of the block size). Key slot s of row i holds cached K/V for
/// s < lens[i] and the new token s - lens[i] for lens[i] <= s < lens[i] + t; the key axis has
/// max(lens) + t slots. A new token sees the whole cached prefix of its row and the new tokens
/// of its own and earlier blocks.
///
/// Returns `None` when nothing is masked (equal lengths and a single block: every decoding
/// step of a batch in lock-step, and always at batch size 1), else a tensor of shape
/// [1, 1, 1, t, S] when all rows have the same length or [B, 1, 1, t, S] otherwise, laid out
/// to broadcast over [batch, kv_heads, query_groups, t, S] attention scores.
pub fn cached_block_mask(
    lens: &[usize],
    t: usize,
    block_size: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let uniform = lens.iter().all(|&l| l == max_len);
    if uniform && t <= block_size {
        return Ok(None);
    }
    let slots = max_len + t;
    let row_mask = |len: usize| {
        additive_mask(
            t,
            slots,
            |q, s| s < len || (s < len + t && block_causal_allowed(q, s - len, block_size)),
            device,
        )
    };
    let mask = if uniform {
        row_mask(max_len)?.unsqueeze(0)?
    } else {
        let rows = lens
            .iter()
            .map(|&l| row_mask(l))
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&rows, 0)?
    };
    Ok(Some(mask.unsqueeze(1)?.unsqueeze(1)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(rows: usize, cols: usize, allowed: impl Fn(usize, usize) -> bool) -> Vec<String> {
        (0..rows)
            .map(|q| {
                (0..cols)
                    .map(|k| if allowed(q, k) { '1' } else { '.' })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn two_stream_mask_is_the_spec_table() {
        // spec §3.1, n = 8, block 4: rows N0..N7 then C0..C7, columns noisy | clean.
        let expected: Vec<String> = [
            ["1111....", "........"],
            ["....1111", "1111...."],
            ["........", "1111...."],
            ["........", "11111111"],
        ]
        .iter()
        .flat_map(|[noisy, clean]| std::iter::repeat_n(format!("{noisy}{clean}"), 4))
        .collect();
        assert_eq!(
            render(16, 16, |q, k| two_stream_allowed(q, k, 8, 4)),
            expected
        );
    }

    #[test]
    fn prefill_mask_is_lower_block_triangular() {
        let expected: Vec<String> = ["1111....", "11111111"]
            .iter()
            .flat_map(|r| std::iter::repeat_n(r.to_string(), 4))
            .collect();
        assert_eq!(render(8, 8, |q, k| block_causal_allowed(q, k, 4)), expected);
        let mask = cached_block_mask(&[0], 8, 4, &Device::Cpu)
            .unwrap()
            .unwrap();
        let values = mask
            .squeeze(0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let rendered: Vec<String> = values
            .iter()
            .map(|row| {
                row.iter()
                    .map(|&v| if v == 0.0 { '1' } else { '.' })
                    .collect()
            })
            .collect();
        assert_eq!(rendered, expected);
    }

    #[test]
    fn two_stream_tensor_matches_predicate() {
        let mask = two_stream_mask(8, 4, &Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (q, row) in mask.iter().enumerate() {
            for (k, &v) in row.iter().enumerate() {
                assert_eq!(v == 0.0, two_stream_allowed(q, k, 8, 4));
                assert!(v == 0.0 || v == f32::NEG_INFINITY);
            }
        }
    }

    #[test]
    fn decoding_masks() {
        // Lock-step single block: nothing to mask.
        assert!(cached_block_mask(&[8, 8], 4, 4, &Device::Cpu)
            .unwrap()
            .is_none());
        // Rows with 8 and 4 cached positions, one block: row 1 must not see slots 4..8 of the
        // cache part (they belong to nobody) but sees its new block at slots 4..8.
        let mask = cached_block_mask(&[8, 4], 4, 4, &Device::Cpu)
            .unwrap()
            .unwrap();
        assert_eq!(mask.dims(), &[2, 1, 1, 4, 12]);
        let rows = mask
            .squeeze(1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .to_vec3::<f32>()
            .unwrap();
        let seen = |r: usize| -> String {
            rows[r][0]
                .iter()
                .map(|&v| if v == 0.0 { '1' } else { '.' })
                .collect()
        };
        assert_eq!(seen(0), "111111111111");
        assert_eq!(seen(1), "11111111....");
    }
}
