//! Damaged and malformed checkpoints: each must fail with an error that names the file (or tensor)
//! and the problem, never a panic.

use std::fs;
use std::path::{Path, PathBuf};

use moerun_core::{Error, Tensor};
use moerun_model::checkpoint::Checkpoint;
use moerun_model::safetensors::{write_safetensors, SafetensorsFile};

/// Write a safetensors file from a raw header string and raw data bytes.
fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    fs::write(path, bytes).unwrap();
}

/// A valid one-tensor file: `w`, f32, shape [2, 3].
fn good_file(path: &Path) {
    let t = Tensor::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    write_safetensors(path, &[("w", &t)], None).unwrap();
}

/// The error message of a failed open, checked to name `path`.
fn open_err(path: &Path) -> String {
    let msg = SafetensorsFile::open(path).unwrap_err().to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name the file: {msg}"
    );
    assert!(!msg.contains('\n'), "message is not one line: {msg}");
    msg
}

fn assert_contains(msg: &str, needle: &str) {
    assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
}

/// A checkpoint directory with a config.json and nothing else.
fn ckpt_dir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("config.json"), r#"{"model_type": "test"}"#).unwrap();
    (tmp, dir)
}

/// The error message of a failed checkpoint open, checked to be one line naming `names`.
fn ckpt_err(dir: &Path, names: &Path) -> String {
    let msg = Checkpoint::open(dir).unwrap_err().to_string();
    assert_contains(&msg, &names.display().to_string());
    assert!(!msg.contains('\n'), "message is not one line: {msg}");
    msg
}

#[test]
fn file_shorter_than_length_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("short.safetensors");
    fs::write(&path, [1, 2, 3, 4, 5]).unwrap();
    assert_contains(&open_err(&path), "too short");
    fs::write(&path, []).unwrap();
    assert_contains(&open_err(&path), "file is 0 bytes");
}

#[test]
fn garbage_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("garbage.safetensors");
    // A deterministic pseudo-random stream (xorshift) stands in for a file of another format.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    fs::write(&path, bytes).unwrap();
    assert_contains(&open_err(&path), "header claims");
}

#[test]
fn header_longer_than_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("h.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}        ");
    fs::write(&path, bytes).unwrap();
    assert_contains(
        &open_err(&path),
        "header claims 1000 bytes but the file has only 10",
    );
}

#[test]
fn header_over_size_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("huge.safetensors");
    let file = fs::File::create(&path).unwrap();
    // Sparse: costs no disk, but the claimed header fits in the file and only the cap rejects it.
    file.set_len(200_000_000).unwrap();
    drop(file);
    let mut f = fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::io::Write::write_all(&mut f, &150_000_000u64.to_le_bytes()).unwrap();
    drop(f);
    assert_contains(&open_err(&path), "limit");
}

#[test]
fn header_not_utf8() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("u.safetensors");
    let mut bytes = 8u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[b'{', 0xff, 0xfe, b'}', b' ', b' ', b' ', b' ']);
    fs::write(&path, bytes).unwrap();
    assert_contains(&open_err(&path), "not valid UTF-8");
}

#[test]
fn header_invalid_json() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("j.safetensors");
    raw_file(&path, r#"{"w": {"dtype": "F32", "#, &[]);
    assert_contains(&open_err(&path), "not valid JSON");
    raw_file(&path, "[1, 2]", &[]);
    assert_contains(&open_err(&path), "must be an object");
}

#[test]
fn entry_missing_field() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.safetensors");
    raw_file(&path, r#"{"w": {"dtype": "F32", "shape": [1]}}"#, &[0; 4]);
    let msg = open_err(&path);
    assert_contains(&msg, "tensor 'w'");
    assert_contains(&msg, "missing field 'data_offsets'");
    raw_file(
        &path,
        r#"{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}"#,
        &[0; 4],
    );
    assert_contains(
        &open_err(&path),
        "'shape' must be an array of non-negative integers",
    );
}

#[test]
fn truncated_file_offsets_past_end() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.safetensors");
    good_file(&path);
    let len = fs::metadata(&path).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 4)
        .unwrap();
    let msg = open_err(&path);
    assert_contains(
        &msg,
        "tensor 'w' ends at byte 24 but the data region has 20",
    );
}

#[test]
fn wrong_byte_length() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("b.safetensors");
    raw_file(
        &path,
        r#"{"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}}"#,
        &[0; 10],
    );
    let msg = open_err(&path);
    assert_contains(&msg, "tensor 'w'");
    assert_contains(&msg, "needs 12 bytes");
    // Unsupported dtypes are length-checked too.
    raw_file(
        &path,
        r#"{"ids": {"dtype": "I64", "shape": [3], "data_offsets": [0, 12]}}"#,
        &[0; 12],
    );
    assert_contains(&open_err(&path), "needs 24 bytes");
}

