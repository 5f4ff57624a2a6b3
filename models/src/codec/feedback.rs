//! Error feedback: the residual a lossy codec did not send, added to the next update.

use super::{encode, CodecError, Encoded, UpdateHeader};
use crate::params::Layout;

/// A sender's compressor with error feedback: what a lossy codec did not send is kept as a
/// residual and added to the next update, so compression delays information but loses none.
/// Without feedback (`enabled = false`) the dropped part is simply gone, which is what the
/// benchmark compares against.
#[derive(Debug, Clone)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    enabled: bool,
}

impl ErrorFeedback {
    /// A compressor for updates of `numel` values.
    pub fn new(numel: usize, enabled: bool) -> ErrorFeedback {
        ErrorFeedback {
            residual: vec![0.0; numel],
            enabled,
        }
    }

    /// Encodes `delta` plus the residual, and keeps what was not sent.
    pub fn compress(
        &mut self,
        header: &UpdateHeader,
        layout: &Layout,
        delta: &[f32],
        density: f64,
    ) -> Result<Encoded, CodecError> {
        if !self.enabled || !header.codec.is_lossy() {
            return encode(header, layout, delta, density);
        }
        if self.residual.len() != delta.len() {
            self.residual = vec![0.0; delta.len()];
        }
        let wanted: Vec<f32> = delta
            .iter()
            .zip(&self.residual)
            .map(|(d, r)| d + r)
            .collect();
        // The residual changes only once the message exists, so a failed encode (a value
        // that is not finite) leaves it exactly as it was.
        let encoded = encode(header, layout, &wanted, density)?;
        for ((r, w), s) in self.residual.iter_mut().zip(&wanted).zip(&encoded.sent) {
            *r = w - s;
        }
        Ok(encoded)
    }

    /// The L2 norm of what is still owed to the mesh.
    pub fn residual_norm(&self) -> f64 {
        crate::params::l2_norm(&self.residual)
    }

    /// Forgets the residual (after a restore, when the parameters it referred to are gone).
    pub fn reset(&mut self) {
        self.residual.iter_mut().for_each(|r| *r = 0.0);
    }
}
