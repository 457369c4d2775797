//! The noise of a row is a function of (seed, step, row) alone.

use dice_train::data::CleanRow;
use dice_train::noise::{Noiser, NOISE_EPS};

const MASK: u32 = 151669;

/// Two samples of 8 tokens (4 prompt, 4 response) and 4 row pads.
fn clean_row() -> CleanRow {
    let sample = |base: u32| -> (Vec<u32>, Vec<i64>) {
        let ids: Vec<u32> = (base..base + 8).collect();
        let labels = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| if i < 4 { -100 } else { i64::from(id) })
            .collect();
        (ids, labels)
    };
    let (a, a_labels) = sample(100);
    let (b, b_labels) = sample(200);
    CleanRow {
        input_ids: [a, b, vec![0; 4]].concat(),
        labels: [a_labels, b_labels, vec![-100; 4]].concat(),
        position_ids: [(0..8).collect(), (0..8).collect(), vec![0; 4]].concat(),
    }
}

#[test]
fn the_same_seed_step_and_row_give_the_same_noise_whatever_was_drawn_before() {
    let noiser = Noiser::new(1234, MASK);
    let alone = noiser.noise(clean_row(), 5, 3);
    // Drawing other rows and steps first changes nothing.
    for row in 0..3 {
        noiser.noise(clean_row(), 5, row);
        noiser.noise(clean_row(), 4, 3);
    }
    let again = noiser.noise(clean_row(), 5, 3);
    assert_eq!(alone.noisy_ids, again.noisy_ids);
    assert_eq!(alone.masked_positions, again.masked_positions);
    assert_eq!(alone.p_mask, again.p_mask);
}

#[test]
fn another_seed_step_or_row_gives_other_noise() {
    let noise = |seed, step, row| {
        let noised = Noiser::new(seed, MASK).noise(clean_row(), step, row);
        (noised.masked_positions, noised.p_mask)
    };
    let base = noise(1, 0, 0);
    assert_ne!(base, noise(2, 0, 0));
    assert_ne!(base, noise(1, 1, 0));
    assert_ne!(base, noise(1, 0, 1));
}

#[test]
fn each_sample_has_one_noise_level_and_only_responses_are_masked() {
    for step in 0..50 {
        let noised = Noiser::new(9, MASK).noise(clean_row(), step, 0);
        assert!(!noised.masked_positions.is_empty());
        let mut level_of_sample = [None, None];
        for (&i, &p) in noised.masked_positions.iter().zip(&noised.p_mask) {
            assert_ne!(noised.labels[i], -100);
            assert_eq!(noised.noisy_ids[i], MASK);
            assert!((NOISE_EPS..=1.0).contains(&p));
            let level = level_of_sample[i / 8].get_or_insert(p);
            assert_eq!(*level, p, "one p per sample");
        }
        let unmasked = (0..20).filter(|i| !noised.masked_positions.contains(i));
        for i in unmasked {
            assert_eq!(noised.noisy_ids[i], noised.input_ids[i]);
        }
    }
}
