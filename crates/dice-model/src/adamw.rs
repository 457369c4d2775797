//! The f32 scalars of one AdamW step: what dice-train's host update and the AdamW kernel of CUDA
//! builds (`kernels/optim.rs`, [`crate::adamw_step`]) both take, running the same operations
//! with them.

/// The f32 scalars of one AdamW step (torch's single-tensor AdamW: the f64 scalars rounded to
/// f32 as its kernels receive them).
#[derive(Debug, Clone, Copy)]
pub struct AdamWScalars {
    /// What multiplies every gradient as the update reads it (`g ← g·c + 0` in f32: gradient
    /// clipping's coefficient, applied in the update's pass instead of one of its own), when the
    /// gradients are scaled.
    pub grad_factor: Option<f32>,
    /// `1 − lr·wd`, when there is weight decay.
    pub decay: Option<f32>,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `√(1 − β2ᵗ)`.
    pub bias_correction2_sqrt: f32,
    pub eps: f32,
    /// `−lr / (1 − β1ᵗ)`.
    pub neg_step_size: f32,
}
