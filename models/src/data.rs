//! Data sets: the bundled handwritten digits, MNIST in IDX format, and a seeded synthetic set;
//! fixed train/test splits and per-node sampling; and [`Data`], which is either such a split or
//! a text ([`crate::text`]), with the one view of samples ([`Samples`]) training and evaluation
//! read through.
//!
//! Labelled sets are held in memory as `f32` features (in `[0, 1]` as loaded) and `u32` labels (a
//! text as its bytes, see [`crate::text`]): the largest labelled set
//! we train on (MNIST, 60,000 x 784) is about 190 MB as `f32`, which every node can afford, and
//! it keeps batching a plain gather.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

pub use crate::samples::Samples;
use crate::samples::{gunzip_if_needed, read_maybe_gz};
use crate::{Error, Result};

/// The handwritten-digits set shipped with p2ptrain (UCI optical digits, scikit-learn's copy,
/// BSD-3; see `data/digits.rst`), so the default demo and the tests need no download.
pub const BUNDLED_DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// An in-memory labelled data set.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Row-major features, `len() * dim` values: in `[0, 1]` as loaded, standardized after
    /// [`Split::standardize`].
    pub features: Vec<f32>,
    /// One class index per sample, each `< classes`.
    pub labels: Vec<u32>,
    /// Features per sample.
    pub dim: usize,
    /// Number of classes.
    pub classes: usize,
    /// Height and width when the features are a one-channel image (convolutional models need it).
    pub image: Option<(usize, usize)>,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the set holds no sample.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// A new set holding the given samples, in the given order.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let mut features = Vec::with_capacity(indices.len() * self.dim);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            features.extend_from_slice(&self.features[i * self.dim..(i + 1) * self.dim]);
            labels.push(self.labels[i]);
        }
        Dataset {
            features,
            labels,
            dim: self.dim,
            classes: self.classes,
            image: self.image,
        }
    }

    /// Part `k` of `n` of this set, cut as `how` says, for boxes that each own part of the
    /// data. Every node computes the same cut from the same `seed` (the run's split seed), so
    /// the parts are disjoint. A part may come out empty (a class nobody owns, or a Dirichlet
    /// draw that gives a node nothing); the caller decides whether that is an error.
    pub fn part(&self, how: Partition, k: usize, n: usize, seed: u64) -> Result<Dataset> {
        if n == 0 || k >= n {
            return Err(Error::Spec(format!("part {k} of {n} does not exist")));
        }
        let by_class = || {
            let mut of_class = vec![Vec::new(); self.classes];
            for (i, &label) in self.labels.iter().enumerate() {
                if let Some(v) = of_class.get_mut(label as usize) {
                    v.push(i);
                }
            }
            of_class
        };
        let mut indices: Vec<usize> = match how {
            Partition::Iid => (k..self.len()).step_by(n).collect(),
            Partition::ByLabel { classes_per_part } => {
                if classes_per_part == 0 || classes_per_part > self.classes {
                    return Err(Error::Spec(format!(
                        "classes per part must be 1..={}, got {classes_per_part}",
                        self.classes
                    )));
                }
                let mut mine = Vec::new();
                for (class, samples) in by_class().into_iter().enumerate() {
                    let owners: Vec<usize> = (0..n)
                        .filter(|&part| {
                            Partition::label_owned(class, part, classes_per_part, self.classes)
                        })
                        .collect();
                    if let Some(slot) = owners.iter().position(|&o| o == k) {
                        mine.extend(samples.into_iter().skip(slot).step_by(owners.len()));
                    }
                }
                mine
            }
            Partition::Dirichlet { alpha } => {
                let gamma = rand_distr::Gamma::new(alpha, 1.0).map_err(|e| {
                    Error::Spec(format!("dirichlet alpha must be > 0, got {alpha}: {e}"))
                })?;
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ DIRICHLET_SEED_SALT);
                let mut mine = Vec::new();
                for mut samples in by_class() {
                    samples.shuffle(&mut rng);
                    let draws: Vec<f64> = (0..n).map(|_| gamma.sample(&mut rng)).collect();
                    let total: f64 = draws.iter().sum();
                    // Cumulative proportions cut the class's samples; a draw that underflows
                    // everywhere (tiny alpha) hands the whole class to part 0.
                    let share = |upto: usize| -> usize {
                        if total > 0.0 && total.is_finite() {
                            let p: f64 = draws[..upto].iter().sum::<f64>() / total;
                            ((p * samples.len() as f64).round() as usize).min(samples.len())
                        } else if upto == 0 {
                            0
                        } else {
                            samples.len()
                        }
                    };
                    mine.extend_from_slice(&samples[share(k)..share(k + 1)]);
                }
                mine
            }
        };
        indices.sort_unstable();
        Ok(self.subset(&indices))
    }

    /// How many samples of each class the set holds, indexed by class.
    pub fn class_counts(&self) -> Vec<u64> {
        let mut counts = vec![0u64; self.classes];
        for &label in &self.labels {
            if let Some(c) = counts.get_mut(label as usize) {
                *c += 1;
            }
        }
        counts
    }

    /// Gathers the given samples into a `(batch, dim)` feature tensor and a `(batch,)` label
    /// tensor on `dev`.
    pub fn batch(&self, indices: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
        let mut xs = Vec::with_capacity(indices.len() * self.dim);
        let mut ys = Vec::with_capacity(indices.len());
        for &i in indices {
            xs.extend_from_slice(&self.features[i * self.dim..(i + 1) * self.dim]);
            ys.push(self.labels[i]);
        }
        let xs = Tensor::from_vec(xs, (indices.len(), self.dim), dev)?;
        let ys = Tensor::from_vec(ys, indices.len(), dev)?;
        Ok((xs, ys))
    }
}

