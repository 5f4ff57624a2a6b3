//! Each GPU kernel against its CPU twin, on the GPU: every fused op's values and gradients, the
//! optimizer passes, and the GPT's and the Llama's whole hand-written steps. These tests need a GPU: without
//! one (no driver, no device) each prints why it is skipped and passes; CI never builds the
//! `cuda` feature, so they never run there. With a GPU, the kernels must be on and compile: a
//! lever list without them, or NVRTC missing, fails the tests rather than skipping them.

use candle_core::{Device, Tensor};

use crate::cpu::fused;
use crate::gpt::{Gpt, GptSpec};
use crate::llama::{Llama, LlamaSpec};
use crate::optim::{Optimizer, OptimizerSpec};
use crate::params::Params;
use crate::testing::seeded;

/// The first GPU, prepared with the kernels on, or `None` with the reason printed when there is
/// no GPU.
fn gpu(test: &str) -> Option<Device> {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("{test}: skipped, no GPU here ({e})");
            return None;
        }
    };
    let levers = crate::gpu::Levers::current().expect("the lever list");
    assert!(
        levers.kernels,
        "{test}: {} leaves the kernels off, so nothing here would test them",
        crate::gpu::LEVERS_ENV
    );
    crate::gpu::prepare(&dev).expect("preparing the GPU (NVRTC must compile the kernels)");
    Some(dev)
}

/// The largest absolute difference between a CPU tensor and a GPU one, relative to the CPU
/// tensor's largest magnitude (at least 1).
fn relative_diff(cpu: &Tensor, gpu: &Tensor) -> f32 {
    let back = gpu.to_device(&Device::Cpu).expect("to cpu");
    assert_eq!(cpu.dims(), back.dims(), "shapes");
    let scalar = |t: Tensor| t.to_scalar::<f32>().expect("scalar");
    let diff = scalar(
        (cpu - &back)
            .and_then(|d| d.abs()?.max_all())
            .expect("diff"),
    );
    let size = scalar(cpu.abs().and_then(|d| d.max_all()).expect("size"));
    diff / size.max(1.0)
}

/// Seeded values in [-2, 2) on the CPU and the same on `dev`.
fn pair(shape: &[usize], seed: u64, dev: &Device) -> (Tensor, Tensor) {
    let cpu = seeded(shape, seed, 2.0).as_tensor().clone();
    let on_gpu = cpu.to_device(dev).expect("to gpu");
    (cpu, on_gpu)
}

fn check(what: &str, cpu: &Tensor, gpu: &Tensor, bound: f32) {
    let d = relative_diff(cpu, gpu);
    assert!(
        d <= bound,
        "{what}: the GPU differs from the CPU by {d} (bound {bound})"
    );
}

/// Sizes that are not multiples of a warp or a block, one wide and long enough for many chunks
/// of a column sum, and one wider than 512 (a block of 256 threads per row).
const SHAPES: [(usize, usize); 4] = [(37, 50), (5, 7), (1000, 384), (300, 768)];

