//! Layout-independent training state (every tensor whole, with its Adam moments) and
//! checkpoints on disk, written atomically.
//!
//! A checkpoint is a directory `DIR/step-NNNNNNNN/` holding `state.json` (schema, step, model,
//! tensor names, shapes and offsets) and `tensors.bin` (little-endian f32: for each tensor its
//! parameters, first and second moments). It is written under a temporary name and renamed
//! into place, then `DIR/LATEST` (the name of the newest) is replaced by write-and-rename, so
//! an interrupted save never leaves a half-written checkpoint where a reader looks.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Schema tag of checkpoint headers.
pub const CHECKPOINT_SCHEMA: &str = "parallax-checkpoint/1";

/// One tensor with its optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorState {
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub param: Vec<f32>,
    /// Adam first moment.
    pub m: Vec<f32>,
    /// Adam second moment.
    pub v: Vec<f32>,
}

/// The whole training state after `step` optimizer steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Tensors by global name.
    pub tensors: BTreeMap<String, TensorState>,
}

impl ModelState {
    /// Largest relative difference between two states' parameters, per tensor as
    /// `‖a − b‖ / ‖b‖`, over the tensors whose name passes `keep`, with the name of the worst
    /// tensor. Missing tensors count as 1.
    pub fn max_relative_diff_where(
        &self,
        other: &ModelState,
        keep: impl Fn(&str) -> bool,
    ) -> (f64, String) {
        let mut worst = (0.0, String::new());
        for (name, b) in other.tensors.iter().filter(|(n, _)| keep(n)) {
            let d = match self.tensors.get(name) {
                Some(a) if a.param.len() == b.param.len() => {
                    let num: f64 = a
                        .param
                        .iter()
                        .zip(&b.param)
                        .map(|(x, y)| f64::from(x - y).powi(2))
                        .sum();
                    let den: f64 = b.param.iter().map(|y| f64::from(*y).powi(2)).sum();
                    (num / den.max(1e-30)).sqrt()
                }
                _ => 1.0,
            };
            if d > worst.0 || worst.1.is_empty() {
                worst = (d, name.clone());
            }
        }
        worst
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    schema: String,
    step: u64,
    /// Free-form description of what produced it (model and layout), for people.
    about: serde_json::Value,
    tensors: Vec<Entry>,
    /// FNV-1a 64 of `tensors.bin`, hex: a flipped or truncated byte is caught on resume.
    /// Checkpoints written before it existed have none and are read without the check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checksum: Option<String>,
}

/// FNV-1a, 64 bit: not cryptographic, enough to catch corruption of a checkpoint on disk.
fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    /// Offset in f32 elements of the parameters; moments follow.
    offset: usize,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> (String, String) {
    (path.display().to_string(), e.to_string())
}

/// Writes `state` as a new checkpoint in `dir` (created if needed) and points `LATEST` at it.
/// `about` is recorded for people. Returns the checkpoint's directory. Errors are
/// `(path, reason)`.
pub fn save(
    dir: &Path,
    state: &ModelState,
    about: serde_json::Value,
) -> Result<PathBuf, (String, String)> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    remove_abandoned_saves(dir);
    let name = format!("step-{:08}", state.step);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let fin = dir.join(&name);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| io_err(&tmp, e))?;
    let mut bin = Vec::new();
    let mut entries = Vec::new();
    for (name, t) in &state.tensors {
        entries.push(Entry {
            name: name.clone(),
            shape: t.shape.clone(),
            offset: bin.len() / 4,
        });
        for part in [&t.param, &t.m, &t.v] {
            for x in part.iter() {
                bin.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    let header = Header {
        schema: CHECKPOINT_SCHEMA.into(),
        step: state.step,
        about,
        tensors: entries,
        checksum: Some(fnv1a64(&bin)),
    };
    let json = serde_json::to_string_pretty(&header).map_err(|e| io_err(&tmp, e))?;
    write_synced(&tmp.join("tensors.bin"), &bin)?;
    write_synced(&tmp.join("state.json"), json.as_bytes())?;
    if fin.exists() {
        std::fs::remove_dir_all(&fin).map_err(|e| io_err(&fin, e))?;
    }
    std::fs::rename(&tmp, &fin).map_err(|e| io_err(&fin, e))?;
    let latest_tmp = dir.join(format!(".LATEST.tmp-{}", std::process::id()));
    write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    std::fs::rename(&latest_tmp, dir.join("LATEST")).map_err(|e| io_err(&dir.join("LATEST"), e))?;
    Ok(fin)
}

/// Removes the temporary folders and files of saves whose process is gone (killed during a
/// save): `.step-N.tmp-PID/` and `.LATEST.tmp-PID`. Where processes cannot be looked up
/// (no `/proc`), nothing is removed; a live process's save is never touched.
fn remove_abandoned_saves(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name.starts_with(".step-") || name.starts_with(".LATEST");
        let Some((_, pid)) = name.rsplit_once(".tmp-") else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if ours && pid != std::process::id() && process_gone(pid) {
            let p = entry.path();
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

/// Whether process `pid` is known to have ended: false where processes cannot be looked up
/// (no `/proc`), so that nothing of a live process is ever taken for abandoned.
pub fn process_gone(pid: u32) -> bool {
    let proc_fs = Path::new("/proc");
    proc_fs.join("self").exists() && !proc_fs.join(pid.to_string()).exists()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), (String, String)> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

/// Reads the checkpoint `LATEST` points to in `dir` (or `dir` itself when it holds a
/// `state.json`). Errors are `(path, reason)`.
pub fn load(dir: &Path) -> Result<ModelState, (String, String)> {
    let ck = if dir.join("state.json").is_file() {
        dir.to_path_buf()
    } else {
        let latest = dir.join("LATEST");
        let name = std::fs::read_to_string(&latest)
            .map_err(|e| io_err(&latest, format!("no checkpoint here ({e})")))?;
        dir.join(name.trim())
    };
    let hpath = ck.join("state.json");
    let text = std::fs::read_to_string(&hpath).map_err(|e| io_err(&hpath, e))?;
    let header: Header = serde_json::from_str(&text).map_err(|e| io_err(&hpath, e))?;
    if header.schema != CHECKPOINT_SCHEMA {
        return Err(io_err(
            &hpath,
            format!("schema '{}', expected '{CHECKPOINT_SCHEMA}'", header.schema),
        ));
    }
    if header.step == u64::MAX {
        return Err(io_err(
            &hpath,
            "step 18446744073709551615 cannot be continued",
        ));
    }
    let bpath = ck.join("tensors.bin");
    let bytes = std::fs::read(&bpath).map_err(|e| io_err(&bpath, e))?;
    if let Some(want) = &header.checksum {
        let got = fnv1a64(&bytes);
        if &got != want {
            return Err(io_err(
                &bpath,
                format!("checksum {got} differs from state.json's {want}: the file is corrupt"),
            ));
        }
    }
    if bytes.len() % 4 != 0 {
        return Err(io_err(&bpath, "length is not a multiple of 4 bytes"));
    }
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut tensors = BTreeMap::new();
    let mut used = 0usize;
    for e in header.tensors {
        let past_end = || {
            io_err(
                &bpath,
                format!("tensor '{}' runs past the end of the file", e.name),
            )
        };
        let n = e
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(past_end)?;
        let end = n
            .checked_mul(3)
            .and_then(|x| x.checked_add(e.offset))
            .filter(|&end| end <= floats.len())
            .ok_or_else(past_end)?;
        let whole = &floats[e.offset..end];
        if let Some(i) = whole.iter().position(|x| !x.is_finite()) {
            return Err(io_err(
                &bpath,
                format!(
                    "tensor '{}' holds a non-finite value ({}) at element {i}",
                    e.name, whole[i]
                ),
            ));
        }
        used = used.saturating_add(3 * n);
        let (param, rest) = whole.split_at(n);
        let (m, v) = rest.split_at(n);
        let t = TensorState {
            shape: e.shape,
            param: param.to_vec(),
            m: m.to_vec(),
            v: v.to_vec(),
        };
        if tensors.insert(e.name.clone(), t).is_some() {
            return Err(io_err(
                &hpath,
                format!("tensor '{}' is listed twice", e.name),
            ));
        }
    }
    if used != floats.len() {
        return Err(io_err(
            &bpath,
            format!(
                "holds {} values, the tensors listed in state.json {used}",
                floats.len()
            ),
        ));
    }
    Ok(ModelState {
        step: header.step,
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_round_trip_and_latest_moves() {
        let dir = std::env::temp_dir().join(format!("parallax-ck-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = ModelState {
            step: 3,
            tensors: BTreeMap::new(),
        };
        s.tensors.insert(
            "w".into(),
            TensorState {
                shape: vec![2, 2],
                param: vec![1.0, -2.0, 3.5, f32::MIN_POSITIVE],
                m: vec![0.1; 4],
                v: vec![0.2; 4],
            },
        );
        save(&dir, &s, serde_json::json!({"model": "test"})).unwrap();
        assert_eq!(load(&dir).unwrap(), s);
        s.step = 4;
        save(&dir, &s, serde_json::Value::Null).unwrap();
        assert_eq!(load(&dir).unwrap().step, 4);
        assert_eq!(load(&dir.join("step-00000003")).unwrap().step, 3);
        assert!(load(&dir.join("nope")).is_err());
        // A save killed midway (its process gone) leaves litter that the next save removes;
        // one of a live process stays.
        let dead = dir.join(".step-00000009.tmp-4294967295");
        let alive = dir.join(format!(".step-00000009.tmp-{}", std::process::id()));
        std::fs::create_dir_all(&dead).unwrap();
        std::fs::write(dir.join(".LATEST.tmp-4294967295"), b"x").unwrap();
        std::fs::create_dir_all(&alive).unwrap();
        s.step = 5;
        save(&dir, &s, serde_json::Value::Null).unwrap();
        if Path::new("/proc/self").exists() {
            assert!(!dead.exists());
            assert!(!dir.join(".LATEST.tmp-4294967295").exists());
        }
        assert!(alive.exists(), "a live process's save is never touched");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What `--resume` must refuse: a flipped byte, NaN values, an offset that would wrap, a
    /// tensor listed twice, trailing bytes, a step that cannot be continued.
    #[test]
    fn corrupt_checkpoints_are_refused_with_the_reason() {
        let dir = std::env::temp_dir().join(format!("parallax-ck-bad-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = ModelState {
            step: 1,
            tensors: BTreeMap::new(),
        };
        for name in ["a", "b"] {
            s.tensors.insert(
                name.into(),
                TensorState {
                    shape: vec![3],
                    param: vec![1.0, 2.0, 3.0],
                    m: vec![0.0; 3],
                    v: vec![0.0; 3],
                },
            );
        }
        let ck = save(&dir, &s, serde_json::Value::Null).unwrap();
        let (bin, json) = (ck.join("tensors.bin"), ck.join("state.json"));
        let good_bin = std::fs::read(&bin).unwrap();
        let good_json = std::fs::read_to_string(&json).unwrap();
        let reason = |bin_bytes: &[u8], header: &str| {
            std::fs::write(&bin, bin_bytes).unwrap();
            std::fs::write(&json, header).unwrap();
            load(&dir).err().map(|(_, r)| r).unwrap_or_default()
        };
        let mut flipped = good_bin.clone();
        flipped[5] ^= 0x40;
        assert!(reason(&flipped, &good_json).contains("checksum"));
        // Without the checksum, the content itself is checked.
        let v: serde_json::Value = serde_json::from_str(&good_json).unwrap();
        let edit = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = v.clone();
            v.as_object_mut().unwrap().remove("checksum");
            f(&mut v);
            v.to_string()
        };
        let mut nan = good_bin.clone();
        nan[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(reason(&nan, &edit(&|_| ())).contains("non-finite"));
        let wrap = edit(&|v| v["tensors"][1]["offset"] = serde_json::json!(u64::MAX));
        assert!(reason(&good_bin, &wrap).contains("runs past the end"));
        let twice = edit(&|v| v["tensors"][1]["name"] = serde_json::json!("a"));
        assert!(reason(&good_bin, &twice).contains("listed twice"));
        let mut longer = good_bin.clone();
        longer.extend_from_slice(&[0; 8]);
        assert!(reason(&longer, &edit(&|_| ())).contains("holds 20 values"));
        let last = edit(&|v| v["step"] = serde_json::json!(u64::MAX));
        assert!(reason(&good_bin, &last).contains("cannot be continued"));
        assert_eq!(reason(&good_bin, &edit(&|_| ())), "");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