impl Samples for Dataset {
    fn len(&self) -> usize {
        Dataset::len(self)
    }

    fn batch(&self, indices: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
        Dataset::batch(self, indices, dev)
    }
}

/// What a node trains and evaluates on: labelled samples (a classifier's), or a text (a
/// language model's).
#[derive(Debug, Clone)]
pub enum Data {
    /// Features and labels, split into training and held-out samples.
    Labeled(Split),
    /// A text, split into a training head and a held-out tail.
    Text(crate::text::TextSplit),
    /// A token file, split into a training head and a held-out tail.
    Tokens(crate::tokens::TokenSplit),
}

impl Data {
    /// The training samples.
    pub fn train(&self) -> &dyn Samples {
        match self {
            Data::Labeled(s) => &s.train,
            Data::Text(t) => &t.train,
            Data::Tokens(t) => &t.train,
        }
    }

    /// The held-out samples.
    pub fn test(&self) -> &dyn Samples {
        match self {
            Data::Labeled(s) => &s.test,
            Data::Text(t) => &t.test,
            Data::Tokens(t) => &t.test,
        }
    }

    /// The labelled split, when the data is one.
    pub fn labeled(&self) -> Option<&Split> {
        match self {
            Data::Labeled(s) => Some(s),
            Data::Text(_) | Data::Tokens(_) => None,
        }
    }
}

/// Salt of the Dirichlet partition's generator, so it draws apart from the split's shuffle,
/// which uses the same run seed.
const DIRICHLET_SEED_SALT: u64 = 0x5041_5254_4954_494f;

/// How a training set is cut between boxes that each own part of it: uniformly, or skewed
/// the way federated users' data is (each box sees only some classes, or a random mix).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Partition {
    /// Every `n`-th sample: each part a uniform sample of the whole (as PyTorch's
    /// `DistributedSampler` gives ranks).
    Iid,
    /// Part `k` holds only classes `k·c … k·c + c − 1` (modulo the class count); a class
    /// several parts hold is dealt round-robin between them, and one no part holds is unused.
    ByLabel {
        /// `c`, the classes each part holds.
        classes_per_part: usize,
    },
    /// Each class is spread over the parts in proportions drawn from a symmetric Dirichlet
    /// distribution: the smaller `alpha`, the fewer classes dominate each part.
    Dirichlet {
        /// Concentration, > 0 (0.1: nearly one class per part; 100: nearly uniform).
        alpha: f64,
    },
}

