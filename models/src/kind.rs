//! What every model kind provides: its spec is a [`Kind`] (a name, input and output sizes,
//! checks, and the network it builds), and what it builds is a [`Network`] (the forward pass,
//! and a hand-written backward pass where the kind has one). [`crate::model`] holds a kind's
//! spec and network; the kinds ([`crate::mlp`], [`crate::cnn`], [`crate::gpt`]) implement both.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use crate::Result;

/// A model kind's spec: what the daemon checks a config against, and how the kind builds.
pub trait Kind {
    /// A short human name such as `mlp-784-256-10`.
    fn name(&self) -> String;
    /// Features per input sample the model expects.
    fn input_dim(&self) -> usize;
    /// Number of output classes.
    fn classes(&self) -> usize;
    /// Checks that the spec can be built; errors say which number is wrong.
    fn validate(&self) -> Result<()>;
    /// Builds the network on `dev` with weights drawn from `seed`, appending each parameter
    /// (named as docs/configuration.md documents) to `vars`.
    fn build(
        &self,
        seed: u64,
        dev: &Device,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Arc<dyn Network>>;
}

/// A built network: the layers that read a [`crate::Model`]'s parameters. `Any`, so that a
/// caller that needs one kind's own abilities (a GPT's text generation) can ask for them.
pub trait Network: std::any::Any + std::fmt::Debug + Send + Sync {
    /// Logits `(batch, classes)` for features `(batch, input_dim)`; for a language model,
    /// logits `(batch, time, vocab)` for tokens `(batch, time)`. On Candle's graph, so that
    /// autograd can take the gradients of a loss of them.
    fn forward(&self, xs: &Tensor) -> Result<Tensor>;

    /// The batch's mean cross-entropy and every parameter's gradient by the kind's own
    /// backward pass, where it has one for these inputs (on this device); `None`: training
    /// takes Candle's autograd through [`Network::forward`].
    fn loss_and_grads(&self, _xs: &Tensor, _ys: &Tensor) -> Option<Result<(Tensor, GradStore)>> {
        None
    }
}

/// `v` as `a-b-c`, for the kinds' names.
pub(crate) fn join(v: &[usize]) -> String {
    v.iter()
        .map(|w| w.to_string())
        .collect::<Vec<_>>()
        .join("-")
}
