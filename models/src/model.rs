//! The model to build and the built model. A [`ModelSpec`] names the kind and its shape, and
//! hands everything about it to the kind's own spec (a [`Kind`]); a [`Model`] holds the
//! parameters and the kind's [`Network`] that reads them. The kinds: [`crate::mlp`],
//! [`crate::cnn`], [`crate::gpt`], [`crate::llama`]. A new architecture is one file implementing
//! [`crate::kind`]'s two traits and one arm in [`ModelSpec::kind`].
//!
//! Weights are created by [`crate::init`] from the run's seed (never by Candle's RNG), so two
//! nodes that build the same [`ModelSpec`] with the same seed hold bit-identical parameters.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::cnn::CnnSpec;
use crate::gpt::{Gpt, GptSpec};
pub use crate::kind::{Kind, Network};
use crate::llama::LlamaSpec;
use crate::mlp::MlpSpec;
use crate::params::Params;
use crate::Result;

/// What to build. Part of the run identity: nodes with different specs cannot train together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ModelSpec {
    /// Fully connected layers with ReLU between them.
    Mlp(MlpSpec),
    /// A LeNet-style convolutional network for small one-channel images.
    Cnn(CnnSpec),
    /// A decoder-only transformer over bytes.
    Gpt(GptSpec),
    /// A Llama-family decoder over a tokenizer's ids (a Hugging Face checkpoint's shape).
    Llama(LlamaSpec),
}

impl ModelSpec {
    /// The kind's own spec, where everything about the kind is decided.
    pub fn kind(&self) -> &dyn Kind {
        match self {
            ModelSpec::Mlp(s) => s,
            ModelSpec::Cnn(s) => s,
            ModelSpec::Gpt(s) => s,
            ModelSpec::Llama(s) => s,
        }
    }

    /// A short human name such as `mlp-784-256-10` or `cnn-6-16-120-84-10`.
    pub fn name(&self) -> String {
        self.kind().name()
    }

    /// Features per input sample the model expects.
    pub fn input_dim(&self) -> usize {
        self.kind().input_dim()
    }

    /// Number of output classes.
    pub fn classes(&self) -> usize {
        self.kind().classes()
    }

    /// Checks that the spec can be built; errors say which number is wrong.
    pub fn validate(&self) -> Result<()> {
        self.kind().validate()
    }
}

/// A built model: its spec, its parameters, and the network that reads them.
#[derive(Debug, Clone)]
pub struct Model {
    spec: ModelSpec,
    params: Params,
    network: Arc<dyn Network>,
}

impl Model {
    /// Builds the model on `dev` with weights drawn from `seed`.
    pub fn new(spec: &ModelSpec, seed: u64, dev: &Device) -> Result<Model> {
        spec.validate()?;
        let mut vars = Vec::new();
        let network = spec.kind().build(seed, dev, &mut vars)?;
        Ok(Model {
            spec: spec.clone(),
            params: Params::new(vars)?,
            network,
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

    /// The network that reads them (for the training step's hand-written backward passes).
    pub(crate) fn network(&self) -> &dyn Network {
        self.network.as_ref()
    }

    /// The GPT's layers, when this model is one (for generating text).
    pub fn gpt(&self) -> Option<&Gpt> {
        let network: &dyn std::any::Any = self.network.as_ref();
        network.downcast_ref::<Gpt>()
    }

    /// The Llama it is, where it is one (for text generation).
    pub fn llama(&self) -> Option<&crate::llama::Llama> {
        let network: &dyn std::any::Any = self.network.as_ref();
        network.downcast_ref::<crate::llama::Llama>()
    }

    /// Logits `(batch, classes)` for features `(batch, input_dim)`; for a GPT, logits
    /// `(batch, time, 256)` for bytes `(batch, time)`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.network.forward(xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn mlp_shapes_names_and_determinism() {
        let spec = ModelSpec::Mlp(MlpSpec {
            widths: vec![784, 256, 10],
        });
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
        let spec = ModelSpec::Cnn(CnnSpec {
            image: (28, 28),
            channels: [6, 16],
            hidden: vec![120, 84],
            classes: 10,
        });
        let m = Model::new(&spec, 1, &Device::Cpu).expect("model");
        let xs = Tensor::zeros((2, 784), DType::F32, &Device::Cpu).expect("xs");
        assert_eq!(m.forward(&xs).expect("fwd").dims(), &[2, 10]);
        assert_eq!(spec.name(), "cnn-6-16-120-84-10");
        let tiny = ModelSpec::Cnn(CnnSpec {
            image: (8, 8),
            channels: [6, 16],
            hidden: vec![],
            classes: 10,
        });
        assert!(tiny.validate().is_err());
    }

    /// Text generation reaches a GPT's own layers through the model; other kinds have none.
    #[test]
    fn only_a_gpt_model_hands_out_its_gpt() {
        let gpt = GptSpec {
            context: 8,
            layers: 1,
            width: 8,
            heads: 2,
        };
        let m = Model::new(&ModelSpec::Gpt(gpt), 1, &Device::Cpu).expect("gpt");
        assert_eq!(m.gpt().map(|g| *g.spec()), Some(gpt));
        assert_eq!(m.spec().name(), "gpt-c8-l1-w8-h2");
        let mlp = ModelSpec::Mlp(MlpSpec { widths: vec![4, 3] });
        assert!(Model::new(&mlp, 1, &Device::Cpu)
            .expect("mlp")
            .gpt()
            .is_none());
    }
}
