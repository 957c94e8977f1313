//! Compute devices.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Where a tensor lives and computation runs.
///
/// ```
/// use kiln_core::Device;
///
/// let d: Device = "cuda:1".parse()?;
/// assert_eq!(d, Device::Cuda(1));
/// assert!(d.is_cuda());
/// assert_eq!("cuda".parse::<Device>()?, Device::Cuda(0));
/// assert_eq!(Device::default().to_string(), "cpu");
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory and CPU kernels.
    #[default]
    Cpu,
    /// The CUDA GPU with the given ordinal.
    Cuda(usize),
}

impl Device {
    /// Whether this is a CUDA device.
    pub const fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `"cpu"`, `"cuda"` (meaning `cuda:0`) or `"cuda:N"`.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        let invalid = || {
            Error::invalid_argument(
                "device",
                format!("unknown device `{s}`; expected `cpu`, `cuda` or `cuda:N` with N >= 0"),
            )
        };
        match t {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let ordinal = t.strip_prefix("cuda:").ok_or_else(invalid)?;
                if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(invalid());
                }
                ordinal.parse().map(Device::Cuda).map_err(|_| invalid())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display() {
        assert_eq!(Device::Cpu.to_string(), "cpu");
        assert_eq!(Device::Cuda(0).to_string(), "cuda:0");
        assert_eq!(Device::Cuda(7).to_string(), "cuda:7");
    }

    #[test]
    fn parse_valid() -> Result<()> {
        assert_eq!("cpu".parse::<Device>()?, Device::Cpu);
        assert_eq!("cuda".parse::<Device>()?, Device::Cuda(0));
        assert_eq!("cuda:0".parse::<Device>()?, Device::Cuda(0));
        assert_eq!(" cuda:12 ".parse::<Device>()?, Device::Cuda(12));
        for d in [Device::Cpu, Device::Cuda(3)] {
            assert_eq!(d.to_string().parse::<Device>()?, d);
        }
        Ok(())
    }

    #[test]
    fn parse_invalid() {
        for bad in [
            "gpu", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "cuda1", "CPU:0", "",
        ] {
            let err = bad.parse::<Device>().expect_err(bad);
            assert!(
                matches!(err, Error::InvalidArgument { ref name, .. } if name == "device"),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
            assert!(err.to_string().contains("`cuda:N`"), "{err}");
        }
        // An ordinal too large for usize.
        assert!("cuda:99999999999999999999999".parse::<Device>().is_err());
    }

    #[test]
    fn predicates_and_default() {
        assert!(!Device::Cpu.is_cuda());
        assert!(Device::Cuda(2).is_cuda());
        assert_eq!(Device::default(), Device::Cpu);
    }
}
