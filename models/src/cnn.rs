//! The LeNet-style convolutional network for small one-channel images: two 5x5 convolutions
//! with ReLU and 2x2 max-pooling (the first padded by 2, as LeNet-5 on 28x28 MNIST), then
//! fully connected layers.
//!
//! Its training loss and every parameter's gradient are taken by hand on the CPU. Candle's
//! autograd gives the same numbers (a test checks), but it seeds every intermediate's
//! gradient with a zero tensor and adds into it: on the LeNet-style CNN, zeroing and those
//! additions were about a quarter of a step. Here the forward pass keeps what the backward
//! pass reads (each convolution's patch matrix, its output before pooling as the matrix
//! product's rows, each pooled and rectified map), and the backward pass writes each gradient once: per convolution two
//! matrix products, the pool's and the ReLU's masks, and `col2im` only where an input
//! gradient is needed (never for the images).

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::{Conv2d, Conv2dConfig, Linear};
use serde::Serialize;

use crate::cpu::{conv, fused, matmul};
use crate::dense::{dense_backward, dense_forward, relu_back};
use crate::kind::{join, Kind, Network};
use crate::{dense, init, Error, Result};

/// The convolutions' kernel side.
const KERNEL: usize = 5;

/// A CNN's shape. Part of the run identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CnnSpec {
    /// Input image height and width (one channel).
    pub image: (usize, usize),
    /// Output channels of the two convolutions, e.g. `[6, 16]`.
    pub channels: [usize; 2],
    /// Hidden widths of the fully connected part, e.g. `[120, 84]`.
    pub hidden: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
}

impl Kind for CnnSpec {
    fn name(&self) -> String {
        let mut all = self.channels.to_vec();
        all.extend(&self.hidden);
        all.push(self.classes);
        format!("cnn-{}", join(&all))
    }

