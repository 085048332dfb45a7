//! Where a model runs: the `--device cpu|cuda[:N]` choice of every model command.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// A compute device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend (the default).
    #[default]
    Cpu,
    /// CUDA device number N (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Device, Error> {
        let bad = || {
            Error::InvalidArgument(format!(
                "device '{s}': expected cpu, cuda or cuda:N (N a device number)"
            ))
        };
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Device::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_cli_spellings_and_refuses_others_by_name() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("CUDA:3".parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["tpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains(&format!("'{bad}'")), "{e}");
        }
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}
