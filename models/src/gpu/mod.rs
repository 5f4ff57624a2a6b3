//! The GPU side of the numeric core: the levers that make Candle's CUDA step cheaper, and the
//! GPU twins of the fused CPU kernels.
//!
//! Candle's own CUDA step of the 10.8 M GPT was a quarter of PyTorch eager's and host-bound
//! (on an H200, 1.4% of a step spent waiting for the GPU): thousands of small kernels from its
//! composite ops and autograd. Measured there (docs/gpu.md), the `kernels` lever alone made
//! the step 3.4 times as fast and GPU-bound; each of the other three alone changed nothing
//! measurable. The levers, each of which can be turned off on its own to measure it
//! (`P2PTRAIN_CUDA_LEVERS`, see [`Levers`]):
//! - `events-off`: cudarc records CUDA events on every allocation and kernel argument by
//!   default, so that several streams can share buffers; a node uses one stream, so they are
//!   pure host cost (cudarc issue 386, candle issue 2999).
//! - `pool`: the stream-ordered memory pool hands its memory back to the driver at every
//!   synchronisation (release threshold 0); with the threshold at its maximum it keeps it.
//! - `htod-cache`: every strided or broadcast op uploads its dimensions and strides from
//!   pageable host memory; while a guard lives ([`step_guard`]), Candle's upload cache keeps
//!   every upload of 4 KiB or less on the device, keyed by its content, for good (Candle never
//!   evicts). So a guard may only cover work whose small uploads are the same every step: the
//!   GPT's hand-written step (its batch uploaded before) and the optimizer, not the MLP's,
//!   which uploads each batch's one-hot labels.
//! - `kernels`: the fused kernels (layer norm, RMS norm, causal softmax, SiLU, SwiGLU, rotary
//!   embeddings, cross-entropy, bias, row sums, and their gradients) and the in-place
//!   optimizer passes run on the GPU too (`kernels.cu`, compiled at run time by NVRTC), and
//!   with them the GPT's and the Llama's hand-written backward passes, instead of Candle's
//!   composite ops and autograd.
//! - `tf32` (off unless named): matrix products in TF32, as PyTorch's
//!   `allow_tf32`; compare like with like.
//!
//! Without the `cuda` feature every function here is a no-op: no device is ever CUDA there.

use candle_core::Device;

use crate::{Error, Result};

#[cfg(feature = "cuda")]
pub(crate) mod ops;
#[cfg(all(test, feature = "cuda"))]
mod twins;

/// The environment variable that picks the levers: unset or `default` for every lever but
/// `tf32`, `none` (or empty) for none, or a comma-separated list of lever names (`default`
/// inside a list stands for the default set, so `default,tf32` adds TF32).
pub const LEVERS_ENV: &str = "P2PTRAIN_CUDA_LEVERS";

/// Which of the GPU levers are on for this process (read once from [`LEVERS_ENV`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Levers {
    /// cudarc's per-allocation and per-argument CUDA events off.
    pub events_off: bool,
    /// The default memory pool keeps its memory (release threshold at its maximum).
    pub pool: bool,
    /// Candle's cache of small uploads around each step.
    pub htod_cache: bool,
    /// The fused GPU kernels and the hand-written backward passes.
    pub kernels: bool,
    /// TF32 matrix products.
    pub tf32: bool,
}

impl Levers {
    /// Every lever but TF32.
    pub const DEFAULT: Levers = Levers {
        events_off: true,
        pool: true,
        htod_cache: true,
        kernels: true,
        tf32: false,
    };

    /// No lever: Candle's CUDA path as it comes.
    pub const NONE: Levers = Levers {
        events_off: false,
        pool: false,
        htod_cache: false,
        kernels: false,
        tf32: false,
    };

