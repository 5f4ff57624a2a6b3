//! The model families: a multilayer perceptron of configurable widths, a LeNet-style
//! convolutional network for small one-channel images, and a byte-level GPT ([`crate::gpt`]).
//!
//! Weights are created by [`crate::init`] from the run's seed (never by Candle's RNG), so two
//! nodes that build the same [`ModelSpec`] with the same seed hold bit-identical parameters.

use candle_core::{Device, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, Linear};
use serde::Serialize;

use crate::gpt::{Gpt, GptSpec};
use crate::params::Params;
use crate::{init, Error, Result};

/// What to build. Part of the run identity: nodes with different specs cannot train together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ModelSpec {
    /// Fully connected layers with ReLU between them; `widths` runs from the input features to
    /// the classes, e.g. `[784, 256, 10]`.
    Mlp {
        /// Layer widths, input first, classes last; at least two entries.
        widths: Vec<usize>,
    },
    /// Two 5x5 convolutions with ReLU and 2x2 max-pooling (the first padded by 2, as LeNet-5
    /// on 28x28 MNIST), then fully connected layers.
    Cnn {
        /// Input image height and width (one channel).
        image: (usize, usize),
        /// Output channels of the two convolutions, e.g. `[6, 16]`.
        channels: [usize; 2],
        /// Hidden widths of the fully connected part, e.g. `[120, 84]`.
        hidden: Vec<usize>,
        /// Number of classes.
        classes: usize,
    },
    /// A decoder-only transformer over bytes: its input is `context` bytes, its output a
    /// distribution over the next byte at every position.
    Gpt(GptSpec),
}

const KERNEL: usize = 5;

impl ModelSpec {
    /// A short human name such as `mlp-784-256-10` or `cnn-6-16-120-84-10`.
    pub fn name(&self) -> String {
        match self {
            ModelSpec::Mlp { widths } => format!("mlp-{}", join(widths)),
            ModelSpec::Cnn {
                channels,
                hidden,
                classes,
                ..
            } => {
                let mut all = channels.to_vec();
                all.extend(hidden);
                all.push(*classes);
                format!("cnn-{}", join(&all))
            }
            ModelSpec::Gpt(g) => g.name(),
        }
    }

    /// Features per input sample the model expects.
    pub fn input_dim(&self) -> usize {
        match self {
            ModelSpec::Mlp { widths } => widths.first().copied().unwrap_or(0),
            ModelSpec::Cnn { image, .. } => image.0 * image.1,
            ModelSpec::Gpt(g) => g.context,
        }
    }

    /// Number of output classes.
    pub fn classes(&self) -> usize {
        match self {
            ModelSpec::Mlp { widths } => widths.last().copied().unwrap_or(0),
            ModelSpec::Cnn { classes, .. } => *classes,
            ModelSpec::Gpt(_) => crate::gpt::VOCAB,
        }
    }

    /// Checks that the spec can be built; errors say which number is wrong.
    pub fn validate(&self) -> Result<()> {
        match self {
            ModelSpec::Mlp { widths } => {
                if widths.len() < 2 || widths.contains(&0) {
                    return Err(Error::Spec(format!(
                        "an MLP needs at least two non-zero widths (input and classes), got {widths:?}"
                    )));
                }
            }
            ModelSpec::Cnn {
                image,
                channels,
                hidden,
                classes,
            } => {
                if channels.contains(&0) || hidden.contains(&0) || *classes < 2 {
                    return Err(Error::Spec(
                        "cnn channels and hidden widths must be non-zero and classes >= 2".into(),
                    ));
                }
                if cnn_feature_side(image.0) == 0 || cnn_feature_side(image.1) == 0 {
                    return Err(Error::Spec(format!(
                        "a cnn needs images of at least 12x12, got {}x{}",
                        image.0, image.1
                    )));
                }
            }
            ModelSpec::Gpt(g) => g.validate()?,
        }
        Ok(())
    }
}

fn join(v: &[usize]) -> String {
    v.iter()
        .map(|w| w.to_string())
        .collect::<Vec<_>>()
        .join("-")
}

/// Side length after conv(pad 2) + pool + conv(no pad) + pool.
fn cnn_feature_side(side: usize) -> usize {
    let after_first = side / 2; // the padded 5x5 keeps the size, then the pool halves it
    after_first.saturating_sub(KERNEL - 1) / 2
}

/// A built model: its spec, its parameters, and the layers that read them.
#[derive(Debug, Clone)]
pub struct Model {
    spec: ModelSpec,
    params: Params,
    convs: Vec<Conv2d>,
    linears: Vec<Linear>,
    gpt: Option<Gpt>,
}

