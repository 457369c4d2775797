/// The environment switches of CUDA decoding, for the help of every command that decodes.
macro_rules! cuda_decoding_env {
    () => {
        "Environment (binaries built with --features cuda):
  DICE_FUSED_ATTENTION=0           decode with candle's ops only (default: dice's fused kernels:
                                   q/k norm + rotary + KV write, block attention, residual +
                                   RMSNorm, SiLU x up)
  DICE_FUSED_ATTENTION=cuda-cores  the CUDA-core attention kernel for every dtype
  DICE_CUDA_GRAPHS=0               run every decoding forward op by op (default: captured once in a
                                   CUDA graph per KV cache and tokens per row, replayed at each step)
  DICE_DEVICE_SAMPLING=0           read sampled positions' logits back and draw on the host
                                   (default: one kernel draws tokens of the whole distribution)
On CUDA the engine always stacks the q/k/v and the gate/up weights (one matmul per group) and
picks greedy tokens with one kernel over the logits."
    };
}
pub(crate) use cuda_decoding_env;

pub(crate) mod args;
pub(crate) mod bench;
pub(crate) mod curate;
pub(crate) mod eval;
pub(crate) mod generate;
pub(crate) mod kernelbench;
pub(crate) mod model;
pub(crate) mod problems;
pub(crate) mod prompt;
pub(crate) mod report;
pub(crate) mod serve;
pub(crate) mod tokenize;
pub(crate) mod train;