#[test]
fn row_kernels_match_their_cpu_twins() {
    let Some(dev) = gpu("row_kernels_match_their_cpu_twins") else {
        return;
    };
    for (i, &(rows, width)) in SHAPES.iter().enumerate() {
        let seed = 10 * i as u64;
        let (x, gx) = pair(&[rows, width], seed + 1, &dev);
        let (w, gw) = pair(&[width], seed + 2, &dev);
        let (b, gb) = pair(&[width], seed + 3, &dev);
        let (g, gg) = pair(&[rows, width], seed + 4, &dev);
        let case = format!("{rows}x{width}");
        check(
            &format!("add-bias {case}"),
            &fused::add_bias(&x, &b).expect("cpu"),
            &fused::add_bias(&gx, &gb).expect("gpu"),
            1e-6,
        );
        check(
            &format!("sum-rows {case}"),
            &fused::sum_rows(&x).expect("cpu"),
            &fused::sum_rows(&gx).expect("gpu"),
            1e-5,
        );
        check(
            &format!("layer norm {case}"),
            &fused::layer_norm(&x, &w, &b, 1e-5).expect("cpu"),
            &fused::layer_norm(&gx, &gw, &gb, 1e-5).expect("gpu"),
            1e-5,
        );
        let cpu_grads = fused::layer_norm_grad(&x, &w, &g, 1e-5).expect("cpu");
        let gpu_grads = fused::layer_norm_grad(&gx, &gw, &gg, 1e-5).expect("gpu");
        check(
            &format!("layer norm dx {case}"),
            &cpu_grads.0,
            &gpu_grads.0,
            1e-4,
        );
        check(
            &format!("layer norm dw {case}"),
            &cpu_grads.1,
            &gpu_grads.1,
            1e-4,
        );
        check(
            &format!("layer norm db {case}"),
            &cpu_grads.2,
            &gpu_grads.2,
            1e-5,
        );
        // An input that starts inside its storage (a view past the first row).
        let (xv, gxv) = (
            x.narrow(0, 1, rows - 1).expect("view"),
            gx.narrow(0, 1, rows - 1).expect("view"),
        );
        check(
            &format!("layer norm of a view {case}"),
            &fused::layer_norm(&xv, &w, &b, 1e-5).expect("cpu"),
            &fused::layer_norm(&gxv, &gw, &gb, 1e-5).expect("gpu"),
            1e-5,
        );
        check(
            &format!("silu of a view {case}"),
            &fused::silu(&xv).expect("cpu"),
            &fused::silu(&gxv).expect("gpu"),
            1e-5,
        );
        check(
            &format!("silu {case}"),
            &fused::silu(&x).expect("cpu"),
            &fused::silu(&gx).expect("gpu"),
            1e-5,
        );
        check(
            &format!("silu grad {case}"),
            &fused::silu_grad(&x, &g).expect("cpu"),
            &fused::silu_grad(&gx, &gg).expect("gpu"),
            1e-5,
        );
        let targets: Vec<u32> = (0..rows).map(|r| ((r * 31 + 7) % width) as u32).collect();
        let t = Tensor::from_vec(targets, rows, &Device::Cpu).expect("targets");
        let gt = t.to_device(&dev).expect("targets to gpu");
        check(
            &format!("cross-entropy {case}"),
            &fused::cross_entropy(&x, &t).expect("cpu"),
            &fused::cross_entropy(&gx, &gt).expect("gpu"),
            1e-5,
        );
        check(
            &format!("cross-entropy grad {case}"),
            &fused::cross_entropy_grad(&x, &t).expect("cpu"),
            &fused::cross_entropy_grad(&gx, &gt).expect("gpu"),
            1e-5,
        );
    }
}

#[test]
fn attention_kernels_match_their_cpu_twins() {
    let Some(dev) = gpu("attention_kernels_match_their_cpu_twins") else {
        return;
    };
    for (seed, dims) in [
        (1u64, [2usize, 3, 6, 6]),
        (2, [4, 6, 256, 256]),
        (3, [1, 1, 33, 33]),
    ] {
        let (s, gs) = pair(&dims, seed, &dev);
        let (g, gg) = pair(&dims, seed + 100, &dev);
        let case = format!("{dims:?}");
        let y = fused::causal_softmax(&s, 0.35).expect("cpu");
        let gy = fused::causal_softmax(&gs, 0.35).expect("gpu");
        check(&format!("causal softmax {case}"), &y, &gy, 1e-5);
        check(
            &format!("softmax grad {case}"),
            &fused::causal_softmax_grad(&y, &g, 0.35).expect("cpu"),
            &fused::causal_softmax_grad(&gy, &gg, 0.35).expect("gpu"),
            1e-5,
        );
    }
}