impl Partition {
    /// Whether part `part` holds `class` under [`Partition::ByLabel`] with `per_part` classes
    /// each, out of `classes`.
    fn label_owned(class: usize, part: usize, per_part: usize, classes: usize) -> bool {
        let first = (part * per_part) % classes;
        (class + classes - first) % classes < per_part
    }

    /// Classes per part that gives every class an owner when `parts` parts share `classes`.
    pub fn covering_classes_per_part(classes: usize, parts: usize) -> usize {
        classes.div_ceil(parts.max(1)).max(1)
    }
}

/// A data set cut into the samples a node trains on and the held-out samples it evaluates on.
#[derive(Debug, Clone)]
pub struct Split {
    /// Training samples.
    pub train: Dataset,
    /// Held-out samples, never trained on.
    pub test: Dataset,
}

impl Split {
    /// Shifts and scales every feature by the training set's overall mean and standard
    /// deviation (one scalar each, as is usual for MNIST), for both halves. Zero-mean,
    /// unit-variance inputs let plain SGD take larger steps. Every node computes the same two
    /// numbers from the same split, so models stay interchangeable.
    pub fn standardize(&mut self) {
        let n = self.train.features.len().max(1) as f64;
        let mean = self
            .train
            .features
            .iter()
            .map(|&v| f64::from(v))
            .sum::<f64>()
            / n;
        let var = self
            .train
            .features
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        let std = var.sqrt().max(1e-6);
        for set in [&mut self.train, &mut self.test] {
            for v in &mut set.features {
                *v = ((f64::from(*v) - mean) / std) as f32;
            }
        }
    }
}

/// Splits `data` with a seeded shuffle so that every node of a run holds out the same samples.
pub fn split_seeded(data: &Dataset, test_fraction: f64, seed: u64) -> Result<Split> {
    if !(0.0..1.0).contains(&test_fraction) || test_fraction.is_nan() {
        return Err(Error::Spec(format!(
            "test_fraction must be in [0, 1), got {test_fraction}"
        )));
    }
    let mut order: Vec<usize> = (0..data.len()).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let n_test = ((data.len() as f64) * test_fraction).round() as usize;
    let (test, train) = order.split_at(n_test);
    Ok(Split {
        train: data.subset(train),
        test: data.subset(test),
    })
}

/// Loads the digits set from its CSV form (64 pixel values 0..16, then the label 0..9, one
/// sample a line; gzipped or not). `None` reads the copy bundled in the binary.
pub fn load_digits(path: Option<&Path>) -> Result<Dataset> {
    let (text, path) = match path {
        Some(p) => (read_maybe_gz(p)?, p.to_owned()),
        None => {
            let p = PathBuf::from("<bundled digits.csv.gz>");
            (gunzip_if_needed(BUNDLED_DIGITS_CSV_GZ.to_vec(), &p)?, p)
        }
    };
    parse_digits_csv(&text, &path)
}

