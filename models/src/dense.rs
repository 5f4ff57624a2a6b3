//! Fully connected layers with ReLUs between them: built from the seed, forward on Candle's
//! graph, and forward and backward by hand (two matrix products and a sum per layer): the
//! MLP's whole step, and the CNN's dense head.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::Linear;

use crate::cpu::{fused, matmul};
use crate::{init, Result};

/// Fully connected layers of `widths` (input first) with weights drawn from `seed`: He
/// uniform before a ReLU, Glorot uniform for the last layer, zero biases; each parameter is
/// appended to `vars` as `fc{i}.weight` and `fc{i}.bias`.
pub(crate) fn fully_connected(
    widths: &[usize],
    seed: u64,
    dev: &Device,
    vars: &mut Vec<(String, Var)>,
) -> Result<Vec<Linear>> {
    let mut linears = Vec::new();
    let layers = widths.len().saturating_sub(1);
    for (i, pair) in widths.windows(2).enumerate() {
        let (fan_in, fan_out) = (pair[0], pair[1]);
        let wname = format!("fc{i}.weight");
        let bname = format!("fc{i}.bias");
        let shape = [fan_out, fan_in];
        let w = if i + 1 == layers {
            init::glorot_uniform(seed, &wname, &shape, fan_in, fan_out, dev)?
        } else {
            init::he_uniform(seed, &wname, &shape, fan_in, dev)?
        };
        let b = init::zeros(&[fan_out], dev)?;
        linears.push(Linear::new(
            w.as_tensor().clone(),
            Some(b.as_tensor().clone()),
        ));
        vars.push((wname, w));
        vars.push((bname, b));
    }
    Ok(linears)
}

/// The layers' logits for `xs`, on Candle's graph (autograd can take gradients of them): a
/// ReLU after every layer but the last.
pub(crate) fn logits(layers: &[Linear], xs: &Tensor) -> Result<Tensor> {
    let mut xs = xs.clone();
    let last = layers.len().saturating_sub(1);
    for (i, layer) in layers.iter().enumerate() {
        xs = matmul::linear_nd(&xs, layer.weight(), layer.bias())?;
        if i < last {
            xs = xs.relu()?;
        }
    }
    Ok(xs)
}

/// An MLP's mean cross-entropy loss and its gradients, by hand: per layer two matrix
/// products and a sum, nothing else. Candle's autograd gives the same numbers (a test checks)
/// but seeds every node's gradient with a zero tensor and adds into it, which on the MNIST
/// MLP is two extra passes over every weight matrix per step (about a sixth of the step).
/// One difference: where a pre-activation is exactly zero, Candle's ReLU passes the gradient
/// through and this one, like PyTorch's, does not.
pub(crate) fn mlp_loss_and_grads(
    layers: &[Linear],
    xs: &Tensor,
    ys: &Tensor,
) -> Result<(Tensor, GradStore)> {
    let (inputs, a) = dense_forward(layers, xs)?;
    let batch = a.dim(0)?;
    let classes = a.dim(1)?;
    let log_probs = candle_nn::ops::log_softmax(&a, D::Minus1)?;
    let picked = log_probs.gather(&ys.unsqueeze(1)?, 1)?;
    let loss = (picked.sum_all()? / -(batch as f64))?;
    // d loss / d logits = (softmax − one-hot) / batch.
    let one_hot = candle_nn::encoding::one_hot(ys.clone(), classes, 1f32, 0f32)?;
    let dz = ((log_probs.exp()? - one_hot)? / batch as f64)?;
    let mut grads = GradStore::default();
    dense_backward(layers, &inputs, dz, &mut grads, false)?;
    Ok((loss, grads))
}

/// Fully connected layers with a ReLU between them, forward, with the weights read detached
/// (no graph): every layer's input, and the last layer's output.
pub(crate) fn dense_forward(layers: &[Linear], xs: &Tensor) -> Result<(Vec<Tensor>, Tensor)> {
    let mut inputs = Vec::with_capacity(layers.len());
    let mut a = xs.detach();
    for (i, layer) in layers.iter().enumerate() {
        let bias = layer.bias().map(Tensor::detach);
        let z = matmul::linear(&a, &layer.weight().detach(), bias.as_ref())?;
        inputs.push(a);
        a = if i + 1 < layers.len() { z.relu()? } else { z };
    }
    Ok((inputs, a))
}

/// [`dense_forward`]'s layers backward from the last output's gradient `dz`, given each
/// layer's input: the weights' and biases' gradients go into `grads`; with `input_grad`, the
/// first layer's input's gradient is returned.
pub(crate) fn dense_backward(
    layers: &[Linear],
    inputs: &[Tensor],
    mut dz: Tensor,
    grads: &mut GradStore,
    input_grad: bool,
) -> Result<Option<Tensor>> {
    for (i, layer) in layers.iter().enumerate().rev() {
        let a = &inputs[i];
        grads.insert(layer.weight(), matmul::matmul(&dz.t()?, a)?);
        if let Some(b) = layer.bias() {
            grads.insert(b, fused::sum_rows(&dz)?);
        }
        if i > 0 {
            // Through the weights, then through the ReLU that made this layer's input.
            let da = matmul::matmul(&dz, &layer.weight().detach())?;
            dz = relu_back(&da, a)?;
        } else if input_grad {
            return Ok(Some(matmul::matmul(&dz, &layer.weight().detach())?));
        }
    }
    Ok(None)
}

/// The gradient `grad` of a ReLU's output passed back where its output `activated` is
/// positive (zero where the input was exactly zero, as in PyTorch).
pub(crate) fn relu_back(grad: &Tensor, activated: &Tensor) -> Result<Tensor> {
    Ok((grad * activated.gt(0f32)?.to_dtype(DType::F32)?)?)
}
