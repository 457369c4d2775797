//! How many masked positions each denoising step of a block unmasks (spec §4.5).

/// `num_transfer[s] = ⌊B/S⌋ + [s < B mod S]` for `s = 0..S`, B = block length, S = steps
/// (`get_num_transfer_tokens` of the reference). The entries sum to `block_length`.
pub fn transfer_schedule(block_length: usize, steps: usize) -> Vec<usize> {
    let base = block_length / steps;
    let extra = block_length % steps;
    (0..steps).map(|s| base + usize::from(s < extra)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_of_spec_section_8() {
        assert_eq!(transfer_schedule(4, 4), vec![1, 1, 1, 1]);
        assert_eq!(transfer_schedule(8, 4), vec![2, 2, 2, 2]);
        assert_eq!(transfer_schedule(5, 4), vec![2, 1, 1, 1]);
    }

    #[test]
    fn schedule_sums_to_block_length() {
        for block in 1..20 {
            for steps in 1..10 {
                let s = transfer_schedule(block, steps);
                assert_eq!(s.len(), steps);
                assert_eq!(
                    s.iter().sum::<usize>(),
                    block,
                    "block {block} steps {steps}"
                );
                assert!(s.windows(2).all(|w| w[0] >= w[1]));
            }
        }
    }
}
