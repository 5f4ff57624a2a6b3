//! Fully connected layers with ReLUs between them, forward and backward by hand (two matrix
//! products and a sum per layer): the MLP's whole step, and the CNN's dense head.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, D};
use candle_nn::Linear;

use crate::cpu::{fused, matmul};
use crate::Result;

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
