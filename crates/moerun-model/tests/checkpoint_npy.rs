//! `.npy` files: our writer's layout matches numpy's, files laid out as numpy writes them read back,
//! and anything outside the supported subset fails with a message naming the file.

use std::fs;
use std::path::Path;

use moerun_model::npy::{read_npy_f32, write_npy_f32};

/// A `.npy` file as numpy lays it out: magic, version, header length, `dict` padded with spaces so
/// the data starts at a multiple of 64, a final newline, then `data`.
fn numpy_style(dict: &str, version: u8, data: &[u8]) -> Vec<u8> {
    let prefix = if version == 1 { 10 } else { 12 };
    let unpadded = prefix + dict.len() + 1;
    let mut header = dict.to_string();
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.extend([version, 0]);
    if version == 1 {
        out.extend((header.len() as u16).to_le_bytes());
    } else {
        out.extend((header.len() as u32).to_le_bytes());
    }
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn read_err(path: &Path) -> String {
    let msg = read_npy_f32(path).unwrap_err().to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "no path in: {msg}"
    );
    msg
}

#[test]
fn round_trip_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("x.npy");
    let cases: [(Vec<usize>, Vec<f32>); 4] = [
        (vec![2, 3], vec![1.0, -2.0, 3.5, 0.0, 1e-7, f32::MAX]),
        (vec![4], vec![1.0, 2.0, 3.0, 4.0]),
        (vec![], vec![7.25]),
        (vec![2, 0, 3], vec![]),
    ];
    for (shape, data) in cases {
        write_npy_f32(&path, &shape, &data).unwrap();
        let (s, d) = read_npy_f32(&path).unwrap();
        assert_eq!(s, shape);
        assert_eq!(d, data);
    }
}

#[test]
fn written_layout_matches_numpy() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("l.npy");
    write_npy_f32(&path, &[2, 3], &[0.0; 6]).unwrap();
    let bytes = fs::read(&path).unwrap();
    let expected = numpy_style(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
        1,
        &[0; 24],
    );
    assert_eq!(bytes, expected);
    write_npy_f32(&path, &[5], &[0.0; 5]).unwrap();
    let bytes = fs::read(&path).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    assert_eq!((10 + header_len) % 64, 0);
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("'shape': (5,), }"), "{header}");
    assert!(header.ends_with(" \n"));
}

#[test]
fn reads_numpy_written_headers() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("n.npy");
    let values = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    fs::write(&path, numpy_style(dict, 1, &f32_bytes(&values))).unwrap();
    assert_eq!(read_npy_f32(&path).unwrap(), (vec![2, 3], values.to_vec()));
    // Newer numpy leaves spare spaces inside the dict so the shape can grow in place.
    let spare = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }}{}",
        " ".repeat(19)
    );
    fs::write(&path, numpy_style(&spare, 1, &f32_bytes(&values))).unwrap();
    assert_eq!(read_npy_f32(&path).unwrap(), (vec![6], values.to_vec()));
    // Format 2.0 only widens the header length field.
    fs::write(&path, numpy_style(dict, 2, &f32_bytes(&values))).unwrap();
    assert_eq!(read_npy_f32(&path).unwrap().0, [2, 3]);
}

#[test]
fn reads_f64_as_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("d.npy");
    let data: Vec<u8> = [0.5f64, -3.25]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 2), }";
    fs::write(&path, numpy_style(dict, 1, &data)).unwrap();
    assert_eq!(read_npy_f32(&path).unwrap(), (vec![1, 2], vec![0.5, -3.25]));
}

#[test]
fn rejects_unsupported_arrays() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("u.npy");
    let cases = [
        (
            "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }",
            "'>f4' is not supported",
        ),
        (
            "{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }",
            "'<i8' is not supported",
        ),
        (
            "{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }",
            "Fortran-order",
        ),
        ("{'descr': '<f4', 'shape': (2,), }", "no 'fortran_order'"),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }",
            "malformed header",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }",
            "needs 12 data bytes",
        ),
    ];
    for (dict, expected) in cases {
        fs::write(&path, numpy_style(dict, 1, &[0; 8])).unwrap();
        let msg = read_err(&path);
        assert!(
            msg.contains(expected),
            "{dict}: expected {expected:?} in {msg}"
        );
    }
}

#[test]
fn rejects_damaged_files() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bad.npy");
    fs::write(&path, b"PK\x03\x04 this is a zip").unwrap();
    assert!(read_err(&path).contains("not a .npy file"));
    let mut truncated = b"\x93NUMPY\x01\x00".to_vec();
    truncated.extend(500u16.to_le_bytes());
    truncated.extend(b"{'descr': '<f4'");
    fs::write(&path, truncated).unwrap();
    assert!(read_err(&path).contains("header claims 500 bytes"));
    fs::write(&path, b"\x93NUMPY\x09\x00\x10\x00").unwrap();
    assert!(read_err(&path).contains("unsupported format version 9.0"));
    let missing = tmp.path().join("absent.npy");
    read_err(&missing);
}

#[test]
fn write_rejects_shape_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("w.npy");
    let msg = write_npy_f32(&path, &[2, 2], &[1.0; 3])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("[2, 2]"), "{msg}");
    assert!(!path.exists());
}