#[test]
fn llama_kernels_match_their_cpu_twins() {
    let Some(dev) = gpu("llama_kernels_match_their_cpu_twins") else {
        return;
    };
    for (i, &(rows, width)) in SHAPES.iter().enumerate() {
        let seed = 10 * i as u64 + 500;
        let (x, gx) = pair(&[rows, width], seed + 1, &dev);
        let (w, gw) = pair(&[width], seed + 2, &dev);
        let (u, gu) = pair(&[rows, width], seed + 3, &dev);
        let (g, gg) = pair(&[rows, width], seed + 4, &dev);
        let case = format!("{rows}x{width}");
        check(
            &format!("rms norm {case}"),
            &fused::rms_norm(&x, &w, 1e-5).expect("cpu"),
            &fused::rms_norm(&gx, &gw, 1e-5).expect("gpu"),
            1e-5,
        );
        let (cpu_dx, cpu_dw) = fused::rms_norm_grad(&x, &w, &g, 1e-5).expect("cpu");
        let (gpu_dx, gpu_dw) = fused::rms_norm_grad(&gx, &gw, &gg, 1e-5).expect("gpu");
        check(&format!("rms norm dx {case}"), &cpu_dx, &gpu_dx, 1e-4);
        check(&format!("rms norm dw {case}"), &cpu_dw, &gpu_dw, 1e-4);
        check(
            &format!("swiglu {case}"),
            &fused::swiglu(&x, &u).expect("cpu"),
            &fused::swiglu(&gx, &gu).expect("gpu"),
            1e-5,
        );
        let (cpu_dg, cpu_du) = fused::swiglu_grad(&x, &u, &g).expect("cpu");
        let (gpu_dg, gpu_du) = fused::swiglu_grad(&gx, &gu, &gg).expect("gpu");
        check(&format!("swiglu d-gate {case}"), &cpu_dg, &gpu_dg, 1e-5);
        check(&format!("swiglu d-up {case}"), &cpu_du, &gpu_du, 1e-5);
    }
    // Rotary: odd sizes, a head width of 64 (SmolLM's), tables longer than the time used.
    for (seed, [batch, time, heads, head_dim], positions) in [
        (1u64, [2usize, 5, 3, 6], 8usize),
        (2, [3, 33, 9, 64], 40),
        (3, [1, 1, 1, 2], 1),
    ] {
        let (angles, _) = pair(&[positions, head_dim / 2], seed + 50, &Device::Cpu);
        let angles = Tensor::cat(&[&angles, &angles], 1).expect("halves");
        let (cos, sin) = (angles.cos().expect("cos"), angles.sin().expect("sin"));
        let narrow = |t: &Tensor| {
            t.narrow(0, 0, time)
                .expect("narrow")
                .contiguous()
                .expect("c")
        };
        let (cos, sin) = (narrow(&cos), narrow(&sin));
        let (gcos, gsin) = (
            cos.to_device(&dev).expect("cos"),
            sin.to_device(&dev).expect("sin"),
        );
        let (x, gx) = pair(&[batch, time, heads, head_dim], seed, &dev);
        let (g, gg) = pair(&[batch, heads, time, head_dim], seed + 7, &dev);
        let case = format!("{batch}x{time}x{heads}x{head_dim}");
        check(
            &format!("rotary to heads {case}"),
            &fused::rotary_to_heads(&x, &cos, &sin).expect("cpu"),
            &fused::rotary_to_heads(&gx, &gcos, &gsin).expect("gpu"),
            1e-5,
        );
        check(
            &format!("rotary from heads {case}"),
            &fused::rotary_from_heads(&g, &cos, &sin).expect("cpu"),
            &fused::rotary_from_heads(&gg, &gcos, &gsin).expect("gpu"),
            1e-5,
        );
    }
}

/// A tiny Llama's hand-written loss and every gradient on both devices, tied and untied,
/// grouped and full attention, on a full context and a shorter one.
#[test]
fn a_llama_step_matches_the_cpu() {
    let Some(dev) = gpu("a_llama_step_matches_the_cpu") else {
        return;
    };
    for (tied, kv_heads) in [(true, 3), (false, 1), (false, 9)] {
        let spec = LlamaSpec {
            vocab: 97,
            context: 16,
            hidden: 48,
            intermediate: 80,
            layers: 2,
            heads: 9,
            kv_heads,
            head_dim: 8,
            rms_eps: 1e-5,
            rope_theta: 10000.0,
            tied,
        };
        let build = |d: &Device| {
            let mut vars = Vec::new();
            let llama = Llama::new(&spec, 7, d, &mut vars).expect("llama");
            (llama, Params::new(vars).expect("params"))
        };
        let ((cpu, cpu_params), (on_gpu, gpu_params)) = (build(&Device::Cpu), build(&dev));
        crate::testing::nudge(&cpu_params, 0.3);
        crate::testing::nudge(&gpu_params, 0.3);
        assert!(
            on_gpu.has_hand_backward(),
            "the GPU llama takes the hand-written step"
        );
        let ids = |offset: usize, time: usize| -> Tensor {
            let v: Vec<u32> = (0..3 * time)
                .map(|i| ((i * 37 + offset) % 97) as u32)
                .collect();
            Tensor::from_vec(v, (3, time), &Device::Cpu).expect("ids")
        };
        for time in [16, 11] {
            let (tokens, targets) = (ids(0, time), ids(11, time));
            let (loss, grads) = cpu.loss_and_grads(&tokens, &targets).expect("cpu step");
            let (gpu_loss, gpu_grads) = on_gpu
                .loss_and_grads(
                    &tokens.to_device(&dev).expect("tokens"),
                    &targets.to_device(&dev).expect("targets"),
                )
                .expect("gpu step");
            let case = format!("tied {tied}, {kv_heads} kv heads, time {time}");
            check(&format!("llama loss, {case}"), &loss, &gpu_loss, 1e-5);
            for ((name, a), (_, b)) in cpu_params.vars().iter().zip(gpu_params.vars()) {
                let (ga, gb) = (
                    grads.get(a.as_tensor()).expect(name),
                    gpu_grads.get(b.as_tensor()).expect(name),
                );
                check(&format!("gradient of {name}, {case}"), ga, gb, 1e-4);
            }
        }
    }
}