#[test]
fn shape_product_overflow() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("o.safetensors");
    let big = 1u64 << 40;
    let header =
        format!(r#"{{"w": {{"dtype": "F32", "shape": [{big}, {big}], "data_offsets": [0, 0]}}}}"#);
    raw_file(&path, &header, &[]);
    assert_contains(&open_err(&path), "overflows");
}

#[test]
fn offsets_reversed_or_overlapping() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("r.safetensors");
    raw_file(
        &path,
        r#"{"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}"#,
        &[0; 4],
    );
    assert_contains(&open_err(&path), "end before they begin");
    raw_file(
        &path,
        r#"{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}"#,
        &[0; 6],
    );
    assert_contains(&open_err(&path), "tensors 'a' and 'b' overlap");
}

#[test]
fn metadata_values_must_be_strings() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("md.safetensors");
    raw_file(&path, r#"{"__metadata__": {"format": 1}}"#, &[]);
    assert_contains(&open_err(&path), "key 'format' holds a number");
}

#[test]
fn missing_file_names_path() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("absent.safetensors");
    let err = open_err(&path);
    assert!(matches!(
        SafetensorsFile::open(&path),
        Err(Error::Io { .. })
    ));
    assert!(!err.is_empty());
}

#[test]
fn unsupported_dtype_fails_only_on_access() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("mixed.safetensors");
    let mut data = vec![0u8; 16];
    data.extend_from_slice(&1.5f32.to_le_bytes());
    raw_file(
        &path,
        r#"{"position_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
            "scale": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]},
            "future": {"dtype": "F3_NEW", "shape": [7], "data_offsets": [20, 20]}}"#,
        &data,
    );
    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.tensor("scale").unwrap().to_f32_vec(), vec![1.5]);
    assert_eq!(file.info("position_ids").unwrap().dtype, "I64");
    let err = file.tensor("position_ids").unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    let msg = err.to_string();
    assert_contains(&msg, "position_ids");
    assert_contains(&msg, "I64");
    assert_contains(&msg, &path.display().to_string());
    assert_contains(&file.tensor("future").unwrap_err().to_string(), "F3_NEW");
}

#[test]
fn absent_tensor_is_missing_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("g.safetensors");
    good_file(&path);
    let file = SafetensorsFile::open(&path).unwrap();
    let err = file.tensor("nope").unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor(n) if n == "nope"),
        "{err}"
    );
}

#[test]
fn checkpoint_dir_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("no-such-model");
    assert_contains(&ckpt_err(&dir, &dir), "does not exist");
}

#[test]
fn checkpoint_dir_is_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.safetensors");
    good_file(&path);
    assert_contains(&ckpt_err(&path, &path), "not a directory");
}

#[test]
fn checkpoint_config_missing() {
    let (_tmp, dir) = ckpt_dir();
    fs::remove_file(dir.join("config.json")).unwrap();
    good_file(&dir.join("model.safetensors"));
    assert_contains(&ckpt_err(&dir, &dir.join("config.json")), "not found");
}

#[test]
fn checkpoint_without_weights() {
    let (_tmp, dir) = ckpt_dir();
    fs::write(dir.join("pytorch_model.bin"), b"pickle").unwrap();
    assert_contains(&ckpt_err(&dir, &dir), "no weights");
}

#[test]
fn checkpoint_damaged_single_file() {
    let (_tmp, dir) = ckpt_dir();
    let path = dir.join("model.safetensors");
    fs::write(&path, b"not safetensors at all").unwrap();
    assert_contains(&ckpt_err(&dir, &path), "header claims");
}