    fn input_dim(&self) -> usize {
        self.image.0 * self.image.1
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn validate(&self) -> Result<()> {
        if self.channels.contains(&0) || self.hidden.contains(&0) || self.classes < 2 {
            return Err(Error::Spec(
                "cnn channels and hidden widths must be non-zero and classes >= 2".into(),
            ));
        }
        let (h, w) = self.image;
        if feature_side(h) == 0 || feature_side(w) == 0 {
            return Err(Error::Spec(format!(
                "a cnn needs images of at least 12x12, got {h}x{w}"
            )));
        }
        Ok(())
    }

    fn build(
        &self,
        seed: u64,
        dev: &Device,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Arc<dyn Network>> {
        let mut convs = Vec::new();
        let mut in_ch = 1;
        for (i, &out_ch) in self.channels.iter().enumerate() {
            let wname = format!("conv{i}.weight");
            let bname = format!("conv{i}.bias");
            let w = init::he_uniform(
                seed,
                &wname,
                &[out_ch, in_ch, KERNEL, KERNEL],
                in_ch * KERNEL * KERNEL,
                dev,
            )?;
            let b = init::zeros(&[out_ch], dev)?;
            let cfg = Conv2dConfig {
                padding: if i == 0 { 2 } else { 0 },
                ..Default::default()
            };
            convs.push(Conv2d::new(
                w.as_tensor().clone(),
                Some(b.as_tensor().clone()),
                cfg,
            ));
            vars.push((wname, w));
            vars.push((bname, b));
            in_ch = out_ch;
        }
        let side = feature_side(self.image.0) * feature_side(self.image.1);
        let mut widths = vec![self.channels[1] * side];
        widths.extend(&self.hidden);
        widths.push(self.classes);
        let linears = dense::fully_connected(&widths, seed, dev, vars)?;
        Ok(Arc::new(Cnn {
            image: self.image,
            convs,
            linears,
        }))
    }
}

/// Side length after conv(pad 2) + pool + conv(no pad) + pool.
fn feature_side(side: usize) -> usize {
    let after_first = side / 2; // the padded 5x5 keeps the size, then the pool halves it
    after_first.saturating_sub(KERNEL - 1) / 2
}

/// A built CNN.
#[derive(Debug)]
struct Cnn {
    /// Input image height and width (one channel).
    image: (usize, usize),
    /// The convolutions, each followed by a 2×2 max pool and a ReLU.
    convs: Vec<Conv2d>,
    /// The fully connected layers after them.
    linears: Vec<Linear>,
}

impl Network for Cnn {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let batch = xs.dim(0)?;
        let mut xs = xs.reshape((batch, 1, self.image.0, self.image.1))?;
        for layer in &self.convs {
            let (weight, bias) = conv_parameters(layer)?;
            xs = conv::conv2d(&xs, weight, bias, layer.config().padding)?;
            // Pooling before the ReLU gives the same values (ReLU keeps order) from a
            // quarter of the work.
            xs = conv::max_pool2x2(&xs)?.relu()?;
        }
        dense::logits(&self.linears, &xs.flatten_from(1)?)
    }

    fn loss_and_grads(&self, xs: &Tensor, ys: &Tensor) -> Option<Result<(Tensor, GradStore)>> {
        // The convolutions' kernels are the CPU's alone.
        fused::on_cpu(xs).then(|| self.loss_and_grads_by_hand(xs, ys))
    }
}

/// What one convolution's backward pass reads from its forward pass.
struct ConvCache {
    /// The input's dimensions `(batch, channels, height, width)`.
    input_dims: Vec<usize>,
    /// The input's patches as columns, `(channels·k·k, batch·out_h·out_w)`.
    cols: Tensor,
    /// The output's height and width.
    out_size: (usize, usize),
    /// The convolution's output before pooling, as the matrix product left it:
    /// `(batch·out_h·out_w, out)`.
    rows: Tensor,
    /// The pooled, rectified map: the next layer's input.
    activated: Tensor,
}

impl Cnn {
    /// The mean cross-entropy of the CNN's logits for images `xs` `(batch, height·width)` against
    /// labels `ys`, and the gradient of every parameter. The same forward pass as
    /// [`Network::forward`].
    fn loss_and_grads_by_hand(&self, xs: &Tensor, ys: &Tensor) -> Result<(Tensor, GradStore)> {
        let batch = xs.dim(0)?;
        let mut x = xs
            .detach()
            .reshape((batch, 1, self.image.0, self.image.1))?;
        let mut caches = Vec::with_capacity(self.convs.len());
        for layer in &self.convs {
            let (weight, bias) = conv_parameters(layer)?;
            let (out_ch, in_ch, k, _) = weight.dims4()?;
            let padding = layer.config().padding;
            let (_, _, height, width) = x.dims4()?;
            let (out_h, out_w) = (height + 2 * padding + 1 - k, width + 2 * padding + 1 - k);
            let cols = conv::im2col(&x, k, padding)?;
            let rows = matmul::linear(
                &cols.t()?,
                &weight.detach().reshape((out_ch, in_ch * k * k))?,
                Some(&bias.detach()),
            )?;
            // Pooled straight off the rows (no permuted copy), before the ReLU, as in the model's
            // forward pass.
            let activated = conv::max_pool2x2_rows(&rows, batch, out_h, out_w)?.relu()?;
            caches.push(ConvCache {
                input_dims: x.dims().to_vec(),
                out_size: (out_h, out_w),
                cols,
                rows,
                activated: activated.clone(),
            });
            x = activated;
        }
        let (inputs, logits) = dense_forward(&self.linears, &x.flatten_from(1)?)?;
        let loss = fused::cross_entropy(&logits, ys)?;

        let mut grads = GradStore::default();
        let d_logits = fused::cross_entropy_grad(&logits, ys)?;
        let d_flat = dense_backward(&self.linears, &inputs, d_logits, &mut grads, true)?
            .ok_or_else(|| Error::Layout("a CNN without fully connected layers".into()))?;
        let mut d_x = d_flat.reshape(x.dims())?;
        for (i, (layer, c)) in self.convs.iter().zip(&caches).enumerate().rev() {
            let (weight, bias) = conv_parameters(layer)?;
            let (out_ch, in_ch, k, _) = weight.dims4()?;
            let d_pooled = relu_back(&d_x, &c.activated)?;
            let (out_h, out_w) = c.out_size;
            let d_rows = conv::max_pool2x2_rows_grad(&c.rows, &d_pooled, batch, out_h, out_w)?;
            grads.insert(
                weight,
                matmul::matmul(&d_rows.t()?, &c.cols.t()?)?.reshape(weight.shape())?,
            );
            grads.insert(bias, fused::sum_rows(&d_rows)?);
            if i == 0 {
                break; // the images need no gradient
            }
            let kernel = weight.detach().reshape((out_ch, in_ch * k * k))?;
            let d_cols = matmul::matmul(&kernel.t()?, &d_rows.t()?)?;
            d_x = conv::col2im(&d_cols, k, layer.config().padding, &c.input_dims)?;
        }
        Ok((loss, grads))
    }
}

/// A convolution's weight and bias (the model builds every convolution with one).
fn conv_parameters(layer: &Conv2d) -> Result<(&Tensor, &Tensor)> {
    let bias = layer
        .bias()
        .ok_or_else(|| Error::Layout("a convolution without its bias".into()))?;
    Ok((layer.weight(), bias))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Model, ModelSpec};
    use candle_core::Device;

    /// The hand-written loss and gradients equal Candle's autograd through the model's own
    /// forward pass, for every parameter, with parameters moved off their initial values
    /// (zero biases) so every term counts.
    #[test]
    fn the_cnn_backward_by_hand_matches_autograd() {
        let spec = ModelSpec::Cnn(CnnSpec {
            image: (28, 28),
            channels: [6, 16],
            hidden: vec![120, 84],
            classes: 10,
        });
        let model = Model::new(&spec, 3, &Device::Cpu).expect("cnn");
        let params = model.params();
        crate::testing::nudge(params, 0.05);
        let batch = 5;
        let pixels: Vec<f32> = (0..batch * 784)
            .map(|i| ((i * 37 % 255) as f32 / 255.0) - 0.3)
            .collect();
        let xs = Tensor::from_vec(pixels, (batch, 784), &Device::Cpu).expect("xs");
        let ys = Tensor::from_vec(vec![3u32, 0, 9, 4, 4], batch, &Device::Cpu).expect("ys");
        let (loss, grads) = model
            .network()
            .loss_and_grads(&xs, &ys)
            .expect("a cnn on the cpu has its own backward pass")
            .expect("by hand");
        let reference =
            fused::cross_entropy(&model.forward(&xs).expect("forward"), &ys).expect("loss");
        let reference_grads = reference.backward().expect("autograd");
        let scalar = |t: &Tensor| t.to_scalar::<f32>().expect("scalar");
        assert!((scalar(&loss) - scalar(&reference)).abs() < 1e-5, "loss");
        crate::testing::assert_grads_match(params, &grads, &reference_grads, "cnn");
    }
}
