//! The element-wise steps of the hand-written training layer and loss head
//! (`crate::sdar`'s `training::fused_layer`), as a trait: on CUDA the fused kernels of
//! `crate::kernels::TrainLayer` implement it; the fused layer's CPU tests, a candle reference.

use candle_core::{Result, Tensor};

/// The element-wise steps of the fused layer and head, forward and backward. Tensors are 2-d
/// `[rows, width]` unless said otherwise; reciprocal RMS values and norm weights' gradients
/// are f32.
pub(crate) trait LayerOps {
    /// RMSNorm of the rows of `x` with weight `w`: the normed rows (rounded to the dtype) and
    /// the reciprocal RMS of every row, `[rows]`.
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)>;
    /// RMSNorm of `a + b` (rounded to the dtype): the sum, the normed rows and the reciprocal
    /// RMS of every row.
    fn add_rms_norm(
        &self,
        a: &Tensor,
        b: &Tensor,
        w: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor, Tensor)>;
    /// The backward of [`LayerOps::rms_norm`] for the output gradient `dy`: the input
    /// gradient plus `d_residual` (what reaches the input another way), and the weight's
    /// gradient.
    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        d_residual: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)>;
    /// `heads` heads out of the rows of `src` `[T, heads * head_dim]` (contiguous, or a narrow
    /// of wider rows) into `[1, heads, T, head_dim]`; with `norm` (q and k: the head norm's
    /// weight and the rotary tables cos, sin `[T, head_dim / 2]`) RMS-normed (rounded) and
    /// rotated, with the reciprocal RMS of every (token, head) row `[T * heads]`.
    fn heads_forward(
        &self,
        src: &Tensor,
        norm: Option<(&Tensor, [&Tensor; 2])>,
        heads: usize,
        eps: f64,
    ) -> Result<(Tensor, Option<Tensor>)>;
    /// The backward of [`LayerOps::heads_forward`] for the heads' gradient `d_heads`
    /// `[1, heads, T, head_dim]`: the gradient of `src` written into columns `column..column +
    /// heads * head_dim` of `d_rows` `[T, W]` (contiguous: the q, k and v gradients side by
    /// side, as the stacked projection's backward takes them, with no copy to join them), and
    /// with `norm` (weight, the forward's rstd, rotary tables) the norm weight's gradient.
    fn heads_backward(
        &self,
        d_heads: &Tensor,
        src: &Tensor,
        norm: Option<(&Tensor, &Tensor, [&Tensor; 2])>,
        d_rows: &Tensor,
        column: usize,
    ) -> Result<Option<Tensor>>;
    /// A contiguous buffer of `like`'s shape and dtype for `d_rows` of
    /// [`LayerOps::heads_backward`] when its calls write every column: zeros by default; the
    /// CUDA kernels leave it uninitialised (zeroing it would be a pass over it of its own).
    fn heads_gradient_rows(&self, like: &Tensor) -> Result<Tensor> {
        like.zeros_like()
    }
    /// SwiGLU of `gate_up` `[T, 2 I]` (gate in the first I columns): `T(T(silu(gate)) * up)`.
    fn swiglu(&self, gate_up: &Tensor) -> Result<Tensor>;
    /// The backward of [`LayerOps::swiglu`]: d gate_up `[T, 2 I]` from d act `[T, I]`.
    fn swiglu_backward(&self, gate_up: &Tensor, d_act: &Tensor) -> Result<Tensor>;
    /// The log-sum-exp of every row of `logits` `[rows, vocab]` (in f32) and log p(label) for
    /// u32 `labels` `[rows]`.
    fn label_log_softmax(&self, logits: &Tensor, labels: &Tensor) -> Result<(Tensor, Tensor)>;
    /// The logits' gradient `d_log_prob * (onehot(label) - softmax)` for f32 `d_log_prob`
    /// `[rows]`; `logits` is given up (the CUDA kernel writes the gradient over it).
    fn label_log_softmax_backward(
        &self,
        logits: Tensor,
        labels: &Tensor,
        lse: &Tensor,
        d_log_prob: &Tensor,
    ) -> Result<Tensor>;
    /// The gradient of a `[vocab, hidden]` embedding table whose rows `tokens` (one per
    /// position) were looked up, from their gradient `upstream` `[T, hidden]`: f32, every
    /// token's rows added in position order, as `index_add` into zeros adds them.
    fn embedding_backward(&self, tokens: &[u32], upstream: &Tensor, vocab: usize)
        -> Result<Tensor>;
    /// Adds `a`ᵀ `b` (`a` `[rows, m]`, `b` `[rows, n]`) to the f32 running sum `[m, n]` of a
    /// weight's gradient over row chunks, started at this product when `None`; by default
    /// candle's product in the operands' dtype, [`accumulate`]d.
    fn accumulate_at_b(&self, sum: &mut Option<Tensor>, a: &Tensor, b: &Tensor) -> Result<()> {
        accumulate(sum, &a.t()?.matmul(b)?)
    }
}

/// Adds a gradient contribution to an f32 running sum: a gradient made of several
/// contributions is summed in f32 and rounded to the weight dtype once.
pub(crate) fn accumulate(sum: &mut Option<Tensor>, grad: &Tensor) -> Result<()> {
    let grad = grad.to_dtype(candle_core::DType::F32)?;
    *sum = Some(match sum.take() {
        Some(s) => (s + grad)?,
        None => grad,
    });
    Ok(())
}

/// The positions of a sequence's tokens grouped by token, for an embedding table's gradient
/// summed one token at a time: `order`, the positions sorted by token (ascending within a
/// token); `unique`, the distinct tokens, ascending; `starts`, where each one's positions begin
/// in `order`, then their count.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TokenGroups {
    pub order: Vec<u32>,
    pub unique: Vec<u32>,
    pub starts: Vec<u32>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl TokenGroups {
    pub(crate) fn new(tokens: &[u32]) -> Self {
        let mut order: Vec<u32> = (0..tokens.len() as u32).collect();
        // Stable: a token's positions stay ascending.
        order.sort_by_key(|&position| tokens[position as usize]);
        let (mut unique, mut starts) = (Vec::new(), Vec::new());
        for (i, &position) in order.iter().enumerate() {
            let token = tokens[position as usize];
            if unique.last() != Some(&token) {
                unique.push(token);
                starts.push(i as u32);
            }
        }
        starts.push(order.len() as u32);
        Self {
            order,
            unique,
            starts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_groups_list_each_tokens_positions_in_order() {
        let groups = TokenGroups::new(&[7, 3, 7, 9, 3, 7]);
        assert_eq!(
            groups,
            TokenGroups {
                order: vec![1, 4, 0, 2, 5, 3],
                unique: vec![3, 7, 9],
                starts: vec![0, 2, 5, 6],
            }
        );
        let empty = TokenGroups::new(&[]);
        assert_eq!((empty.unique.len(), empty.starts), (0, vec![0]));
    }
}
