//! Writing checkpoint weights as Hugging Face does: the tensors split into shards in state-dict
//! order (`model-0000N-of-0000M.safetensors` with `model.safetensors.index.json`, or one
//! `model.safetensors`), each file byte for byte what `safetensors.torch.save_file(…,
//! metadata={"format": "pt"})` writes, every file under a temporary name and then renamed.
//! [`crate::init`] writes generated weights through it, trainers their trained ones.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The dtype a tensor is stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDType {
    BF16,
    F32,
}

impl StoredDType {
    pub fn size_in_bytes(self) -> u64 {
        match self {
            StoredDType::BF16 => 2,
            StoredDType::F32 => 4,
        }
    }

    /// The name in a safetensors header.
    fn header_name(self) -> &'static str {
        match self {
            StoredDType::BF16 => "BF16",
            StoredDType::F32 => "F32",
        }
    }

    /// The `torch_dtype` of a `config.json` whose weights are stored in this dtype.
    pub fn torch_name(self) -> &'static str {
        match self {
            StoredDType::BF16 => "bfloat16",
            StoredDType::F32 => "float32",
        }
    }
}

/// One tensor of a checkpoint: what its header entry says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: StoredDType,
}

impl StoredTensor {
    pub fn size_in_bytes(&self) -> u64 {
        self.dtype.size_in_bytes() * self.shape.iter().product::<usize>() as u64
    }
}

/// When the weights get a `model.safetensors.index.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexFile {
    /// Only past one shard; a single shard is `model.safetensors` (what `save_pretrained` does).
    WhenSharded,
    /// Always, a single shard being `model-00001-of-00001.safetensors`.
    Always,
}

/// What [`write_weights`] wrote.
#[derive(Debug, Clone)]
pub struct WrittenWeights {
    /// The weight files, the index last when there is one, relative to the folder.
    pub files: Vec<String>,
    /// Bytes of the shard files, headers included.
    pub bytes: u64,
}

/// Writes `tensors` (in state-dict order) into `dir` as safetensors shards of at most
/// `max_shard_bytes` each (a shard closes when the next tensor would take it past the limit;
/// a larger tensor gets a shard of its own), with the index that `index` asks for, and removes
/// weight files of another layout left in `dir`. `data` writes the little-endian bytes of one
/// tensor, exactly [`StoredTensor::size_in_bytes`] of them.
pub fn write_weights(
    dir: &Path,
    tensors: &[StoredTensor],
    max_shard_bytes: u64,
    index: IndexFile,
    mut data: impl FnMut(&StoredTensor, &mut dyn Write) -> Result<()>,
) -> Result<WrittenWeights> {
    let shards = plan_shards(tensors, max_shard_bytes);
    let single_file = shards.len() == 1 && index == IndexFile::WhenSharded;
    let mut files = Vec::new();
    let mut bytes = 0;
    let mut weight_map = BTreeMap::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = if single_file {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, shards.len())
        };
        bytes += write_atomically(&dir.join(&file), |w| write_safetensors(w, shard, &mut data))?;
        for tensor in shard {
            weight_map.insert(tensor.name.clone(), file.clone());
        }
        files.push(file);
    }
    if !single_file {
        let total_size: u64 = tensors.iter().map(StoredTensor::size_in_bytes).sum();
        let index = serde_json::json!({
            "metadata": {"total_size": total_size},
            "weight_map": weight_map,
        });
        let file = "model.safetensors.index.json".to_string();
        write_atomically(&dir.join(&file), |w| {
            serde_json::to_writer_pretty(&mut *w, &index)?;
            writeln!(w)?;
            Ok(())
        })?;
        files.push(file);
    }
    remove_stale_weights(dir, &files)?;
    Ok(WrittenWeights { files, bytes })
}

/// The tensors of each shard, in the given order.
fn plan_shards(tensors: &[StoredTensor], max_shard_bytes: u64) -> Vec<Vec<&StoredTensor>> {
    let mut shards = Vec::new();
    let (mut current, mut bytes) = (Vec::new(), 0u64);
    for tensor in tensors {
        let size = tensor.size_in_bytes();
        if !current.is_empty() && bytes + size > max_shard_bytes {
            shards.push(std::mem::take(&mut current));
            bytes = 0;
        }
        current.push(tensor);
        bytes += size;
    }
    shards.push(current);
    shards
}

/// One safetensors file: the tensors sorted by name, a compact JSON header padded with spaces
/// to a multiple of 8 bytes, then the data. Returns the bytes written.
fn write_safetensors(
    w: &mut dyn Write,
    tensors: &[&StoredTensor],
    data: &mut impl FnMut(&StoredTensor, &mut dyn Write) -> Result<()>,
) -> Result<u64> {
    let mut tensors = tensors.to_vec();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0u64;
    for tensor in &tensors {
        let end = offset + tensor.size_in_bytes();
        header += &format!(
            r#",{}:{{"dtype":"{}","shape":{},"data_offsets":[{offset},{end}]}}"#,
            serde_json::to_string(&tensor.name)?,
            tensor.dtype.header_name(),
            serde_json::to_string(&tensor.shape)?,
        );
        offset = end;
    }
    header.push('}');
    header.extend(std::iter::repeat_n(' ', (8 - header.len() % 8) % 8));
    w.write_all(&(header.len() as u64).to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    for tensor in tensors {
        let mut counted = CountingWriter { inner: w, bytes: 0 };
        data(tensor, &mut counted)?;
        anyhow::ensure!(
            counted.bytes == tensor.size_in_bytes(),
            "internal error: {} bytes written for tensor {}, its header says {}",
            counted.bytes,
            tensor.name,
            tensor.size_in_bytes()
        );
    }
    Ok(8 + header.len() as u64 + offset)
}

/// Counts the bytes of one tensor, so a short or long tensor cannot shift the file's layout
/// unnoticed.
struct CountingWriter<'w> {
    inner: &'w mut dyn Write,
    bytes: u64,
}

impl Write for CountingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Removes weight files of an earlier layout (a single file replaced by shards, shards of
/// another count, an index a single file replaces), which the loader would otherwise read.
fn remove_stale_weights(dir: &Path, written: &[String]) -> Result<()> {
    let single = "model.safetensors";
    let index = "model.safetensors.index.json";
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let shard = name.starts_with("model-") && name.ends_with(".safetensors");
        let weights = shard || name == single || name == index;
        if weights && !written.contains(&name) {
            let path = dir.join(&name);
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove the stale {}", path.display()))?;
        }
    }
    Ok(())
}

/// Whether `file_name` is one of [`write_atomically`]'s temporary files (left behind when a
/// process is killed while writing), which a folder's next owner may remove.
pub fn is_atomic_temporary(file_name: &str) -> bool {
    file_name.starts_with('.') && file_name.ends_with(".tmp")
}

/// Writes `path` through `write` under a temporary name beside it, synced, then renames it into
/// place: a reader sees the old file or the complete new one, never a part.
pub fn write_atomically<T>(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> Result<T>,
) -> Result<T> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let file_name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?
        .to_string_lossy();
    let temporary: PathBuf = path.with_file_name(format!(
        ".{file_name}.{}-{}.tmp",
        std::process::id(),
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    let result: Result<T> = (|| {
        let file = File::create(&temporary)
            .with_context(|| format!("cannot create {}", temporary.display()))?;
        let mut writer = BufWriter::new(file);
        let value = write(&mut writer)?;
        let file = writer
            .into_inner()
            .map_err(std::io::IntoInnerError::into_error)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        Ok(value)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}
