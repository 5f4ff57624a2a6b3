//! The multilayer perceptron: fully connected layers of configurable widths with ReLU between
//! them. Its training step is [`crate::dense`]'s hand-written backward pass.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::Linear;
use serde::Serialize;

use crate::dense;
use crate::kind::{join, Kind, Network};
use crate::{Error, Result};

/// An MLP's shape. Part of the run identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MlpSpec {
    /// Layer widths, input first, classes last, e.g. `[784, 256, 10]`; at least two entries.
    pub widths: Vec<usize>,
}

impl Kind for MlpSpec {
    fn name(&self) -> String {
        format!("mlp-{}", join(&self.widths))
    }

    fn input_dim(&self) -> usize {
        self.widths.first().copied().unwrap_or(0)
    }

    fn classes(&self) -> usize {
        self.widths.last().copied().unwrap_or(0)
    }

    fn validate(&self) -> Result<()> {
        if self.widths.len() < 2 || self.widths.contains(&0) {
            return Err(Error::Spec(format!(
                "an MLP needs at least two non-zero widths (input and classes), got {:?}",
                self.widths
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
        let linears = dense::fully_connected(&self.widths, seed, dev, vars)?;
        Ok(Arc::new(Mlp { linears }))
    }
}

/// A built MLP.
#[derive(Debug)]
struct Mlp {
    linears: Vec<Linear>,
}

impl Network for Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        dense::logits(&self.linears, xs)
    }

    fn loss_and_grads(&self, xs: &Tensor, ys: &Tensor) -> Option<Result<(Tensor, GradStore)>> {
        Some(dense::mlp_loss_and_grads(&self.linears, xs, ys))
    }
}
