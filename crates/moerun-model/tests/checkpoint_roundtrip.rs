//! Well-formed checkpoints: safetensors written by our writer read back bit for bit, zero-copy, and
//! the three checkpoint layouts (single file, index plus shards, loose files) resolve every tensor.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use half::{bf16, f16};
use moerun_core::{DType, SharedBytes, Tensor};
use moerun_model::checkpoint::Checkpoint;
use moerun_model::safetensors::{
    write_safetensors, SafetensorsFile, SafetensorsWriter, TensorSpec,
};

fn bf16_tensor(shape: Vec<usize>, values: &[f32]) -> Tensor {
    let bytes = values
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
        .collect();
    Tensor::new(DType::BF16, shape, SharedBytes::from_vec(bytes)).unwrap()
}

fn f16_tensor(shape: Vec<usize>, values: &[f32]) -> Tensor {
    let bytes = values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
        .collect();
    Tensor::new(DType::F16, shape, SharedBytes::from_vec(bytes)).unwrap()
}

/// A directory with config.json, for checkpoint tests.
fn ckpt_dir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(
        tmp.path().join("config.json"),
        r#"{"model_type": "test", "hidden_size": 4}"#,
    )
    .unwrap();
    tmp
}

fn write_one(path: &Path, name: &str, t: &Tensor) {
    write_safetensors(path, &[(name, t)], None).unwrap();
}

#[test]
fn all_dtypes_round_trip_with_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.safetensors");
    let values = [0.5, -1.25, 3.0, 1024.0, -0.0, 7.5];
    let a = Tensor::from_f32(vec![2, 3], &values).unwrap();
    let b = bf16_tensor(vec![3, 2], &values);
    let c = f16_tensor(vec![6], &values);
    let scalar = Tensor::from_f32(vec![], &[42.0]).unwrap();
    let empty = Tensor::from_f32(vec![0, 5], &[]).unwrap();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let list = [
        ("a.f32", &a),
        ("b.bf16", &b),
        ("c.f16", &c),
        ("scalar", &scalar),
        ("empty", &empty),
    ];
    write_safetensors(&path, &list, Some(&meta)).unwrap();

    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.metadata(), &meta);
    assert_eq!(file.len(), 5);
    // names() follows the on-disk order, which is the order written.
    let names: Vec<&str> = file.names().collect();
    assert_eq!(names, ["a.f32", "b.bf16", "c.f16", "scalar", "empty"]);
    for (name, original) in list {
        let back = file.tensor(name).unwrap();
        assert_eq!(back.dtype, original.dtype, "{name}");
        assert_eq!(back.shape, original.shape, "{name}");
        assert_eq!(back.bytes(), original.bytes(), "{name}");
    }
    assert_eq!(file.tensor("b.bf16").unwrap().to_f32_vec(), values);
    assert_eq!(file.tensor("c.f16").unwrap().to_f32_vec(), values);
    let info = file.info("b.bf16").unwrap();
    assert_eq!(info.dtype, "BF16");
    assert_eq!(info.shape, [3, 2]);
    assert_eq!(info.byte_len(), 12);
    assert_eq!(file.data_bytes(), 24 + 12 + 12 + 4);
}

#[test]
fn header_is_padded_to_eight_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("p.safetensors");
    write_one(&path, "x", &Tensor::from_f32(vec![1], &[1.0]).unwrap());
    let bytes = fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    assert_eq!(bytes.len(), 8 + n + 4);
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(header).unwrap();
    assert_eq!(parsed["x"]["data_offsets"], serde_json::json!([0, 4]));
}

#[test]
fn tensors_borrow_the_mapping() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("z.safetensors");
    let a = Tensor::from_f32(vec![4], &[1.0; 4]).unwrap();
    let b = Tensor::from_f32(vec![2], &[2.0; 2]).unwrap();
    write_safetensors(&path, &[("a", &a), ("b", &b)], None).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    let a1 = file.tensor("a").unwrap();
    let a2 = file.tensor("a").unwrap();
    assert_eq!(a1.bytes().as_ptr(), a2.bytes().as_ptr());
    // b sits right after a in the same mapping: the views are windows, not copies.
    let b1 = file.tensor("b").unwrap();
    assert_eq!(
        b1.bytes().as_ptr() as usize - a1.bytes().as_ptr() as usize,
        16
    );
    // The views outlive the file handle: they own a share of the mapping.
    drop(file);
    assert_eq!(b1.to_f32_vec(), [2.0, 2.0]);
}

