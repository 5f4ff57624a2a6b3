//! Text generation shared by the language models: continue a sequence of ids one at a time,
//! each drawn from the model's next-token distribution at a temperature, with a seeded
//! generator (the same seed gives the same text).

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::Result;

/// Continues `prompt` (not empty) by `count` ids: at each step `forward` gives the logits
/// `(1, time, vocab)` of the last `context` ids, and the next id is the likeliest at
/// temperature 0, else drawn from `softmax(logits / temperature)`.
pub fn continue_ids(
    forward: impl Fn(&Tensor) -> Result<Tensor>,
    context: usize,
    dev: &Device,
    prompt: &[u32],
    count: usize,
    temperature: f64,
    seed: u64,
) -> Result<Vec<u32>> {
    if prompt.is_empty() || context == 0 {
        return Err(crate::Error::Spec(
            "generation continues a prompt of one id or more, in a context of one or more".into(),
        ));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut ids = prompt.to_vec();
    let mut out = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let window = &ids[ids.len().saturating_sub(context)..];
        let n = window.len();
        let tokens = Tensor::from_slice(window, (1, n), dev)?;
        let logits = forward(&tokens)?
            .narrow(1, n - 1, 1)?
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let next = if temperature <= 0.0 {
            argmax(&logits)
        } else {
            let top = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f64> = logits
                .iter()
                .map(|&l| (f64::from(l - top) / temperature).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let mut pick = rng.random::<f64>() * total;
            let mut chosen = argmax(&logits);
            for (i, w) in weights.iter().enumerate() {
                if pick < *w {
                    chosen = i;
                    break;
                }
                pick -= w;
            }
            chosen
        } as u32;
        ids.push(next);
        out.push(next);
    }
    Ok(out)
}

fn argmax(values: &[f32]) -> usize {
    values
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0
}
