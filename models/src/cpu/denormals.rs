//! Subnormal floats flushed to zero on the calling thread.
//!
//! A float below 2^-126 in magnitude is subnormal, and x86 cores take a microcode assist, some
//! hundred cycles, for each multiply-add that reads or writes one. Training makes them (tiny
//! probabilities beside a confident one, gradients through saturated units), and they then
//! run through every matrix product: a lone `diloco` node on Shakespeare went from about 130
//! to about 60 samples a second once they appeared, with the same products on the profile,
//! and back to full speed flushed. Frameworks flush them (PyTorch's `set_flush_denormal`,
//! every audio engine's denormal guard): nothing a model learns lives below 1e-38.
//!
//! The setting is the thread's (x86's MXCSR, Arm's FPCR); a thread inherits it from the thread
//! that started it, but Candle's and rayon's pools may have been started by any thread, so the
//! trainer thread asks each of their workers too ([`flush_on_compute_threads`]).

#![allow(unsafe_code)]

/// Makes the calling thread's floating-point unit read subnormal inputs as zero and write
/// zero for a subnormal result, so a model whose activations or gradients fall that low
/// trains at full speed. Returns whether the setting took (not on other architectures).
pub fn flush_to_zero() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // MXCSR bit 15 is flush-to-zero (results), bit 6 denormals-are-zero (inputs); both
        // exist on every x86-64 core. Reading and writing the thread's own control register
        // touches no memory but the local word.
        const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
        let mut csr: u32 = 0;
        // SAFETY: stmxcsr/ldmxcsr read and write the 4 bytes of `csr`, a live local, and the
        // thread's MXCSR; the new value only adds the two flush bits to the current one.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
            csr |= FTZ_DAZ;
            std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags));
        }
        true
    }
    #[cfg(target_arch = "aarch64")]
    {
        // FPCR bit 24 (FZ) flushes subnormal inputs and results to zero.
        let mut fpcr: u64;
        // SAFETY: reads and writes the thread's FPCR only, adding the FZ bit.
        unsafe {
            std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack, preserves_flags));
            fpcr |= 1 << 24;
            std::arch::asm!("msr fpcr, {}", in(reg) fpcr, options(nomem, nostack, preserves_flags));
        }
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// [`flush_to_zero`] on the calling thread and on every thread of the compute pools a model's
/// ops may run on: Candle's worker pool and rayon's pools (its own and the global one gemm
/// parallelises over). Called once by the thread that trains, before its first op; with one
/// compute thread the pools have no workers and only the caller is set.
pub fn flush_on_compute_threads() -> bool {
    let took = flush_to_zero();
    if candle_core::utils::get_num_threads() > 1 {
        candle_core::utils::barrier_pool().execute(|_| {
            flush_to_zero();
        });
        candle_core::utils::with_threadpool(|| {
            rayon::broadcast(|_| flush_to_zero());
        });
        rayon::broadcast(|_| flush_to_zero());
    }
    took
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subnormal product comes out as zero on a flushed thread, and a thread that did not
    /// ask keeps its subnormals (the setting is the thread's own).
    #[test]
    fn a_flushed_thread_computes_no_subnormal_and_others_are_left_alone() {
        let tiny = std::hint::black_box(1e-30_f32);
        let scale = std::hint::black_box(1e-10_f32);
        let untouched = std::thread::spawn(move || tiny * scale)
            .join()
            .expect("a thread");
        assert!(untouched.is_subnormal(), "{untouched:e}");
        let flushed = std::thread::spawn(move || {
            let took = flush_to_zero();
            (took, tiny * scale, std::hint::black_box(untouched) + 0.0)
        })
        .join()
        .expect("a thread");
        if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            assert!(flushed.0);
            assert_eq!(flushed.1, 0.0, "a subnormal product was kept");
            assert_eq!(flushed.2, 0.0, "a subnormal input was read as itself");
        }
    }

    /// With more than one compute thread, every worker of Candle's pool and of rayon's global
    /// pool flushes once the trainer asked (a worker left out would slow its share of each
    /// product as before).
    #[test]
    fn the_compute_pools_flush_once_asked() {
        let threads = candle_core::utils::get_num_threads();
        // The pools start from a thread that never flushed (a new thread inherits its
        // creator's setting, so pools a flushed thread started would pass unasked).
        std::thread::spawn(|| {
            candle_core::utils::barrier_pool().execute(|_| {});
            rayon::broadcast(|_| ());
        })
        .join()
        .expect("a thread");
        flush_on_compute_threads();
        let product = || std::hint::black_box(1e-30_f32) * std::hint::black_box(1e-10_f32);
        let kept = std::sync::atomic::AtomicUsize::new(0);
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let count = || {
            asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if product() != 0.0 {
                kept.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
        candle_core::utils::barrier_pool().execute(|_| count());
        rayon::broadcast(|_| count());
        let asked = asked.into_inner();
        let kept = kept.into_inner();
        if threads > 1 {
            assert_eq!(kept, 0, "{kept} of {asked} compute threads keep subnormals");
        } else {
            // One compute thread: the caller alone is asked, and it flushed.
            assert_eq!(product(), 0.0);
        }
        assert!(asked >= 2, "{asked}");
    }
}