impl Model {
    /// Builds the model on `dev` with weights drawn from `seed`.
    pub fn new(spec: &ModelSpec, seed: u64, dev: &Device) -> Result<Model> {
        spec.validate()?;
        let mut vars = Vec::new();
        let mut fc_widths = Vec::new();
        let mut convs = Vec::new();
        match spec {
            ModelSpec::Gpt(g) => {
                let gpt = Gpt::new(g, seed, dev, &mut vars)?;
                return Ok(Model {
                    spec: spec.clone(),
                    params: Params::new(vars)?,
                    convs,
                    linears: Vec::new(),
                    gpt: Some(gpt),
                });
            }
            ModelSpec::Mlp { widths } => fc_widths.extend(widths),
            ModelSpec::Cnn {
                image,
                channels,
                hidden,
                classes,
            } => {
                let mut in_ch = 1;
                for (i, &out_ch) in channels.iter().enumerate() {
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
                let side = cnn_feature_side(image.0) * cnn_feature_side(image.1);
                fc_widths.push(channels[1] * side);
                fc_widths.extend(hidden);
                fc_widths.push(*classes);
            }
        }
        let mut linears = Vec::new();
        let n_fc = fc_widths.len() - 1;
        for (i, pair) in fc_widths.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let wname = format!("fc{i}.weight");
            let bname = format!("fc{i}.bias");
            let shape = [fan_out, fan_in];
            let w = if i + 1 == n_fc {
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
        Ok(Model {
            spec: spec.clone(),
            params: Params::new(vars)?,
            convs,
            linears,
            gpt: None,
        })
    }

    /// What was built.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The trainable parameters, name-sorted.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The fully connected layers, input first, when this model is an MLP (for the training
    /// step's hand-written backward pass).
    pub(crate) fn mlp_layers(&self) -> Option<&[Linear]> {
        matches!(self.spec, ModelSpec::Mlp { .. }).then_some(self.linears.as_slice())
    }

    /// The convolutions and the fully connected layers after them, when this model is a CNN
    /// (for the training step's hand-written backward pass).
    pub(crate) fn cnn_layers(&self) -> Option<crate::cnn::CnnLayers<'_>> {
        match self.spec {
            ModelSpec::Cnn { image, .. } => Some(crate::cnn::CnnLayers {
                image,
                convs: &self.convs,
                linears: &self.linears,
            }),
            _ => None,
        }
    }

    /// The GPT's layers, when this model is one (for generating text).
    pub fn gpt(&self) -> Option<&Gpt> {
        self.gpt.as_ref()
    }

    /// Logits `(batch, classes)` for features `(batch, input_dim)`; for a GPT, logits
    /// `(batch, time, 256)` for bytes `(batch, time)`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        if let Some(gpt) = &self.gpt {
            return gpt.forward(xs);
        }
        let mut xs = xs.clone();
        if let ModelSpec::Cnn { image, .. } = &self.spec {
            let batch = xs.dim(0)?;
            xs = xs.reshape((batch, 1, image.0, image.1))?;
            for conv in &self.convs {
                let bias = conv
                    .bias()
                    .ok_or_else(|| Error::Layout("a convolution without its bias".into()))?;
                xs = crate::cpu::conv::conv2d(&xs, conv.weight(), bias, conv.config().padding)?;
                // Pooling before the ReLU gives the same values (ReLU keeps order) from a
                // quarter of the work.
                xs = crate::cpu::conv::max_pool2x2(&xs)?.relu()?;
            }
            xs = xs.flatten_from(1)?;
        }
        let last = self.linears.len() - 1;
        for (i, layer) in self.linears.iter().enumerate() {
            xs = crate::cpu::matmul::linear_nd(&xs, layer.weight(), layer.bias())?;
            if i < last {
                xs = xs.relu()?;
            }
        }
        Ok(xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn mlp_shapes_names_and_determinism() {
        let spec = ModelSpec::Mlp {
            widths: vec![784, 256, 10],
        };
        let a = Model::new(&spec, 7, &Device::Cpu).expect("model");
        assert_eq!(a.params().numel(), 203_530);
        let names: Vec<_> = a
            .params()
            .layout()
            .entries
            .into_iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(names, ["fc0.bias", "fc0.weight", "fc1.bias", "fc1.weight"]);
        let b = Model::new(&spec, 7, &Device::Cpu).expect("model");
        assert_eq!(a.params().hash().expect("h"), b.params().hash().expect("h"));
        let xs = Tensor::zeros((3, 784), DType::F32, &Device::Cpu).expect("xs");
        assert_eq!(a.forward(&xs).expect("fwd").dims(), &[3, 10]);
    }

    #[test]
    fn cnn_on_mnist_shapes() {
        let spec = ModelSpec::Cnn {
            image: (28, 28),
            channels: [6, 16],
            hidden: vec![120, 84],
            classes: 10,
        };
        let m = Model::new(&spec, 1, &Device::Cpu).expect("model");
        let xs = Tensor::zeros((2, 784), DType::F32, &Device::Cpu).expect("xs");
        assert_eq!(m.forward(&xs).expect("fwd").dims(), &[2, 10]);
        assert_eq!(spec.name(), "cnn-6-16-120-84-10");
        let tiny = ModelSpec::Cnn {
            image: (8, 8),
            channels: [6, 16],
            hidden: vec![],
            classes: 10,
        };
        assert!(tiny.validate().is_err());
    }
}
