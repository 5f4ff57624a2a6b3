//! One training step and evaluation: the numeric core both the daemon's trainer thread and the
//! bare benchmark loop call, so the two measure the same work.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};

use crate::model::Model;
use crate::optim::Optimizer;
use crate::samples::Samples;
use crate::Result;

/// Runs forward, cross-entropy loss, backward and one optimizer update on a batch; returns the
/// batch's mean loss. [`forward_backward`], then the optimizer, then the loss read back: the
/// daemon's trainer calls the parts one by one to time them for its timeline.
pub fn train_step(model: &Model, opt: &mut Optimizer, xs: &Tensor, ys: &Tensor) -> Result<f32> {
    let (loss, grads) = forward_backward(model, xs, ys)?;
    opt.step(model.params(), &grads)?;
    loss_value(&loss)
}

/// The forward pass, the batch's mean cross-entropy loss and every parameter's gradient. An
/// MLP, and a GPT, a CNN or a llama on the CPU, take their hand-written backward passes (the
/// same gradients as autograd, without its zero-seeded accumulation); otherwise Candle's
/// autograd.
pub fn forward_backward(model: &Model, xs: &Tensor, ys: &Tensor) -> Result<(Tensor, GradStore)> {
    if let Some(by_hand) = model.network().loss_and_grads(xs, ys) {
        return by_hand;
    }
    let (logits, ys) = per_prediction(model.forward(xs)?, ys)?;
    let loss = crate::cpu::fused::cross_entropy(&logits, &ys)?;
    let grads = loss.backward()?;
    Ok((loss, grads))
}

/// A scalar loss tensor's value as an `f32` (on a GPU, this waits for the step to finish).
pub fn loss_value(loss: &Tensor) -> Result<f32> {
    Ok(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?)
}

/// One row of logits per prediction: a classifier's `(batch, classes)` as they are, a
/// language model's `(batch, time, vocab)` with its `(batch, time)` targets flattened to
/// `(batch·time, vocab)` and `(batch·time,)`.
fn per_prediction(logits: Tensor, ys: &Tensor) -> Result<(Tensor, Tensor)> {
    if logits.rank() == 3 {
        let (b, t, v) = logits.dims3()?;
        return Ok((logits.reshape((b * t, v))?, ys.flatten_all()?));
    }
    Ok((logits, ys.clone()))
}

/// Accuracy and mean loss of a model on a data set.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Evaluation {
    /// Fraction of predictions that were right, in `[0, 1]` (for text: next bytes or tokens
    /// guessed).
    pub accuracy: f64,
    /// Mean cross-entropy loss per prediction, in nats.
    pub loss: f64,
    /// Number of samples evaluated.
    pub samples: usize,
    /// For text, the loss in bits per byte (every prediction's nats over the bytes of text
    /// the predicted bytes or tokens stand for, / ln 2): what a compressor built on the model
    /// would spend per byte of held-out text, whatever its vocabulary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f64>,
}

/// Evaluates `model` on all of `data`, in batches of [`Samples::eval_batch`] samples.
pub fn evaluate(model: &Model, data: &dyn Samples, dev: &Device) -> Result<Evaluation> {
    let mut correct = 0usize;
    let mut loss_sum = 0.0f64;
    let mut predictions = 0usize;
    let mut text_bytes: Option<u64> = None;
    let indices: Vec<usize> = (0..data.len()).collect();
    for chunk in indices.chunks(data.eval_batch().max(1)) {
        let (xs, ys) = data.batch(chunk, dev)?;
        if let Some(bytes) = data.target_bytes(&ys)? {
            *text_bytes.get_or_insert(0) += bytes;
        }
        let (logits, ys) = per_prediction(model.forward(&xs)?, &ys)?;
        let rows = ys.elem_count();
        let loss = candle_nn::loss::cross_entropy(&logits, &ys)?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        loss_sum += f64::from(loss) * rows as f64;
        predictions += rows;
        let predicted = logits.argmax(1)?;
        correct += predicted
            .eq(&ys)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
    }
    let n = predictions.max(1) as f64;
    let loss = loss_sum / n;
    Ok(Evaluation {
        accuracy: correct as f64 / n,
        loss,
        samples: data.len(),
        // The nats of every prediction over the bytes they stand for. Nothing evaluated is no
        // figure, not a perfect one.
        bits_per_byte: text_bytes
            .filter(|b| *b > 0 && predictions > 0)
            .map(|b| loss_sum / b as f64 / std::f64::consts::LN_2),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{load_digits, split_seeded, Sampler};
    use crate::mlp::MlpSpec;
    use crate::model::ModelSpec;
    use crate::optim::OptimizerSpec;

    #[test]
    fn digits_mlp_learns() {
        let dev = Device::Cpu;
        let split = split_seeded(&load_digits(None).expect("digits"), 0.2, 1).expect("split");
        let model = Model::new(
            &ModelSpec::Mlp(MlpSpec {
                widths: vec![64, 64, 10],
            }),
            3,
            &dev,
        )
        .expect("model");
        let spec = OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.0,
        };
        let mut opt = Optimizer::new(&spec, model.params()).expect("opt");
        let before = evaluate(&model, &split.test, &dev).expect("eval");
        let mut sampler = Sampler::new(split.train.len(), 11);
        for _ in 0..600 {
            let (xs, ys) = split
                .train
                .batch(&sampler.next_batch(32), &dev)
                .expect("batch");
            let loss = train_step(&model, &mut opt, &xs, &ys).expect("step");
            assert!(loss.is_finite());
        }
        let after = evaluate(&model, &split.test, &dev).expect("eval");
        assert!(
            after.accuracy > 0.9,
            "accuracy {} after training",
            after.accuracy
        );
        assert!(after.loss < before.loss);
    }

    /// The hand-written MLP backward pass gives Candle autograd's loss and gradients, for
    /// three layers (two ReLUs) on a real batch.
    #[test]
    fn the_mlp_backward_by_hand_matches_autograd() {
        let dev = Device::Cpu;
        let split = split_seeded(&load_digits(None).expect("digits"), 0.2, 1).expect("split");
        let spec = ModelSpec::Mlp(MlpSpec {
            widths: vec![64, 48, 32, 10],
        });
        let model = Model::new(&spec, 5, &dev).expect("model");
        let (xs, ys) = split
            .train
            .batch(&(0..37).collect::<Vec<_>>(), &dev)
            .expect("batch");
        let (loss, grads) = model
            .network()
            .loss_and_grads(&xs, &ys)
            .expect("an mlp has its own backward pass")
            .expect("by hand");
        let auto_loss =
            candle_nn::loss::cross_entropy(&model.forward(&xs).expect("fwd"), &ys).expect("loss");
        let auto = auto_loss.backward().expect("backward");
        let scalar = |t: &Tensor| t.to_scalar::<f32>().expect("scalar");
        assert!((scalar(&loss) - scalar(&auto_loss)).abs() < 1e-5);
        for (name, var) in model.params().vars() {
            let mine = grads.get(var.as_tensor()).expect("by hand");
            let theirs = auto.get(var.as_tensor()).expect("autograd");
            assert_eq!(mine.dims(), theirs.dims(), "{name}");
            let diff = (mine - theirs)
                .and_then(|d| d.abs())
                .and_then(|d| d.max_all())
                .and_then(|d| d.to_scalar::<f32>())
                .expect("diff");
            assert!(diff < 1e-5, "{name}: {diff}");
        }
    }
}
