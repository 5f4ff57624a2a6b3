//! A donor's side: freezing the trainer's state into the [`Cache`] (or reusing a very recent
//! freeze) to answer a manifest request, and answering chunk requests from the cache. The
//! mesh actor runs these in its bounded request tasks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use libp2p::PeerId;
use serde_bytes::ByteBuf;
use tokio::sync::{mpsc, oneshot};

use super::{Cache, Frozen};
use crate::checkpoint;
use crate::network::BulkResponse;
use crate::trainer::Command;

/// The answer to a manifest request: the state frozen now (or a very recent freeze, while
/// this node, at `step_now`, is within its step window), with the donor's load and the other
/// states it holds.
pub async fn manifest(
    cache: Arc<Mutex<Cache>>,
    trainer: mpsc::Sender<Command>,
    step_now: u64,
) -> BulkResponse {
    match freeze(&cache, &trainer, step_now).await {
        Ok(frozen) => {
            let (load, cached) = cache
                .lock()
                .map(|mut c| (c.load(), c.hashes()))
                .unwrap_or_default();
            let others = cached.into_iter().filter(|h| *h != frozen.hash).collect();
            BulkResponse::StateManifest(frozen.manifest(load, others))
        }
        Err(e) => BulkResponse::Refused(e),
    }
}

/// The answer to `peer`'s request for chunk `index` of state `state`, after `delay` (a debug
/// throttle); the peer counts as a downloader for the cache's load.
pub fn chunk(
    cache: &Mutex<Cache>,
    peer: PeerId,
    state: &[u8],
    index: u32,
    delay: Duration,
) -> impl std::future::Future<Output = BulkResponse> + Send + 'static {
    let frozen = cache.lock().ok().and_then(|mut c| {
        c.note_downloader(peer);
        c.get(state)
    });
    async move {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        match frozen.as_ref().and_then(|f| f.chunk(index)) {
            Some(bytes) => BulkResponse::StateChunk(ByteBuf::from(bytes.to_vec())),
            None => BulkResponse::Refused("no such state or chunk".into()),
        }
    }
}

/// Freezes the trainer's current state (or reuses a very recent freeze; see
/// [`Cache::reusable`]).
async fn freeze(
    cache: &Mutex<Cache>,
    trainer: &mpsc::Sender<Command>,
    step_now: u64,
) -> Result<Arc<Frozen>, String> {
    if let Some(f) = cache.lock().ok().and_then(|mut c| c.reusable(step_now)) {
        return Ok(f);
    }
    let (tx, rx) = oneshot::channel();
    trainer
        .send(Command::Snapshot(tx))
        .await
        .map_err(|_| "trainer stopped".to_string())?;
    let snapshot = rx.await.map_err(|_| "trainer stopped".to_string())?;
    let step = snapshot.info.step;
    let frozen = tokio::task::spawn_blocking(move || {
        checkpoint::encode(&snapshot, 0, crate::store::unix_now())
            .map(|(bytes, _)| Arc::new(Frozen::new(step, bytes)))
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())??;
    if let Ok(mut c) = cache.lock() {
        c.insert(frozen.clone());
    }
    Ok(frozen)
}
