//! The compute device: `cpu`, `cuda` or `cuda:N`, parsed once (when the config is loaded or a
//! `--device` override applied) into a [`DeviceSpec`] that the rest of the daemon carries, and
//! opened once when the node is prepared, a GPU with its levers applied
//! ([`p2ptrain_models::gpu::prepare`]) before any tensor exists on it. It does not pick a
//! device by itself.
//!
//! The default build is CPU-only (the `cuda` feature needs nvcc at build time and the driver at
//! run time), so asking a CPU build for CUDA must fail with a message that says how to get it.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A parsed device name; its `Display` is the canonical name status reports (`cpu`,
/// `cuda:N`), so `cuda` and `cuda:0` are one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU: the default, because every build has it.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal.
    Cuda(usize),
}

/// Why a device name was refused or a device could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The name is none of `cpu`, `cuda`, `cuda:N`.
    #[error("unknown device {0:?}; use \"cpu\", \"cuda\" or \"cuda:N\"")]
    Unknown(String),
    /// CUDA was asked of a build without the `cuda` feature.
    #[error("device cuda:{0} requested, but this p2ptrain was built without CUDA support; rebuild with `cargo build --release --features cuda` (needs the CUDA toolkit) or use --device cpu")]
    NoCudaSupport(usize),
    /// The driver could not open the GPU. The message leaves the reason to the error's
    /// source, which the binary edge prints after it (`{:#}`): in the message too, the
    /// driver's reason was printed twice on one line.
    #[error("cannot open cuda:{ordinal}")]
    Cuda {
        /// The GPU asked for.
        ordinal: usize,
        /// Candle's reason.
        source: candle_core::Error,
    },
    /// The GPU opened, but its levers (`P2PTRAIN_CUDA_LEVERS`) could not be applied or its
    /// kernels not compiled.
    #[error("cannot prepare cuda:{ordinal}")]
    Prepare {
        /// The GPU asked for.
        ordinal: usize,
        /// Why.
        source: p2ptrain_models::Error,
    },
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    /// Parses `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(name: &str) -> Result<DeviceSpec, DeviceError> {
        match name {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(n)),
                _ => Err(DeviceError::Unknown(other.to_string())),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

// As a string, the way the config file writes it.
impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<DeviceSpec, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl DeviceSpec {
    /// Opens the device, failing clearly when this build or machine cannot provide it.
    pub fn open(self) -> Result<Device, DeviceError> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => {
                if !cfg!(feature = "cuda") {
                    return Err(DeviceError::NoCudaSupport(n));
                }
                let dev = Device::new_cuda(n)
                    .map_err(|source| DeviceError::Cuda { ordinal: n, source })?;
                p2ptrain_models::gpu::prepare(&dev)
                    .map_err(|source| DeviceError::Prepare { ordinal: n, source })?;
                Ok(dev)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names() {
        let parse = |s: &str| s.parse::<DeviceSpec>().ok();
        assert_eq!(parse("cpu"), Some(DeviceSpec::Cpu));
        assert_eq!(parse("cuda"), Some(DeviceSpec::Cuda(0)));
        assert_eq!(parse("cuda:3"), Some(DeviceSpec::Cuda(3)));
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        assert!(parse("gpu").is_none());
        assert!(parse("cuda:x").is_none());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_says_how() {
        let e = DeviceSpec::Cuda(0)
            .open()
            .expect_err("must fail")
            .to_string();
        assert!(e.contains("without CUDA support"), "{e}");
    }
}
