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

/// Additive [rows, cols] f32 mask from a predicate: 0 where `allowed(row, col)`, else -inf.
pub fn additive_mask(
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

/// The keys each query of a packed sequence sees, as two half-open ranges per query
/// (`[s0, s1) ∪ [s2, s3)`, an empty range as `[0, 0)`), with their hulls per tile of 64
/// queries: the visibility the fused training attention takes instead of a mask tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpans {
    rows: Vec<[u32; 4]>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl KeySpans {
    /// Queries per tile of the training attention kernels (`TILE` of `train_attention.cu`).
    pub(crate) const TILE: usize = 64;

    /// The two-stream SFT mask (`masks::two_stream_allowed`) of samples of `sample_lens`
    /// tokens, packed one after another as [noisy ⧺ clean] segments of 2n positions.
    pub(crate) fn two_stream(sample_lens: &[usize], block_size: usize) -> Self {
        let mut rows = Vec::with_capacity(2 * sample_lens.iter().sum::<usize>());
        for &n in sample_lens {
            let start = rows.len() as u32;
            let (n32, bs) = (n as u32, block_size as u32);
            for i in 0..2 * n32 {
                rows.push(if i < n32 {
                    // Its own noisy block, and the clean blocks before it.
                    let b = i / bs;
                    [
                        start + b * bs,
                        start + ((b + 1) * bs).min(n32),
                        start + n32,
                        start + n32 + b * bs,
                    ]
                } else {
                    // The clean blocks up to its own.
                    let b = (i - n32) / bs;
                    [start + n32, start + n32 + ((b + 1) * bs).min(n32), 0, 0]
                });
            }
        }
        Self { rows }
    }

    /// The visibility `visible(query, key)` of `n` tokens as key ranges, or `None` when some
    /// query's visible keys do not form at most two ranges (the caller then keeps a mask).
    pub fn from_predicate(n: usize, visible: impl Fn(usize, usize) -> bool) -> Option<Self> {
        let mut rows = Vec::with_capacity(n);
        for query in 0..n {
            let mut ranges = [0u32; 4];
            let mut found = 0;
            let mut key = 0;
            while key < n {
                if !visible(query, key) {
                    key += 1;
                    continue;
                }
                let begin = key;
                while key < n && visible(query, key) {
                    key += 1;
                }
                if found == 2 {
                    return None;
                }
                ranges[2 * found] = begin as u32;
                ranges[2 * found + 1] = key as u32;
                found += 1;
            }
            rows.push(ranges);
        }
        Some(Self { rows })
    }

    /// Sequences of visibilities `parts` packed one after another into one sequence, each
    /// seeing only its own keys: a query of part i sees the keys it saw there, shifted by the
    /// tokens of the parts before it (empty ranges stay `[0, 0)`).
    pub fn packed(parts: &[&KeySpans]) -> Self {
        let mut rows = Vec::with_capacity(parts.iter().map(|p| p.tokens()).sum());
        for part in parts {
            let offset = rows.len() as u32;
            rows.extend(part.rows.iter().map(|row| {
                let shift = |begin: u32, end: u32| {
                    if begin < end {
                        [begin + offset, end + offset]
                    } else {
                        [0, 0]
                    }
                };
                let [a, b] = shift(row[0], row[1]);
                let [c, d] = shift(row[2], row[3]);
                [a, b, c, d]
            }));
        }
        Self { rows }
    }

    /// The queries' ranges, `[s0, s1, s2, s3]` each.
    pub fn rows(&self) -> &[[u32; 4]] {
        &self.rows
    }

    /// Queries (and keys) of the sequence.
    pub fn tokens(&self) -> usize {
        self.rows.len()
    }

    /// Per tile of [`TILE`] queries, `[hull, core]`: the hull of its rows' first ranges and of
    /// their second ranges, empty ranges left out (`[0, 0)` when all are empty), then the keys
    /// every row of the tile sees in its first range and in its second (the ranges'
    /// intersections, `[0, 0)` when empty). The kernels skip key tiles outside the hull and
    /// drop the per-key visibility test on key tiles inside a core.
    pub(crate) fn tile_bounds(&self) -> Vec<[u32; 8]> {
        self.rows
            .chunks(Self::TILE)
            .map(|tile| {
                let mut bounds = [0u32; 8];
                for i in 0..2 {
                    let range = |row: &[u32; 4]| (row[2 * i], row[2 * i + 1]);
                    let hull = tile
                        .iter()
                        .map(range)
                        .filter(|(begin, end)| begin < end)
                        .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)));
                    if let Some((begin, end)) = hull {
                        bounds[2 * i] = begin;
                        bounds[2 * i + 1] = end;
                    }
                    let core = tile
                        .iter()
                        .map(range)
                        .reduce(|a, b| (a.0.max(b.0), a.1.min(b.1)));
                    if let Some((begin, end)) = core.filter(|(begin, end)| begin < end) {
                        bounds[4 + 2 * i] = begin;
                        bounds[4 + 2 * i + 1] = end;
                    }
                }
                bounds
            })
            .collect()
    }

    /// The order in which the kernels take the tiles of a sequence of tile bounds `bounds`
    /// ([`KeySpans::tile_bounds`]), heaviest first (so that a grid's last CTAs are its
    /// lightest, not a few long ones on otherwise idle SMs): `[query tiles, key tiles]`, the
    /// query tiles by how many key tiles their hulls meet (the forward's and dQ's work), the
    /// key tiles by how many query tiles meet them (dK/dV's); ties by index.
    pub(crate) fn tile_orders(bounds: &[[u32; 8]]) -> [Vec<u32>; 2] {
        let tiles = bounds.len();
        let meets = |hull: &[u32; 8], key_tile: usize| {
            let (first, end) = (key_tile * Self::TILE, (key_tile + 1) * Self::TILE);
            (0..2).any(|i| {
                let (begin, stop) = (hull[2 * i] as usize, hull[2 * i + 1] as usize);
                begin < stop && begin < end && stop > first
            })
        };
        let mut query_work = vec![0usize; tiles];
        let mut key_work = vec![0usize; tiles];
        for (query_tile, hull) in bounds.iter().enumerate() {
            for (key_tile, work) in key_work.iter_mut().enumerate() {
                if meets(hull, key_tile) {
                    query_work[query_tile] += 1;
                    *work += 1;
                }
            }
        }
        [query_work, key_work].map(|work| {
            let mut order: Vec<u32> = (0..tiles as u32).collect();
            order.sort_by_key(|&t| std::cmp::Reverse(work[t as usize]));
            order
        })
    }

    /// The numbers of the (query tile, key tile) pairs that the training attention computes,
    /// for tile bounds `bounds` ([`KeySpans::tile_bounds`]) of `tokens` queries: pairs whose key
    /// tile meets either hull (`next_visible_key_tile` of `train_attention.cu`, the last key tile
    /// ending at `tokens`), numbered query tile by query tile in key order, at
    /// `[query tile * tiles + key tile]` (`u32::MAX` for the others); and how many. The
    /// backward that keeps dS stores each pair's dS tile at its number.
    pub(crate) fn tile_pairs(bounds: &[[u32; 8]], tokens: usize) -> (Vec<u32>, usize) {
        let tiles = bounds.len();
        let mut index = vec![u32::MAX; tiles * tiles];
        let mut pairs = 0;
        for (query_tile, hull) in bounds.iter().enumerate() {
            for key_tile in 0..tiles {
                let first = (key_tile * Self::TILE) as i64;
                let end = ((key_tile + 1) * Self::TILE).min(tokens) as i64;
                let meets =
                    |i: usize| (hull[2 * i] as i64) < end && (hull[2 * i + 1] as i64) > first;
                if meets(0) || meets(1) {
                    index[query_tile * tiles + key_tile] = pairs as u32;
                    pairs += 1;
                }
            }
        }
        (index, pairs)
    }

    /// Whether query `query` sees key `key`.
    pub fn sees(&self, query: usize, key: usize) -> bool {
        let [a0, a1, b0, b1] = self.rows[query].map(|x| x as usize);
        (a0..a1).contains(&key) || (b0..b1).contains(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_spans_see_each_part_alone() {
        let causal = |n: usize| KeySpans::from_predicate(n, |q, k| k <= q).unwrap();
        let gapped =
            KeySpans::from_predicate(5, |q, k| k == 0 || (k >= 3 && k <= q.max(3))).unwrap();
        let parts = [causal(3), gapped.clone(), causal(2)];
        let packed = KeySpans::packed(&parts.iter().collect::<Vec<_>>());
        assert_eq!(packed.tokens(), 10);
        let starts = [0, 3, 8, 10];
        for (i, part) in parts.iter().enumerate() {
            for query in starts[i]..starts[i + 1] {
                for key in 0..10 {
                    let own = (starts[i]..starts[i + 1]).contains(&key)
                        && part.sees(query - starts[i], key - starts[i]);
                    assert_eq!(packed.sees(query, key), own, "query {query} key {key}");
                }
            }
        }
        // A part's empty second range stays empty rather than becoming [offset, offset).
        assert_eq!(packed.rows()[8], [8, 9, 0, 0]);
    }

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

    #[test]
    fn two_stream_spans_are_the_two_stream_mask() {
        for (lens, block) in [(vec![8], 4), (vec![5, 12, 1], 4), (vec![9, 3], 2)] {
            let spans = KeySpans::two_stream(&lens, block);
            let mut start = 0;
            for &n in &lens {
                for q in 0..2 * n {
                    for key in 0..spans.tokens() {
                        let inside = (start..start + 2 * n).contains(&key);
                        let want = inside && two_stream_allowed(q, key - start, n, block);
                        assert_eq!(spans.sees(start + q, key), want, "{lens:?} q {q} k {key}");
                    }
                }
                start += 2 * n;
            }
        }
    }

    #[test]
    fn spans_from_a_predicate_are_the_predicate_or_nothing() {
        let (n, block) = (13, 4);
        let two_stream = |q: usize, k: usize| two_stream_allowed(q, k, n, block);
        let from = KeySpans::from_predicate(2 * n, two_stream).unwrap();
        for q in 0..2 * n {
            for k in 0..2 * n {
                assert_eq!(from.sees(q, k), two_stream(q, k), "q {q} k {k}");
            }
        }
        // Block-causal rows with the even keys hidden see more than two ranges.
        let gappy = |q: usize, k: usize| block_causal_allowed(q, k, block) && k.is_multiple_of(2);
        assert_eq!(KeySpans::from_predicate(9, gappy), None);
        // Left padding hidden from every row: still two ranges at most.
        let padded = |q: usize, k: usize| (k >= 3 && block_causal_allowed(q, k, block)) || k == q;
        let spans = KeySpans::from_predicate(12, padded).unwrap();
        for q in 0..12 {
            for k in 0..12 {
                assert_eq!(spans.sees(q, k), padded(q, k), "q {q} k {k}");
            }
        }
    }

    #[test]
    fn tile_orders_are_permutations_heaviest_first() {
        let spans = KeySpans::two_stream(&[100, 30, 300], 4);
        let bounds = spans.tile_bounds();
        let tiles = bounds.len();
        let meets = |query_tile: usize, key_tile: usize| {
            (key_tile * KeySpans::TILE..(key_tile + 1) * KeySpans::TILE).any(|key| {
                (0..2).any(|i| {
                    bounds[query_tile][2 * i] as usize <= key
                        && key < bounds[query_tile][2 * i + 1] as usize
                })
            })
        };
        let [query_order, key_order] = KeySpans::tile_orders(&bounds);
        let work_of_query = |t: u32| (0..tiles).filter(|&k| meets(t as usize, k)).count();
        let work_of_key = |k: u32| (0..tiles).filter(|&t| meets(t, k as usize)).count();
        for (order, work) in [
            (&query_order, &work_of_query as &dyn Fn(u32) -> usize),
            (&key_order, &work_of_key),
        ] {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..tiles as u32).collect::<Vec<_>>());
            let works: Vec<usize> = order.iter().map(|&t| work(t)).collect();
            assert!(works.windows(2).all(|w| w[0] >= w[1]), "{works:?}");
            assert!(works[0] > works[works.len() - 1], "{works:?}");
        }
    }

    #[test]
    fn tile_pairs_number_the_tile_pairs_whose_keys_meet_the_hulls_in_order() {
        let spans = KeySpans::two_stream(&[100, 30, 9], 4);
        let bounds = spans.tile_bounds();
        let tiles = bounds.len();
        let (index, pairs) = KeySpans::tile_pairs(&bounds, spans.tokens());
        let meets = |query_tile: usize, key_tile: usize| {
            (key_tile * KeySpans::TILE..(key_tile + 1) * KeySpans::TILE).any(|key| {
                (0..2).any(|i| {
                    bounds[query_tile][2 * i] as usize <= key
                        && key < bounds[query_tile][2 * i + 1] as usize
                })
            })
        };
        let mut next = 0;
        for query_tile in 0..tiles {
            for key_tile in 0..tiles {
                let number = index[query_tile * tiles + key_tile];
                if meets(query_tile, key_tile) {
                    assert_eq!(number, next, "query tile {query_tile} key tile {key_tile}");
                    next += 1;
                } else {
                    assert_eq!(
                        number,
                        u32::MAX,
                        "query tile {query_tile} key tile {key_tile}"
                    );
                }
            }
        }
        assert_eq!(pairs, next as usize);
        // Every key a query sees lies in a numbered pair.
        for query in 0..spans.tokens() {
            for key in (0..spans.tokens()).filter(|&key| spans.sees(query, key)) {
                let (query_tile, key_tile) = (query / KeySpans::TILE, key / KeySpans::TILE);
                assert_ne!(index[query_tile * tiles + key_tile], u32::MAX);
            }
        }
        assert!(pairs < tiles * tiles, "no pair skipped: {pairs}");
    }

    #[test]
    fn tile_bounds_cover_every_key_their_queries_see_and_cores_only_keys_all_see() {
        let spans = KeySpans::two_stream(&[100, 30], 4);
        let bounds = spans.tile_bounds();
        assert_eq!(bounds.len(), 260usize.div_ceil(KeySpans::TILE));
        for (query, row) in spans.rows.iter().enumerate() {
            let tile = bounds[query / KeySpans::TILE];
            for i in 0..2 {
                if row[2 * i] < row[2 * i + 1] {
                    assert!(tile[2 * i] <= row[2 * i] && row[2 * i + 1] <= tile[2 * i + 1]);
                }
                for key in tile[4 + 2 * i]..tile[4 + 2 * i + 1] {
                    assert!(spans.sees(query, key as usize), "query {query} key {key}");
                }
            }
        }
        // The first tile (noisy queries 0..63 of the first sample) never needs the noisy keys
        // past its own blocks; its rows' noisy blocks differ, and row 0 sees no clean key.
        assert_eq!(bounds[0], [0, 64, 100, 100 + 60, 0, 0, 0, 0]);
        // Clean queries 128..191 of the first sample (blocks 7..22) all see its clean blocks
        // 0..7 (keys 100..132).
        assert_eq!(bounds[2][4..], [100, 132, 0, 0]);
    }
}
