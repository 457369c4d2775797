//! Group-relative advantages (spec bicrl §7, `z_score_normalize` of the reference's reward
//! script): every task is rolled out several times, and each response's reward is
//! standardised within its task's group.

/// The z-scores of one group's rewards: `(r − μ) / σ` with the population standard deviation
/// σ = √(mean((r − μ)²)), or all zeros when σ = 0, computed in f64 as the reference's Python
/// floats are.
pub fn z_scores(rewards: &[f64]) -> Vec<f64> {
    if rewards.is_empty() {
        return Vec::new();
    }
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    if std == 0.0 {
        return vec![0.0; rewards.len()];
    }
    rewards.iter().map(|r| (r - mean) / std).collect()
}

/// The advantages of one task's group, or `None` when they are all zero (every response
/// equally right or wrong): such a group carries no learning signal and the reference drops
/// it from the training data.
pub fn group_advantages(rewards: &[f64]) -> Option<Vec<f64>> {
    let advantages = z_scores(rewards);
    advantages.iter().any(|&a| a != 0.0).then_some(advantages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn population_std_and_zero_variance_groups() {
        assert_eq!(z_scores(&[1.0, 0.0]), [1.0, -1.0]);
        let a = z_scores(&[1.0, 0.0, 0.0, 0.0]);
        // σ = √(3/16): the single success gets 0.75/σ = √3.
        assert!((a[0] - 3f64.sqrt()).abs() < 1e-12);
        assert!((a[1] + 1.0 / 3f64.sqrt()).abs() < 1e-12);
        assert_eq!(group_advantages(&[1.0, 1.0]), None);
        assert_eq!(group_advantages(&[0.0, 0.0, 0.0]), None);
        assert_eq!(group_advantages(&[0.0, 1.0]), Some(vec![-1.0, 1.0]));
    }
}
