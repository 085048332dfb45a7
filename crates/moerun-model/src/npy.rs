//! NumPy `.npy` files of floats, the exchange format for reference activations and logits produced
//! by Python tooling (e.g. a transformers forward pass we compare against).
//!
//! [`write_npy_f32`] writes format version 1.0, dtype `<f4`, C order, with the header padded so the
//! data starts at a multiple of 64 bytes, exactly as `numpy.save` lays it out, so `numpy.load` reads
//! it back. [`read_npy_f32`] reads C-order little-endian `<f4` and `<f8` arrays (the latter narrowed
//! to f32) in format versions 1.0 to 3.0, and rejects anything else with one line naming the file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use moerun_core::{Error, Result};

/// Every `.npy` file starts with these six bytes.
const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// numpy aligns the start of the data to this many bytes.
const ALIGN: usize = 64;

/// Write `data` (C order, `shape.iter().product()` elements) to `path` as a `.npy` file of `<f4`.
pub fn write_npy_f32(path: impl AsRef<Path>, shape: &[usize], data: &[f32]) -> Result<()> {
    let path = path.as_ref();
    let numel = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    if numel != Some(data.len()) {
        return Err(Error::InvalidArgument(format!(
            "{}: shape {shape:?} does not hold the {} values given",
            path.display(),
            data.len()
        )));
    }
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    // Python's tuple repr: a one-element tuple keeps its trailing comma.
    let shape_repr = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_repr}, }}").into_bytes();
    // magic (6) + version (2) + header length (2) + header, where the header ends in '\n'.
    let unpadded = MAGIC.len() + 2 + 2 + header.len() + 1;
    header.resize(
        header.len() + unpadded.next_multiple_of(ALIGN) - unpadded,
        b' ',
    );
    header.push(b'\n');
    let header_len = u16::try_from(header.len()).map_err(|_| {
        Error::InvalidArgument(format!(
            "{}: shape {shape:?} makes a header too long for .npy version 1.0",
            path.display()
        ))
    })?;
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let mut out = BufWriter::new(file);
    let write = |out: &mut BufWriter<File>| -> std::io::Result<()> {
        out.write_all(MAGIC)?;
        out.write_all(&[1, 0])?;
        out.write_all(&header_len.to_le_bytes())?;
        out.write_all(&header)?;
        for v in data {
            out.write_all(&v.to_le_bytes())?;
        }
        out.flush()
    };
    write(&mut out).map_err(|e| Error::io(path, e))
}

/// Read a C-order `<f4` or `<f8` `.npy` file at `path`: its shape and its values as f32.
pub fn read_npy_f32(path: impl AsRef<Path>) -> Result<(Vec<usize>, Vec<f32>)> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_npy(&bytes).map_err(|reason| Error::BadFile {
        path: path.to_path_buf(),
        reason,
    })
}

/// Parse a whole `.npy` file held in memory; errors are the reason part of a message.
fn parse_npy(bytes: &[u8]) -> Result<(Vec<usize>, Vec<f32>), String> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a .npy file (missing the \\x93NUMPY magic)".into());
    }
    let (major, minor) = (bytes[6], bytes[7]);
    // Version 1.0 has a 2-byte header length; 2.0 and 3.0 a 4-byte one.
    let (header_start, header_len): (usize, usize) = match major {
        1 => (10, usize::from(u16::from_le_bytes([bytes[8], bytes[9]]))),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err("file ends inside the preamble".into());
            }
            let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
            let n = usize::try_from(n).map_err(|_| "header length does not fit in memory")?;
            (12, n)
        }
        _ => return Err(format!("unsupported format version {major}.{minor}")),
    };
    let data_start = header_start
        .checked_add(header_len)
        .filter(|&end| end <= bytes.len())
        .ok_or_else(|| {
            format!(
                "header claims {header_len} bytes but the file has only {} after the preamble",
                bytes.len() - header_start
            )
        })?;
    let header = std::str::from_utf8(&bytes[header_start..data_start])
        .map_err(|e| format!("header is not valid UTF-8: {e}"))?;
    let dict =
        parse_header_dict(header).map_err(|e| format!("malformed header {header:?}: {e}"))?;
    let descr = dict.descr.ok_or("header has no 'descr'")?;
    let fortran = dict.fortran_order.ok_or("header has no 'fortran_order'")?;
    let shape = dict.shape.ok_or("header has no 'shape'")?;
    let width = match descr.as_str() {
        "<f4" => 4,
        "<f8" => 8,
        other => {
            return Err(format!(
                "dtype '{other}' is not supported; expected '<f4' or '<f8' (little-endian float)"
            ))
        }
    };
    if fortran {
        return Err("Fortran-order arrays are not supported; save a C-order array".into());
    }
    let data = &bytes[data_start..];
    let needed = shape
        .iter()
        .try_fold(width, |acc: usize, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} overflows the byte count"))?;
    if data.len() != needed {
        return Err(format!(
            "shape {shape:?} of '{descr}' needs {needed} data bytes but the file has {}",
            data.len()
        ));
    }
    let values = if width == 4 {
        data.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    } else {
        data.chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect()
    };
    Ok((shape, values))
}