/// Parses the digits CSV; errors name the line and field.
pub fn parse_digits_csv(text: &[u8], path: &Path) -> Result<Dataset> {
    const PIXELS: usize = 64;
    let bad = |line: usize, msg: String| Error::Format {
        path: path.to_owned(),
        msg: format!("line {line}: {msg}"),
    };
    let text = std::str::from_utf8(text).map_err(|e| Error::Format {
        path: path.to_owned(),
        msg: format!("not UTF-8 text: {e}"),
    })?;
    let mut features = Vec::new();
    let mut labels = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != PIXELS + 1 {
            return Err(bad(
                line_no,
                format!("expected {} fields, found {}", PIXELS + 1, fields.len()),
            ));
        }
        for (j, field) in fields.iter().enumerate() {
            let value: f32 = field.trim().parse().map_err(|_| {
                bad(
                    line_no,
                    format!("field {}: {:?} is not a number", j + 1, field.trim()),
                )
            })?;
            if j < PIXELS {
                if !(0.0..=16.0).contains(&value) {
                    return Err(bad(
                        line_no,
                        format!("field {}: pixel {value} outside 0..16", j + 1),
                    ));
                }
                features.push(value / 16.0);
            } else {
                if value.fract() != 0.0 || !(0.0..=9.0).contains(&value) {
                    return Err(bad(line_no, format!("label {value} is not a digit 0..9")));
                }
                labels.push(value as u32);
            }
        }
    }
    if labels.is_empty() {
        return Err(Error::Format {
            path: path.to_owned(),
            msg: "no samples".into(),
        });
    }
    Ok(Dataset {
        features,
        labels,
        dim: PIXELS,
        classes: 10,
        image: Some((8, 8)),
    })
}

/// The IDX magic numbers of the two file kinds MNIST uses.
const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
const IDX_LABELS_MAGIC: u32 = 0x0000_0801;

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Parses an IDX3 image file (u8 pixels) into `(count, rows, cols, pixels)`.
pub fn parse_idx_images(bytes: &[u8], path: &Path) -> Result<(usize, usize, usize, Vec<f32>)> {
    let bad = |msg: String| Error::Format {
        path: path.to_owned(),
        msg,
    };
    if bytes.len() < 4 {
        return Err(bad(format!(
            "too short for an IDX file ({} bytes)",
            bytes.len()
        )));
    }
    let magic = be_u32(bytes, 0);
    if magic != IDX_IMAGES_MAGIC {
        return Err(bad(format!(
            "wrong IDX magic {magic:#010x}: expected {IDX_IMAGES_MAGIC:#010x} (2051, u8 images)"
        )));
    }
    if bytes.len() < 16 {
        return Err(bad(format!(
            "too short for an IDX3 header ({} bytes)",
            bytes.len()
        )));
    }
    let (n, rows, cols) = (
        be_u32(bytes, 4) as usize,
        be_u32(bytes, 8) as usize,
        be_u32(bytes, 12) as usize,
    );
    let expected = n
        .checked_mul(rows)
        .and_then(|v| v.checked_mul(cols))
        .ok_or_else(|| bad("header sizes overflow".into()))?;
    if bytes.len() - 16 != expected {
        return Err(bad(format!(
            "header promises {n} images of {rows}x{cols} ({expected} bytes) but {} bytes follow",
            bytes.len() - 16
        )));
    }
    let pixels = bytes[16..].iter().map(|&b| f32::from(b) / 255.0).collect();
    Ok((n, rows, cols, pixels))
}

/// Parses an IDX1 label file (u8 labels).
pub fn parse_idx_labels(bytes: &[u8], path: &Path) -> Result<Vec<u32>> {
    let bad = |msg: String| Error::Format {
        path: path.to_owned(),
        msg,
    };
    if bytes.len() < 4 {
        return Err(bad(format!(
            "too short for an IDX file ({} bytes)",
            bytes.len()
        )));
    }
    let magic = be_u32(bytes, 0);
    if magic != IDX_LABELS_MAGIC {
        return Err(bad(format!(
            "wrong IDX magic {magic:#010x}: expected {IDX_LABELS_MAGIC:#010x} (2049, u8 labels)"
        )));
    }
    if bytes.len() < 8 {
        return Err(bad(format!(
            "too short for an IDX1 header ({} bytes)",
            bytes.len()
        )));
    }
    let n = be_u32(bytes, 4) as usize;
    if bytes.len() - 8 != n {
        return Err(bad(format!(
            "header promises {n} labels but {} bytes follow",
            bytes.len() - 8
        )));
    }
    Ok(bytes[8..].iter().map(|&b| u32::from(b)).collect())
}

