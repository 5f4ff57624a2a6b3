//! Helpers the unit tests of the numeric modules share.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

/// A variable of `shape` filled with deterministic values spread over `[-amplitude,
/// amplitude)`, different for each `seed`.
pub(crate) fn seeded(shape: &[usize], seed: u64, amplitude: f32) -> Var {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u64)
        .map(|i| {
            let unit = ((i + 1) * (seed | 1) * 2_654_435_761 % 1000) as f32 / 1000.0;
            (2.0 * unit - 1.0) * amplitude
        })
        .collect();
    Var::from_vec(values, shape, &Device::Cpu).expect("var")
}

/// The largest absolute difference between two tensors of one shape.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.max_all())
        .and_then(|d| d.to_scalar::<f32>())
        .expect("diff")
}

/// Moves every parameter off its initial value by a deterministic amount in
/// `[-amplitude/2, amplitude/2)` (zero biases and unit norms would hide terms of a gradient).
pub(crate) fn nudge(params: &crate::Params, amplitude: f32) {
    let moved: Vec<f32> = params
        .flatten()
        .expect("flat")
        .iter()
        .enumerate()
        .map(|(i, v)| v + ((i * 7919 % 101) as f32 / 101.0 - 0.5) * amplitude)
        .collect();
    params.write_back(&moved).expect("write back");
}

/// Asserts that two gradient stores (a hand-written backward pass's and autograd's) agree on
/// every parameter to within `1e-4` of the larger gradient's size; `context` names the case.
pub(crate) fn assert_grads_match(
    params: &crate::Params,
    ours: &GradStore,
    theirs: &GradStore,
    context: &str,
) {
    let scalar = |t: Tensor| t.to_scalar::<f32>().expect("scalar");
    for (name, var) in params.vars() {
        let mine = ours.get(var.as_tensor()).expect(name);
        let reference = theirs.get(var.as_tensor()).expect(name);
        let diff = max_diff(mine, reference);
        let size = scalar(reference.abs().and_then(|d| d.max_all()).expect("size"));
        assert!(
            diff <= 1e-4 * size.max(1e-3),
            "{name}, {context}: differs by {diff} (largest {size})"
        );
    }
}