#[test]
fn streaming_writer_accepts_chunks_across_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("s.safetensors");
    let specs = [
        TensorSpec {
            name: "a".into(),
            dtype: DType::F32,
            shape: vec![2],
        },
        TensorSpec {
            name: "b".into(),
            dtype: DType::BF16,
            shape: vec![2, 2],
        },
    ];
    let mut data = Vec::new();
    data.extend(1.0f32.to_le_bytes());
    data.extend(2.0f32.to_le_bytes());
    for v in [1.0f32, 2.0, 3.0, 4.0] {
        data.extend(bf16::from_f32(v).to_bits().to_le_bytes());
    }
    let mut w = SafetensorsWriter::create(&path, &specs, None).unwrap();
    for chunk in data.chunks(3) {
        w.write_data(chunk).unwrap();
    }
    w.finish().unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.tensor("a").unwrap().to_f32_vec(), [1.0, 2.0]);
    assert_eq!(file.tensor("b").unwrap().to_f32_vec(), [1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn streaming_writer_refuses_misuse() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bad.safetensors");
    let spec = TensorSpec {
        name: "a".into(),
        dtype: DType::F32,
        shape: vec![1],
    };
    let mut w = SafetensorsWriter::create(&path, std::slice::from_ref(&spec), None).unwrap();
    assert!(w.write_data(&[0; 5]).is_err());
    let msg = w.finish().unwrap_err().to_string();
    assert!(msg.contains("only 0 of the 4"), "{msg}");
    let twice = [spec.clone(), spec.clone()];
    let msg = SafetensorsWriter::create(&path, &twice, None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("listed twice"), "{msg}");
    let reserved = TensorSpec {
        name: "__metadata__".into(),
        ..spec
    };
    assert!(SafetensorsWriter::create(&path, &[reserved], None).is_err());
}

#[test]
fn single_file_checkpoint() {
    let tmp = ckpt_dir();
    let emb = bf16_tensor(vec![4, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    let norm = Tensor::from_f32(vec![2], &[1.0, 1.0]).unwrap();
    write_safetensors(
        tmp.path().join("model.safetensors"),
        &[
            ("model.embed_tokens.weight", &emb),
            ("model.norm.weight", &norm),
        ],
        None,
    )
    .unwrap();
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    assert_eq!(ckpt.dir(), tmp.path());
    assert_eq!(ckpt.len(), 2);
    assert_eq!(
        ckpt.names().collect::<Vec<_>>(),
        ["model.embed_tokens.weight", "model.norm.weight"]
    );
    assert!(ckpt.contains("model.norm.weight"));
    assert_eq!(
        ckpt.tensor("model.norm.weight").unwrap().to_f32_vec(),
        [1.0, 1.0]
    );
    assert_eq!(ckpt.get("model.embed_tokens.weight").unwrap().shape, [4, 2]);
    assert!(ckpt.get("lm_head.weight").is_none());
    assert_eq!(
        ckpt.info("model.embed_tokens.weight").unwrap().dtype,
        "BF16"
    );
    assert_eq!(ckpt.weight_bytes(), 16 + 8);
    let config = ckpt.read_json("config.json").unwrap().unwrap();
    assert_eq!(config["hidden_size"], 4);
    assert!(ckpt.read_json("generation_config.json").unwrap().is_none());
}

#[test]
fn sharded_checkpoint() {
    let tmp = ckpt_dir();
    let dir = tmp.path();
    let a = Tensor::from_f32(vec![2], &[1.0, 2.0]).unwrap();
    let b = f16_tensor(vec![3], &[3.0, 4.0, 5.0]);
    let c = bf16_tensor(vec![1], &[6.0]);
    write_safetensors(
        dir.join("model-00001-of-00002.safetensors"),
        &[("layers.0.w", &a), ("layers.0.v", &c)],
        None,
    )
    .unwrap();
    write_one(
        &dir.join("model-00002-of-00002.safetensors"),
        "layers.1.w",
        &b,
    );
    fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"metadata": {"total_size": 16},
            "weight_map": {"layers.0.w": "model-00001-of-00002.safetensors",
                           "layers.0.v": "model-00001-of-00002.safetensors",
                           "layers.1.w": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    assert_eq!(ckpt.files().count(), 2);
    assert_eq!(
        ckpt.names().collect::<Vec<_>>(),
        ["layers.0.v", "layers.0.w", "layers.1.w"]
    );
    assert_eq!(ckpt.tensor("layers.0.w").unwrap().to_f32_vec(), [1.0, 2.0]);
    assert_eq!(ckpt.tensor("layers.0.v").unwrap().to_f32_vec(), [6.0]);
    assert_eq!(
        ckpt.tensor("layers.1.w").unwrap().to_f32_vec(),
        [3.0, 4.0, 5.0]
    );
    assert_eq!(ckpt.weight_bytes(), 8 + 6 + 2);
}

#[test]
fn loose_files_are_all_loaded() {
    let tmp = ckpt_dir();
    let dir = tmp.path();
    write_one(
        &dir.join("consolidated-b.safetensors"),
        "b",
        &Tensor::from_f32(vec![1], &[2.0]).unwrap(),
    );
    write_one(
        &dir.join("consolidated-a.safetensors"),
        "a",
        &Tensor::from_f32(vec![1], &[1.0]).unwrap(),
    );
    let ckpt = Checkpoint::open(dir).unwrap();
    let files: Vec<_> = ckpt
        .files()
        .map(|p| p.file_name().unwrap().to_owned())
        .collect();
    assert_eq!(
        files,
        ["consolidated-a.safetensors", "consolidated-b.safetensors"]
    );
    assert_eq!(ckpt.tensor("a").unwrap().to_f32_vec(), [1.0]);
    assert_eq!(ckpt.tensor("b").unwrap().to_f32_vec(), [2.0]);
}

#[test]
fn single_file_takes_precedence_over_index() {
    let tmp = ckpt_dir();
    let dir = tmp.path();
    write_one(
        &dir.join("model.safetensors"),
        "w",
        &Tensor::from_f32(vec![1], &[9.0]).unwrap(),
    );
    // A stale index naming a shard that is gone must not matter when model.safetensors exists.
    fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"w": "model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    assert_eq!(ckpt.tensor("w").unwrap().to_f32_vec(), [9.0]);
}

#[test]
fn weights_copied_to_memory_are_the_same_bytes_and_leave_the_file() {
    let tmp = ckpt_dir();
    let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.25 - 7.0).collect();
    let emb = bf16_tensor(vec![1024, 4], &values);
    let path = tmp.path().join("model.safetensors");
    write_safetensors(&path, &[("model.embed_tokens.weight", &emb)], None).unwrap();
    let mut ckpt = Checkpoint::open(tmp.path()).unwrap();
    let mapped = ckpt.tensor("model.embed_tokens.weight").unwrap();
    let file_len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(ckpt.file_bytes(), file_len);
    ckpt.copy_to_memory().unwrap();
    let copied = ckpt.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(copied.bytes(), mapped.bytes());
    assert_ne!(
        copied.bytes().as_ptr(),
        mapped.bytes().as_ptr(),
        "tensors made after the copy borrow the copy"
    );
    // The copy does not depend on the file any more.
    std::fs::remove_file(&path).unwrap();
    assert_eq!(copied.to_f32_vec(), emb.to_f32_vec());
}

#[test]
fn explicit_weight_placements_are_kept_and_auto_picks_one() {
    use moerun_model::WeightsIn;
    assert_eq!(WeightsIn::Mapped.resolve(1), WeightsIn::Mapped);
    assert_eq!(WeightsIn::Memory.resolve(u64::MAX), WeightsIn::Memory);
    // More than any machine has: mapped.
    assert_eq!(WeightsIn::Auto.resolve(u64::MAX), WeightsIn::Mapped);
    assert_ne!(WeightsIn::Auto.resolve(1), WeightsIn::Auto);
}