#[test]
fn index_malformed() {
    let (_tmp, dir) = ckpt_dir();
    let index = dir.join("model.safetensors.index.json");
    fs::write(&index, r#"{"weight_map": {"w": "a.safetensors""#).unwrap();
    assert_contains(&ckpt_err(&dir, &index), "not valid JSON");
    fs::write(&index, r#"{"metadata": {}}"#).unwrap();
    assert_contains(&ckpt_err(&dir, &index), "missing 'weight_map'");
    fs::write(&index, r#"{"weight_map": {}}"#).unwrap();
    assert_contains(&ckpt_err(&dir, &index), "'weight_map' is empty");
    fs::write(&index, r#"{"weight_map": {"w": 3}}"#).unwrap();
    assert_contains(&ckpt_err(&dir, &index), "tensor 'w'");
    fs::write(&index, r#"{"weight_map": {"w": "../outside.safetensors"}}"#).unwrap();
    assert_contains(&ckpt_err(&dir, &index), "not a file name inside");
}

#[test]
fn index_names_missing_shard() {
    let (_tmp, dir) = ckpt_dir();
    good_file(&dir.join("model-00001-of-00002.safetensors"));
    fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"w": "model-00001-of-00002.safetensors",
                           "v": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let shard = dir.join("model-00002-of-00002.safetensors");
    let msg = ckpt_err(&dir, &shard);
    assert_contains(&msg, "shard missing");
    assert_contains(&msg, "puts 1 tensor(s) here, e.g. 'v'");
}

#[test]
fn index_names_absent_tensor() {
    let (_tmp, dir) = ckpt_dir();
    good_file(&dir.join("model-00001-of-00001.safetensors"));
    let index = dir.join("model.safetensors.index.json");
    fs::write(
        &index,
        r#"{"weight_map": {"w": "model-00001-of-00001.safetensors",
                           "lm_head.weight": "model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    let msg = ckpt_err(&dir, &index);
    assert_contains(&msg, "tensor 'lm_head.weight'");
    assert_contains(&msg, "does not contain it");
}

#[test]
fn damaged_shard_is_named() {
    let (_tmp, dir) = ckpt_dir();
    let shard = dir.join("model-00001-of-00001.safetensors");
    good_file(&shard);
    let len = fs::metadata(&shard).unwrap().len();
    let f = fs::OpenOptions::new().write(true).open(&shard).unwrap();
    f.set_len(len - 1).unwrap();
    fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"w": "model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    assert_contains(&ckpt_err(&dir, &shard), "tensor 'w' ends at byte 24");
}

#[test]
fn loose_files_with_duplicate_tensor() {
    let (_tmp, dir) = ckpt_dir();
    good_file(&dir.join("a.safetensors"));
    good_file(&dir.join("b.safetensors"));
    let msg = ckpt_err(&dir, &dir.join("b.safetensors"));
    assert_contains(&msg, "tensor 'w' is also in");
    assert_contains(&msg, "a.safetensors");
}

#[test]
fn checkpoint_missing_and_unsupported_tensors() {
    let (_tmp, dir) = ckpt_dir();
    raw_file(
        &dir.join("model.safetensors"),
        r#"{"ids": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}"#,
        &[0; 8],
    );
    let ckpt = Checkpoint::open(&dir).unwrap();
    let err = ckpt.tensor("model.norm.weight").unwrap_err();
    assert_contains(&err.to_string(), "model.norm.weight");
    assert!(ckpt.get("model.norm.weight").is_none());
    assert!(ckpt.contains("ids"));
    assert!(ckpt.get("ids").is_none());
    let msg = ckpt.tensor("ids").unwrap_err().to_string();
    assert_contains(&msg, "tensor 'ids' has dtype I32");
    assert_eq!(ckpt.weight_bytes(), 8);
}

#[test]
fn read_json_reports_bad_json_with_path() {
    let (_tmp, dir) = ckpt_dir();
    good_file(&dir.join("model.safetensors"));
    let bad = dir.join("generation_config.json");
    fs::write(&bad, "{ not json").unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let msg = ckpt
        .read_json("generation_config.json")
        .unwrap_err()
        .to_string();
    assert_contains(&msg, &bad.display().to_string());
    assert_contains(&msg, "not valid JSON");
    assert!(ckpt.read_json("tokenizer_config.json").unwrap().is_none());
}

#[test]
fn corrupted_bytes_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.safetensors");
    let a = Tensor::from_f32(vec![2, 2], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let b = Tensor::from_f32(vec![3], &[5.0, 6.0, 7.0]).unwrap();
    write_safetensors(&good, &[("a", &a), ("b", &b)], None).unwrap();
    let original = fs::read(&good).unwrap();
    let path = tmp.path().join("bad.safetensors");
    // Every truncation, then every single-byte overwrite with a few values: open either fails
    // cleanly or yields a file whose every tensor can be accessed (or refused) without panicking.
    let mut variants: Vec<Vec<u8>> = (0..original.len())
        .map(|n| original[..n].to_vec())
        .collect();
    for i in 0..original.len() {
        for v in [0u8, b'9', b'"', b'}', 0xff] {
            let mut bytes = original.clone();
            bytes[i] = v;
            variants.push(bytes);
        }
    }
    for bytes in variants {
        fs::write(&path, &bytes).unwrap();
        if let Ok(file) = SafetensorsFile::open(&path) {
            for name in file.names() {
                if let Ok(t) = file.tensor(name) {
                    assert_eq!(t.byte_len(), t.numel() * t.dtype.size());
                }
            }
        }
    }
}