    /// Parses a lever list (see [`LEVERS_ENV`]).
    pub fn parse(list: &str) -> Result<Levers> {
        let mut levers = Levers::NONE;
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match name {
                "default" => {
                    let tf32 = levers.tf32;
                    levers = Levers { tf32, ..Levers::DEFAULT };
                }
                "none" => levers = Levers::NONE,
                "events-off" => levers.events_off = true,
                "pool" => levers.pool = true,
                "htod-cache" => levers.htod_cache = true,
                "kernels" => levers.kernels = true,
                "tf32" => levers.tf32 = true,
                other => {
                    return Err(Error::Spec(format!(
                        "{LEVERS_ENV}: unknown lever {other:?} (default, none, events-off, pool, htod-cache, kernels, tf32)"
                    )))
                }
            }
        }
        Ok(levers)
    }

    /// The levers of this process: [`LEVERS_ENV`] read once; the default set when it is unset.
    pub fn current() -> Result<Levers> {
        static LEVERS: std::sync::OnceLock<std::result::Result<Levers, String>> =
            std::sync::OnceLock::new();
        LEVERS
            .get_or_init(|| match std::env::var(LEVERS_ENV) {
                Ok(list) => Levers::parse(&list).map_err(|e| match e {
                    Error::Spec(why) => why,
                    other => other.to_string(),
                }),
                Err(_) => Ok(Levers::DEFAULT),
            })
            .clone()
            .map_err(Error::Spec)
    }

    /// The levers that are on, by name, comma-separated (`none` for none): for reports.
    pub fn names(&self) -> String {
        let on: Vec<&str> = [
            (self.events_off, "events-off"),
            (self.pool, "pool"),
            (self.htod_cache, "htod-cache"),
            (self.kernels, "kernels"),
            (self.tf32, "tf32"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect();
        if on.is_empty() {
            "none".into()
        } else {
            on.join(",")
        }
    }
}

/// Applies the device-wide levers to a freshly opened device, before any tensor exists on it
/// (event tracking can only be turned off then): a no-op for the CPU.
pub fn prepare(dev: &Device) -> Result<()> {
    let levers = Levers::current()?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = dev {
        ops::prepare(cuda, &levers)?;
    }
    let _ = (dev, levers);
    Ok(())
}

/// The upload cache for one step's ops on `dev`, for as long as the returned guard lives
/// (nothing on the CPU or with the lever off): Candle caches the small host-to-device uploads
/// (dimensions and strides) of the ops this thread runs meanwhile, for good; see the module's
/// `htod-cache`. Only work whose small uploads are the same every step belongs under it
/// (upload a step's batch before taking it).
#[must_use = "the cache is on only while the guard lives"]
pub fn step_guard(dev: &Device) -> impl Sized {
    #[cfg(feature = "cuda")]
    {
        let on = matches!(Levers::current(), Ok(l) if l.htod_cache);
        match dev {
            Device::Cuda(cuda) if on => Some(cuda.enable_cuda_graph_htod_cache()),
            _ => None,
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = dev;
        None::<()>
    }
}

/// Hands the memory that `dev`'s pool keeps for reuse (the `pool` lever) back to the driver,
/// once the work queued so far is done: for a benchmark whose other side (another process)
/// needs that memory next. A no-op on the CPU.
pub fn release_cached_memory(dev: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = dev {
        ops::release_cached_memory(cuda)?;
    }
    let _ = dev;
    Ok(())
}

/// Whether the fused kernels serve tensors on `dev`: always on the CPU, on a GPU with the
/// `kernels` lever.
pub(crate) fn kernels_serve(dev: &Device) -> bool {
    match dev {
        Device::Cpu => true,
        Device::Cuda(_) => {
            cfg!(feature = "cuda") && matches!(Levers::current(), Ok(l) if l.kernels)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lever_lists_parse_and_a_wrong_name_is_refused() {
        assert_eq!(Levers::parse("").expect("empty"), Levers::NONE);
        assert_eq!(Levers::parse("default").expect("default"), Levers::DEFAULT);
        let with_tf32 = Levers::parse("default,tf32").expect("default,tf32");
        assert!(with_tf32.tf32 && with_tf32.kernels && with_tf32.events_off);
        let one = Levers::parse("pool").expect("pool");
        assert_eq!(
            one,
            Levers {
                pool: true,
                ..Levers::NONE
            }
        );
        assert_eq!(one.names(), "pool");
        assert_eq!(Levers::NONE.names(), "none");
        assert_eq!(
            Levers::DEFAULT.names(),
            "events-off,pool,htod-cache,kernels"
        );
        let e = Levers::parse("events-off,fast").expect_err("unknown");
        assert!(e.to_string().contains("\"fast\""), "{e}");
    }
}
