//! `dice train sft`: the flags map onto `dice_train::sft`'s settings and trainer.

use super::{set, RunArgs};
use anyhow::Result;
use clap::Args;
use dice_train::schedule::ScheduleKind;
use dice_train::sft::{dry_run_report, SftConfig, SftTrainer};
use std::path::PathBuf;

pub(crate) const MANUAL: &str = "\
What a step does. The packed rows of the step are noised (one noise level per sample, spec
§6.2; the draw of row r at step s depends only on --seed, s and r), the two-stream loss and its
gradients are computed one micro-batch of --batch-size rows at a time with activation
checkpointing, the gradients of --gradient-accumulation-steps micro-batches are summed (each
micro-batch's loss is normalised by its own loss tokens, as the reference does), clipped to a
global norm of --max-grad-norm, and AdamW (f32 master weights and moments; betas 0.9/0.999, eps
1e-8, weight decay --weight-decay) applies the schedule's learning rate: linear warmup over
--warmup-ratio of the steps, then constant (constant_with_warmup, the reference) or a half
cosine to 0 (cosine). Each epoch visits the packed rows in an order shuffled by the seed.

Settings. Defaults are DICE's SFT recipe (spec §6.5): lr 1e-5, 3 epochs, constant_with_warmup
with warmup ratio 0.03, 1 row per micro-batch, no accumulation, clipping at 1.0, seed 42, rows of
6144 tokens, bf16 on CUDA (f32 on the CPU). --config F reads them from a TOML file (sections
[model] [data] [training] [optimizer] [checkpoint] [eval] [metrics], the keys of OUT/config.toml);
flags override the file. Every run writes its resolved settings to OUT/config.toml, so
`dice train sft --config OUT/config.toml --out OUT` runs it again.

Output folder.
  checkpoint-STEP/  every --save-steps steps and at the end, written in the background; the
                    newest is resumable, older kept ones are models only; the newest
                    --save-total-limit kept
  final/            the finished model
  config.toml       the run's settings
  metrics.jsonl     one JSON object per optimizer step: step, epoch, loss, lr, grad_norm,
                    tokens, tokens_per_s, tflops, mfu, memory (peak bytes: the GPU's during the
                    step, the process's resident peak on the CPU), step_time_s and its parts
                    forward_backward_s (the micro-batches' forwards and backwards) and update_s
                    (reduction over the ranks, clipping, AdamW); one per
                    evaluation: step, epoch, eval_loss, eval_rows; and one per checkpoint once
                    written: step, checkpoint, checkpoint_bytes, seconds_checkpoint (the
                    training waited: the state copied), seconds_checkpoint_write (the background
                    write), checkpoint_snapshot (where the state was copied: device memory, read
                    back by the background write, when the GPU has room; else host memory)
  metrics.html      loss and learning-rate curves (inline SVG), refreshed at every save
A checkpoint is a Hugging Face model folder, loadable by dice generate, dice serve and
transformers: model-0000N-of-0000M.safetensors + model.safetensors.index.json under the SDAR key
names (bf16 by default, --save-dtype), the base model's config.json, tokenizer files, chat
template, generation_config.json and *.py files, and trainer_state.json; the newest
checkpoint-STEP/ adds optimizer.safetensors (f32 masters unless --save-dtype f32, and the AdamW
moments). Folders are written under a temporary name and renamed when complete, so a crash
mid-write leaves the checkpoint before. Disk use per checkpoint: see --save-steps.

Resuming. Run the same command again: it continues from the newest complete checkpoint in
--out (or from --resume DIR) with its f32 weights, optimizer moments, schedule step, data order
and noise, and ends with exactly the weights of an uninterrupted run on the same device. A run
with other settings or other data is refused. MFU counts the model FLOPs of both streams
(dice_train::metrics documents the formula) against --peak-tflops.

Several ranks. --nproc-per-node N starts N ranks on this machine; torchrun, Slurm or Kubernetes
start them through RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (deploy/ has a
Slurm script and a Kubernetes Job for 2 nodes). A step takes --batch-size x
--gradient-accumulation-steps x ranks rows, shared out among the ranks; its gradient is the sum
over all its micro-batches, so N ranks make the update of one rank accumulating N times as many
micro-batches (bit for bit with one micro-batch per rank). Rank 0 alone writes the output
folder (give every rank the same --out on a shared file system); a run resumes with the same
number of ranks. --zero-stage shards the optimizer state as DeepSpeed's ZeRO does: the
parameters, flattened in name order, are cut into one contiguous shard per rank, and each rank
keeps the f32 masters and AdamW moments of its shard only (1/N of the 12 bytes per parameter).
Stage 1 all-reduces the gradient and keeps the shard, stage 2 reduce-scatters it; the global
norm adds the shards' squared norms over the ranks, each rank updates its shard and the shards
are all-gathered into every rank's weights. The weights are those of stage 0 (the default:
every rank holds everything), bit for bit on the CPU. Checkpoints gather the state on
rank 0 and hold the same optimizer.safetensors at every stage, so a run resumes with any stage.
With --device cuda, ranks that met at a rendezvous (started by --nproc-per-node or torchrun, even
one alone) talk through NCCL, one GPU per rank, so --nproc-per-node 1 checks the NCCL path on a
single GPU (a binary built with --features cuda; this path has not yet run on a GPU).

Data. Records are LlamaFactory's: --dataset-info names a dataset_info.json (or the folder holding
it) whose --dataset entries give file_name (relative to that folder; a folder means its files in
name order), formatting (alpaca | sharegpt), columns (alpaca: prompt, query, response, history,
system; sharegpt: messages, system) and, for sharegpt, tags (role_tag, content_tag, user_tag,
assistant_tag, observation_tag, function_tag, system_tag). As in LlamaFactory, a columns or tags
mapping replaces the defaults entirely: a key it omits is unset. --data FILE reads a plain file
whose first record tells the layout: {\"messages\": [{\"role\", \"content\"}, ...]},
{\"conversations\": [{\"from\", \"value\"}, ...]}, {\"instruction\", \"input\", \"output\"} or
{\"prompt\", \"response\"}. Files are a JSON array of objects or JSON Lines. Named datasets come
first, then data files, concatenated in the order given.

Encoding, as the reference (LlamaFactory's qwen3 template with thinking on): a prompt turn is
<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n (a system text goes before the
first one), a response is {content}<|im_end|>\\n and carries loss; a response without <think> or
</think> gets the empty thought <think>\\n\\n</think>\\n\\n prepended, with loss. Each sample is
padded with the pad token to a multiple of the model's block size; the pads carry loss. Samples
longer than the cutoff are dropped, never truncated. LlamaFactory also skips records without a
response and sharegpt conversations whose roles do not alternate user/assistant; they are counted
and the first of each kind is named.

Packing: the samples of each preprocessing batch are packed greedily (the longest that still fits
first) into rows of --row-tokens tokens, filling at most --row-tokens - 1; position ids restart at
0 for every sample, and the rest of the row is pad tokens without loss, which the model treats as
one extra sample.

--dry-run prints the packing statistics (records, samples packed and dropped, rows, tokens, loss
tokens, fill ratio) without loading a model; --model (or --tokenizer) only provides the
tokenizer and the block size (config.json's block_size, 4 without one).

Progress: a bar on stderr; where stderr is not a terminal (a log file, a batch job), a plain
line at the first step, every 30 s and at the last. Logs: RUST_LOG=info prints every step,
evaluation and save on stderr.

Examples:
  dice train sft --model SDAR-4B-Chat/ --dataset-info data/ --dataset cuke --out runs/sft --dry-run
  dice train sft --model SDAR-4B-Chat/ --dataset-info data/ --dataset cuke --out runs/sft \\
      --device cuda --save-steps 200 --save-total-limit 3 --val-ratio 0.01 --eval-steps 100
  dice train sft --model tiny/ --data chats.jsonl --out runs/tiny --max-steps 20 --lr 1e-3 \\
      --row-tokens 256";

#[derive(Args, Debug)]
pub(crate) struct SftArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Plain data files (JSON array or JSON Lines), their layout told by their first record.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// LlamaFactory's dataset_info.json, or the folder holding it.
    #[arg(long, value_name = "F", requires = "dataset")]
    pub dataset_info: Option<PathBuf>,
    /// Datasets of --dataset-info to train on, mixed in the order given.
    #[arg(long, value_name = "NAME", num_args = 1.., requires = "dataset_info")]
    pub dataset: Vec<String>,
    /// Passes over the data, fractions allowed [default: 3, the DICE recipe].
    #[arg(long, value_name = "E", conflicts_with = "max_steps")]
    pub epochs: Option<f64>,
    /// Learning-rate schedule after the warmup [default: constant-with-warmup].
    #[arg(long, value_enum)]
    pub lr_scheduler: Option<ScheduleKind>,
    /// Share of the steps spent warming up, rounded up to whole steps [default: 0.03].
    #[arg(long, value_name = "R")]
    pub warmup_ratio: Option<f64>,
    /// Packed rows per micro-batch (one forward and backward) [default: 1].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Micro-batches whose gradients make one optimizer step [default: 1].
    #[arg(long, value_name = "N")]
    pub gradient_accumulation_steps: Option<usize>,
    /// AdamW's decoupled weight decay [default: 0].
    #[arg(long, value_name = "X")]
    pub weight_decay: Option<f64>,
    /// Hold out this share of the packed rows (chosen by the seed) for evaluation [default: 0].
    #[arg(long, value_name = "R", conflicts_with = "val_data")]
    pub val_ratio: Option<f64>,
    /// Evaluate on the packed rows of these files instead of a held-out share.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub val_data: Vec<PathBuf>,
    /// Peak dense TFLOP/s of one device, for the MFU [default: 989 (H100/H200 bf16) on CUDA;
    /// no MFU on the CPU].
    #[arg(long, value_name = "T")]
    pub peak_tflops: Option<f64>,
    /// Query and head rows per chunk of the checkpointed forward and backward: memory against
    /// speed, the same results [default: 1024].
    #[arg(long, value_name = "N")]
    pub chunk_rows: Option<usize>,
    /// Optimizer-state sharding over the ranks, as DeepSpeed's ZeRO: 0 every rank holds the
    /// whole state, 1 each rank the f32 masters and moments of its 1/N of the parameters, 2 also
    /// only its shard of the summed gradient; the same weights at every stage [default: 0].
    #[arg(long, value_name = "0|1|2", value_parser = clap::value_parser!(u8).range(0..=2))]
    pub zero_stage: Option<u8>,
    /// Longest sample kept, in tokens after block padding [default: --row-tokens - 1, what
    /// LlamaFactory's cutoff_len: 6144 means with packing].
    #[arg(long, value_name = "N")]
    pub cutoff_len: Option<usize>,
    /// Tokens per packed row [default: 6144].
    #[arg(long, value_name = "N")]
    pub row_tokens: Option<usize>,
    /// Records per preprocessing batch; the packing only combines samples of one batch
    /// (LlamaFactory's preprocessing_batch_size) [default: 1000].
    #[arg(long, value_name = "N")]
    pub preprocessing_batch_size: Option<usize>,
    /// Contiguous shards the records are split into before batching (LlamaFactory's
    /// preprocessing_num_workers; set it to the reference run's value to pack its rows)
    /// [default: 1].
    #[arg(long, value_name = "N")]
    pub preprocessing_num_workers: Option<usize>,
}

pub(crate) fn run(a: SftArgs) -> Result<()> {
    a.run.start(
        settings(&a)?,
        dry_run_report,
        SftTrainer::new,
        SftTrainer::train,
    )
}

/// The settings file (or the defaults) with the flags on top.
fn settings(a: &SftArgs) -> Result<SftConfig> {
    let mut c = a.run.settings_or(|| Ok(SftConfig::default()))?;
    a.run.apply(
        &mut c.model,
        &mut c.training.run,
        &mut c.checkpoint,
        &mut c.eval.eval_steps,
    );
    if !a.data.is_empty() || !a.dataset.is_empty() {
        c.data.files.clone_from(&a.data);
        c.data.dataset_info.clone_from(&a.dataset_info);
        c.data.datasets.clone_from(&a.dataset);
    }
    if !a.val_data.is_empty() {
        c.data.val_files.clone_from(&a.val_data);
        c.data.val_ratio = 0.0;
    }
    set(&mut c.data.val_ratio, &a.val_ratio);
    if a.val_ratio.is_some() {
        c.data.val_files.clear();
    }
    set(&mut c.data.row_tokens, &a.row_tokens);
    if a.cutoff_len.is_some() {
        c.data.cutoff_len = a.cutoff_len;
    }
    set(
        &mut c.data.preprocessing_batch_size,
        &a.preprocessing_batch_size,
    );
    set(
        &mut c.data.preprocessing_num_workers,
        &a.preprocessing_num_workers,
    );

    let t = &mut c.training;
    if let Some(epochs) = a.epochs {
        t.epochs = epochs;
        t.max_steps = None;
    }
    if a.run.max_steps.is_some() {
        t.max_steps = a.run.max_steps;
    }
    set(&mut t.lr_scheduler, &a.lr_scheduler);
    set(&mut t.warmup_ratio, &a.warmup_ratio);
    set(&mut t.per_device_train_batch_size, &a.batch_size);
    set(
        &mut t.gradient_accumulation_steps,
        &a.gradient_accumulation_steps,
    );
    set(&mut t.chunk_rows, &a.chunk_rows);
    set(&mut t.zero_stage, &a.zero_stage);
    set(&mut c.optimizer.weight_decay, &a.weight_decay);
    if a.peak_tflops.is_some() {
        c.metrics.peak_tflops = a.peak_tflops;
    }
    Ok(c)
}
