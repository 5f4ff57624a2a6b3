//! Deterministic weight initialisation from a seed.
//!
//! Candle's CPU random generator cannot be seeded, yet every node of a run must start from
//! identical weights without talking to anyone. So weights come from ChaCha8, whose output is
//! fixed by its seed on every platform, with one stream per parameter name: adding a layer
//! does not change the initial values of the others.

use candle_core::{Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

use crate::Result;

/// The random generator for parameter `name` under run seed `seed`.
pub fn rng_for(seed: u64, name: &str) -> ChaCha8Rng {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(name.as_bytes());
    let digest = h.finalize();
    let mut key = [0u8; 32];
    key.copy_from_slice(&digest);
    ChaCha8Rng::from_seed(key)
}

/// A weight tensor drawn uniformly from `±sqrt(6 / fan_in)` (He-uniform): keeps activations'
/// scale through ReLU layers.
pub fn he_uniform(
    seed: u64,
    name: &str,
    shape: &[usize],
    fan_in: usize,
    dev: &Device,
) -> Result<Var> {
    uniform(
        seed,
        name,
        shape,
        (6.0 / fan_in.max(1) as f64).sqrt() as f32,
        dev,
    )
}

/// A weight tensor drawn uniformly from `±sqrt(6 / (fan_in + fan_out))` (Glorot-uniform): for
/// the output layer, where no ReLU follows and He's larger scale only inflates the first
/// logits.
pub fn glorot_uniform(
    seed: u64,
    name: &str,
    shape: &[usize],
    fan_in: usize,
    fan_out: usize,
    dev: &Device,
) -> Result<Var> {
    uniform(
        seed,
        name,
        shape,
        (6.0 / (fan_in + fan_out).max(1) as f64).sqrt() as f32,
        dev,
    )
}

fn uniform(seed: u64, name: &str, shape: &[usize], bound: f32, dev: &Device) -> Result<Var> {
    let mut rng = rng_for(seed, name);
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Ok(Var::from_tensor(&Tensor::from_vec(values, shape, dev)?)?)
}

/// A weight tensor drawn from a normal distribution of mean 0 and standard deviation `std`
/// (the transformer's initialisation).
pub fn normal(seed: u64, name: &str, shape: &[usize], std: f32, dev: &Device) -> Result<Var> {
    let mut rng = rng_for(seed, name);
    let dist = rand_distr::Normal::new(0.0f32, std)
        .map_err(|e| crate::Error::Spec(format!("normal init of {name} with std {std}: {e}")))?;
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| rand_distr::Distribution::sample(&dist, &mut rng))
        .collect();
    Ok(Var::from_tensor(&Tensor::from_vec(values, shape, dev)?)?)
}

/// A tensor of ones (layer norms' gains start at one).
pub fn ones(shape: &[usize], dev: &Device) -> Result<Var> {
    Ok(Var::ones(shape, candle_core::DType::F32, dev)?)
}

/// A zero tensor (biases start at zero).
pub fn zeros(shape: &[usize], dev: &Device) -> Result<Var> {
    Ok(Var::zeros(shape, candle_core::DType::F32, dev)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_weights_other_seed_other_weights() {
        let dev = Device::Cpu;
        let a = he_uniform(1, "fc.weight", &[3, 4], 4, &dev).expect("a");
        let b = he_uniform(1, "fc.weight", &[3, 4], 4, &dev).expect("b");
        let c = he_uniform(2, "fc.weight", &[3, 4], 4, &dev).expect("c");
        let flat = |v: &Var| {
            v.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("vec")
        };
        assert_eq!(flat(&a), flat(&b));
        assert_ne!(flat(&a), flat(&c));
        assert!(flat(&a).iter().all(|v| v.abs() <= (6.0f32 / 4.0).sqrt()));
    }
}