/// The three keys of a `.npy` header dictionary, each present or not.
#[derive(Default)]
struct HeaderDict {
    descr: Option<String>,
    fortran_order: Option<bool>,
    shape: Option<Vec<usize>>,
}

/// A value of the Python literal subset `.npy` headers use.
enum PyValue {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

/// Parse the Python dict literal of a `.npy` header, e.g.
/// `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`.
fn parse_header_dict(text: &str) -> Result<HeaderDict, String> {
    let mut p = Cursor {
        s: text.as_bytes(),
        i: 0,
    };
    let mut dict = HeaderDict::default();
    p.expect(b'{')?;
    loop {
        if p.eat(b'}') {
            break;
        }
        let PyValue::Str(key) = p.value()? else {
            return Err("dictionary keys must be strings".into());
        };
        p.expect(b':')?;
        match (key.as_str(), p.value()?) {
            ("descr", PyValue::Str(s)) => dict.descr = Some(s),
            ("fortran_order", PyValue::Bool(b)) => dict.fortran_order = Some(b),
            ("shape", PyValue::Tuple(t)) => dict.shape = Some(t),
            ("descr" | "fortran_order" | "shape", _) => {
                return Err(format!("'{key}' has the wrong type"))
            }
            // numpy writes only the three keys above; tolerating others costs nothing.
            _ => {}
        }
        if !p.eat(b',') {
            p.expect(b'}')?;
            break;
        }
    }
    if p.peek().is_some() {
        return Err(format!(
            "unexpected text after the dictionary at byte {}",
            p.i
        ));
    }
    Ok(dict)
}

/// A position in header text; every method skips whitespace first.
struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    /// The next non-whitespace byte, not consumed.
    fn peek(&mut self) -> Option<u8> {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
        self.s.get(self.i).copied()
    }

    /// Consume `c` if it is next.
    fn eat(&mut self, c: u8) -> bool {
        let found = self.peek() == Some(c);
        if found {
            self.i += 1;
        }
        found
    }

    /// Consume `c`, or fail saying where it was expected.
    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected '{}' at byte {}", c as char, self.i))
        }
    }

    /// A string, boolean or tuple of non-negative integers.
    fn value(&mut self) -> Result<PyValue, String> {
        match self.peek() {
            Some(q @ (b'\'' | b'"')) => {
                let start = self.i + 1;
                let len = self.s[start..]
                    .iter()
                    .position(|&b| b == q)
                    .ok_or("unterminated string")?;
                self.i = start + len + 1;
                let s = std::str::from_utf8(&self.s[start..start + len])
                    .map_err(|_| "string is not UTF-8")?;
                Ok(PyValue::Str(s.to_string()))
            }
            Some(b'T') if self.s[self.i..].starts_with(b"True") => {
                self.i += 4;
                Ok(PyValue::Bool(true))
            }
            Some(b'F') if self.s[self.i..].starts_with(b"False") => {
                self.i += 5;
                Ok(PyValue::Bool(false))
            }
            Some(b'(') => {
                self.i += 1;
                let mut dims = Vec::new();
                while !self.eat(b')') {
                    dims.push(self.integer()?);
                    if !self.eat(b',') {
                        self.expect(b')')?;
                        break;
                    }
                }
                Ok(PyValue::Tuple(dims))
            }
            _ => Err(format!("unexpected value at byte {}", self.i)),
        }
    }

    /// A non-negative decimal integer (Python 2 era files may suffix it with `L`).
    fn integer(&mut self) -> Result<usize, String> {
        self.peek();
        let start = self.i;
        while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        let digits = std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?;
        let n = digits
            .parse()
            .map_err(|_| format!("expected a dimension at byte {start}"))?;
        if self.s.get(self.i) == Some(&b'L') {
            self.i += 1;
        }
        Ok(n)
    }
}