/// Loads one IDX image file and its label file as a data set.
pub fn load_idx_pair(images: &Path, labels: &Path) -> Result<Dataset> {
    let (n, rows, cols, features) = parse_idx_images(&read_maybe_gz(images)?, images)?;
    let labels_v = parse_idx_labels(&read_maybe_gz(labels)?, labels)?;
    if labels_v.len() != n {
        return Err(Error::Format {
            path: labels.to_owned(),
            msg: format!("{} labels for {n} images", labels_v.len()),
        });
    }
    let classes = labels_v.iter().copied().max().map_or(0, |m| m as usize + 1);
    Ok(Dataset {
        features,
        labels: labels_v,
        dim: rows * cols,
        classes: classes.max(10),
        image: Some((rows, cols)),
    })
}

/// Finds `stem` or `stem.gz` in `dir`.
fn find_idx(dir: &Path, stem: &str) -> Result<PathBuf> {
    for name in [format!("{stem}.gz"), stem.to_string()] {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(Error::Io {
        path: dir.join(format!("{stem}[.gz]")),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
    })
}

/// Whether `dir` holds the four MNIST IDX files (gzipped or raw); tests use this to skip with a
/// message when the files are absent.
pub fn mnist_present(dir: &Path) -> bool {
    MNIST_FILES.iter().all(|stem| find_idx(dir, stem).is_ok())
}

const MNIST_FILES: [&str; 4] = [
    "train-images.idx3-ubyte",
    "train-labels.idx1-ubyte",
    "t10k-images.idx3-ubyte",
    "t10k-labels.idx1-ubyte",
];

/// Loads MNIST from a directory with its standard file names; the split is MNIST's own
/// (60,000 train, 10,000 test).
pub fn load_mnist(dir: &Path) -> Result<Split> {
    let [tri, trl, tei, tel] = MNIST_FILES.map(|stem| find_idx(dir, stem));
    Ok(Split {
        train: load_idx_pair(&tri?, &trl?)?,
        test: load_idx_pair(&tei?, &tel?)?,
    })
}

/// Makes a seeded synthetic classification set: `classes` Gaussian clusters in `dim`
/// dimensions, squashed into `[0, 1]`. Useful for tests of any size without files.
pub fn synthetic(samples: usize, dim: usize, classes: usize, seed: u64) -> Result<Dataset> {
    if samples == 0 || dim == 0 || classes < 2 {
        return Err(Error::Spec(
            "synthetic data needs samples > 0, dim > 0 and classes >= 2".into(),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 1.0).map_err(|e| Error::Spec(e.to_string()))?;
    let centres: Vec<f32> = (0..classes * dim)
        .map(|_| normal.sample(&mut rng) * 1.5)
        .collect();
    let mut features = Vec::with_capacity(samples * dim);
    let mut labels = Vec::with_capacity(samples);
    for i in 0..samples {
        let class = i % classes;
        for d in 0..dim {
            let v = centres[class * dim + d] + normal.sample(&mut rng);
            // A logistic squash keeps features in [0, 1] like the image sets.
            features.push(1.0 / (1.0 + (-v).exp()));
        }
        labels.push(class as u32);
    }
    Ok(Dataset {
        features,
        labels,
        dim,
        classes,
        image: None,
    })
}

/// An endless, seeded stream of training indices: each epoch is a fresh permutation derived
/// from `(seed, epoch)`, so the stream's position is one number (`cursor`) that a checkpoint
/// can store and a restart can seek back to exactly.
#[derive(Debug, Clone)]
pub struct Sampler {
    n: usize,
    seed: u64,
    cursor: u64,
    perm_epoch: Option<u64>,
    perm: Vec<usize>,
}

impl Sampler {
    /// A sampler over `n` samples; different nodes pass different seeds so they see the data in
    /// different orders.
    pub fn new(n: usize, seed: u64) -> Sampler {
        Sampler {
            n,
            seed,
            cursor: 0,
            perm_epoch: None,
            perm: Vec::new(),
        }
    }

    /// Samples drawn so far (over all epochs).
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Moves the stream to an absolute position, as after a restart.
    pub fn seek(&mut self, cursor: u64) {
        self.cursor = cursor;
    }

    /// The next `batch` indices, continuing across epoch boundaries.
    pub fn next_batch(&mut self, batch: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(batch);
        if self.n == 0 {
            return out;
        }
        while out.len() < batch {
            let epoch = self.cursor / self.n as u64;
            if self.perm_epoch != Some(epoch) {
                self.perm = (0..self.n).collect();
                let mix = self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                self.perm.shuffle(&mut ChaCha8Rng::seed_from_u64(mix));
                self.perm_epoch = Some(epoch);
            }
            out.push(self.perm[(self.cursor % self.n as u64) as usize]);
            self.cursor += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_and_cover_the_set() {
        let d = synthetic(103, 3, 2, 1).expect("data");
        let shards: Vec<Dataset> = (0..4)
            .map(|k| d.part(Partition::Iid, k, 4, 9).expect("part"))
            .collect();
        assert_eq!(shards.iter().map(Dataset::len).sum::<usize>(), 103);
        assert_eq!(shards[0].len(), 26);
        assert_eq!(shards[3].len(), 25);
        // Sample 5 is shard 1's second.
        assert_eq!(shards[1].features[3..6], d.features[15..18]);
        assert_eq!(shards[1].labels[1], d.labels[5]);
        assert!(d.part(Partition::Iid, 4, 4, 9).is_err());
    }

    #[test]
    fn by_label_parts_hold_only_their_classes_and_share_the_rest_disjointly() {
        let d = load_digits(None).expect("digits");
        let c = Partition::covering_classes_per_part(10, 3);
        assert_eq!(c, 4);
        let how = Partition::ByLabel {
            classes_per_part: c,
        };
        let parts: Vec<Dataset> = (0..3)
            .map(|k| d.part(how, k, 3, 1).expect("part"))
            .collect();
        let held: Vec<Vec<usize>> = parts
            .iter()
            .map(|p| {
                let counts = p.class_counts();
                (0..10).filter(|&c| counts[c] > 0).collect()
            })
            .collect();
        assert_eq!(held[0], vec![0, 1, 2, 3]);
        assert_eq!(held[1], vec![4, 5, 6, 7]);
        assert_eq!(held[2], vec![0, 1, 8, 9]);
        // Classes 0 and 1 are dealt between parts 0 and 2; every sample lands exactly once.
        assert_eq!(parts.iter().map(Dataset::len).sum::<usize>(), d.len());
        let whole = d.class_counts();
        let zero: u64 = parts.iter().map(|p| p.class_counts()[0]).sum();
        assert_eq!(zero, whole[0]);
        assert!(parts[0].class_counts()[0].abs_diff(parts[2].class_counts()[0]) <= 1);
        assert!(d
            .part(
                Partition::ByLabel {
                    classes_per_part: 11
                },
                0,
                3,
                1
            )
            .is_err());
    }

    #[test]
    fn dirichlet_parts_are_seeded_disjoint_and_skewed_when_alpha_is_small() {
        let d = load_digits(None).expect("digits");
        let cut = |alpha, seed| -> Vec<Vec<u64>> {
            (0..4)
                .map(|k| {
                    d.part(Partition::Dirichlet { alpha }, k, 4, seed)
                        .expect("part")
                        .class_counts()
                })
                .collect()
        };
        let a = cut(0.1, 7);
        assert_eq!(a, cut(0.1, 7), "the same seed cuts the same parts");
        assert_ne!(a, cut(0.1, 8));
        for class in 0..10 {
            let total: u64 = a.iter().map(|p| p[class]).sum();
            assert_eq!(
                total,
                d.class_counts()[class],
                "class {class} split disjointly"
            );
        }
        // The largest class of a part, as a share of it: near 1/10 when uniform.
        let top_share = |parts: &[Vec<u64>]| -> f64 {
            let shares: Vec<f64> = parts
                .iter()
                .filter(|p| p.iter().sum::<u64>() > 0)
                .map(|p| *p.iter().max().expect("a class") as f64 / p.iter().sum::<u64>() as f64)
                .collect();
            shares.iter().sum::<f64>() / shares.len() as f64
        };
        let skewed = top_share(&a);
        let uniform = top_share(&cut(1000.0, 7));
        assert!(skewed > 0.3 && uniform < 0.15, "{skewed} vs {uniform}");
        assert!(d
            .part(Partition::Dirichlet { alpha: 0.0 }, 0, 4, 1)
            .is_err());
        assert!(d
            .part(Partition::Dirichlet { alpha: f64::NAN }, 0, 4, 1)
            .is_err());
    }

    #[test]
    fn bundled_digits_load() {
        let d = load_digits(None).expect("bundled digits");
        assert_eq!(d.len(), 1797);
        assert_eq!(d.dim, 64);
        assert!(d.features.iter().all(|v| (0.0..=1.0).contains(v)));
        assert!(d.labels.iter().all(|&l| l < 10));
    }

    #[test]
    fn non_numeric_csv_names_line_and_field() {
        let mut text = String::new();
        text.push_str(&vec!["1"; 64].join(","));
        text.push_str(",3\n");
        let mut bad = vec!["1"; 64];
        bad[5] = "x7";
        text.push_str(&bad.join(","));
        text.push_str(",2\n");
        let err = parse_digits_csv(text.as_bytes(), Path::new("d.csv")).expect_err("must fail");
        let msg = err.to_string();
        assert!(
            msg.contains("line 2") && msg.contains("field 6") && msg.contains("x7"),
            "{msg}"
        );
    }

    #[test]
    fn idx_magic_is_checked() {
        let mut bytes = vec![0, 0, 8, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1];
        bytes.push(7);
        let err = parse_idx_images(&bytes, Path::new("x")).expect_err("must fail");
        assert!(err.to_string().contains("wrong IDX magic"), "{err}");
        bytes[3] = 3;
        let (n, r, c, px) = parse_idx_images(&bytes, Path::new("x")).expect("valid");
        assert_eq!((n, r, c, px.len()), (1, 1, 1, 1));
        // A header that promises more than the file holds is refused, not trusted.
        bytes[7] = 200;
        assert!(parse_idx_images(&bytes, Path::new("x")).is_err());
    }

    #[test]
    fn split_is_seeded_and_disjoint() {
        let d = synthetic(100, 3, 4, 1).expect("synthetic");
        let a = split_seeded(&d, 0.2, 9).expect("split");
        let b = split_seeded(&d, 0.2, 9).expect("split");
        assert_eq!(a.test.len(), 20);
        assert_eq!(a.test.features, b.test.features);
        let c = split_seeded(&d, 0.2, 10).expect("split");
        assert_ne!(a.test.features, c.test.features);
    }

    #[test]
    fn standardize_uses_train_statistics() {
        let d = synthetic(200, 5, 3, 2).expect("synthetic");
        let mut split = split_seeded(&d, 0.25, 1).expect("split");
        split.standardize();
        let n = split.train.features.len() as f64;
        let mean: f64 = split
            .train
            .features
            .iter()
            .map(|&v| f64::from(v))
            .sum::<f64>()
            / n;
        let var: f64 = split
            .train
            .features
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(
            mean.abs() < 1e-4 && (var - 1.0).abs() < 1e-3,
            "mean {mean} var {var}"
        );
    }

    #[test]
    fn sampler_resumes_exactly_and_covers_each_epoch() {
        let mut s = Sampler::new(10, 5);
        let first: Vec<usize> = s.next_batch(7);
        let second = s.next_batch(7);
        let mut epoch: Vec<usize> = first.iter().chain(&second[..3]).copied().collect();
        epoch.sort_unstable();
        assert_eq!(epoch, (0..10).collect::<Vec<_>>());
        let mut resumed = Sampler::new(10, 5);
        resumed.seek(7);
        assert_eq!(resumed.next_batch(7), second);
        let mut other = Sampler::new(10, 6);
        assert_ne!(other.next_batch(10), Sampler::new(10, 5).next_batch(10));
    }
}