/// A tiny GPT's hand-written loss and every gradient on both devices, on a full context and a
/// shorter one.
#[test]
fn a_gpt_step_matches_the_cpu() {
    let Some(dev) = gpu("a_gpt_step_matches_the_cpu") else {
        return;
    };
    let spec = GptSpec {
        context: 16,
        layers: 2,
        width: 48,
        heads: 4,
    };
    let build = |d: &Device| {
        let mut vars = Vec::new();
        let gpt = Gpt::new(&spec, 7, d, &mut vars).expect("gpt");
        (gpt, Params::new(vars).expect("params"))
    };
    let ((cpu, cpu_params), (on_gpu, gpu_params)) = (build(&Device::Cpu), build(&dev));
    crate::testing::nudge(&cpu_params, 0.2);
    crate::testing::nudge(&gpu_params, 0.2);
    let ids = |offset: usize, time: usize| -> Tensor {
        let v: Vec<u32> = (0..3 * time)
            .map(|i| ((i * 37 + offset) % 251) as u32)
            .collect();
        Tensor::from_vec(v, (3, time), &Device::Cpu).expect("ids")
    };
    for time in [16, 11] {
        let (tokens, targets) = (ids(0, time), ids(11, time));
        let (loss, grads) = cpu.loss_and_grads(&tokens, &targets).expect("cpu step");
        let (gpu_loss, gpu_grads) = on_gpu
            .loss_and_grads(
                &tokens.to_device(&dev).expect("tokens"),
                &targets.to_device(&dev).expect("targets"),
            )
            .expect("gpu step");
        check(&format!("gpt loss, time {time}"), &loss, &gpu_loss, 1e-5);
        for ((name, a), (_, b)) in cpu_params.vars().iter().zip(gpu_params.vars()) {
            let (ga, gb) = (
                grads.get(a.as_tensor()).expect(name),
                gpu_grads.get(b.as_tensor()).expect(name),
            );
            check(&format!("gradient of {name}, time {time}"), ga, gb, 1e-4);
        }
    }
}

/// Each optimizer's in-place passes, three steps on the same parameters and gradients on both
/// devices. (Not through the GPT's own gradients: AdamW scales every update to about the
/// learning rate whatever the gradient's size, so a gradient that rounding moves across zero
/// moves its parameter by a whole step either way.)
#[test]
fn the_optimizer_passes_match_the_cpu() {
    let Some(dev) = gpu("the_optimizer_passes_match_the_cpu") else {
        return;
    };
    let specs = [
        OptimizerSpec::Adamw {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
        },
        OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        },
        OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.01,
        },
    ];
    let shapes: [&[usize]; 3] = [&[37, 50], &[5], &[1000, 384]];
    for spec in specs {
        let vars = |d: &Device| -> Params {
            let vars = shapes
                .iter()
                .enumerate()
                .map(|(i, shape)| {
                    let values = seeded(shape, 40 + i as u64, 1.0).as_tensor().clone();
                    let var = candle_core::Var::from_tensor(&values.to_device(d).expect("to"))
                        .expect("var");
                    (format!("p{i}"), var)
                })
                .collect();
            Params::new(vars).expect("params")
        };
        let (cpu_params, gpu_params) = (vars(&Device::Cpu), vars(&dev));
        let mut cpu_opt = Optimizer::new(&spec, &cpu_params).expect("cpu optimizer");
        let mut gpu_opt = Optimizer::new(&spec, &gpu_params).expect("gpu optimizer");
        for step in 0..3u64 {
            let grads = |params: &Params, d: &Device| {
                let mut store = candle_core::backprop::GradStore::default();
                for (i, (_, var)) in params.vars().iter().enumerate() {
                    let g = seeded(var.dims(), 100 + 10 * step + i as u64, 0.5);
                    store.insert(var.as_tensor(), g.as_tensor().to_device(d).expect("grad"));
                }
                store
            };
            cpu_opt
                .step(&cpu_params, &grads(&cpu_params, &Device::Cpu))
                .expect("cpu optimizer step");
            gpu_opt
                .step(&gpu_params, &grads(&gpu_params, &dev))
                .expect("gpu optimizer step");
        }
        let a = Tensor::new(cpu_params.flatten().expect("cpu flat"), &Device::Cpu).expect("a");
        let b = Tensor::new(gpu_params.flatten().expect("gpu flat"), &Device::Cpu).expect("b");
        check(
            &format!("parameters after 3 steps of {spec:?}"),
            &a,
            &b,
            1e-5,
        );
    }
}
