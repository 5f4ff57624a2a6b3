//! Choosing the compute device from `cpu`, `cuda` or `cuda:N`.
//!
//! The default build is CPU-only (the `cuda` feature needs nvcc at build time and the driver at
//! run time), so asking a CPU build for CUDA must fail with a message that says how to get it.

use candle_core::Device;

/// A parsed device name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU.
    Cpu,
    /// An NVIDIA GPU by ordinal.
    Cuda(usize),
}

/// Parses `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn parse(name: &str) -> Result<DeviceChoice, String> {
    match name {
        "cpu" => Ok(DeviceChoice::Cpu),
        "cuda" => Ok(DeviceChoice::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
            _ => Err(format!(
                "unknown device {other:?}; use \"cpu\", \"cuda\" or \"cuda:N\""
            )),
        },
    }
}

/// Opens the device, failing clearly when this build or machine cannot provide it.
pub fn open(choice: DeviceChoice) -> Result<Device, String> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda(n) => {
            if !cfg!(feature = "cuda") {
                return Err(format!(
                    "device cuda:{n} requested, but this p2ptrain was built without CUDA support; rebuild with `cargo build --release --features cuda` (needs the CUDA toolkit) or use --device cpu"
                ));
            }
            Device::new_cuda(n).map_err(|e| format!("cannot open cuda:{n}: {e}"))
        }
    }
}

/// The canonical name of a device choice, as status reports it.
pub fn name(choice: DeviceChoice) -> String {
    match choice {
        DeviceChoice::Cpu => "cpu".into(),
        DeviceChoice::Cuda(n) => format!("cuda:{n}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names() {
        assert_eq!(parse("cpu"), Ok(DeviceChoice::Cpu));
        assert_eq!(parse("cuda"), Ok(DeviceChoice::Cuda(0)));
        assert_eq!(parse("cuda:3"), Ok(DeviceChoice::Cuda(3)));
        assert!(parse("gpu").is_err());
        assert!(parse("cuda:x").is_err());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_says_how() {
        let e = open(DeviceChoice::Cuda(0)).expect_err("must fail");
        assert!(e.contains("without CUDA support"), "{e}");
    }
}
