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
/// [`Cache::reusable`]); one freeze at a time, which the requests waiting for it share.
async fn freeze(
    cache: &Mutex<Cache>,
    trainer: &mpsc::Sender<Command>,
    step_now: u64,
) -> Result<Arc<Frozen>, String> {
    let reusable = || cache.lock().ok().and_then(|mut c| c.reusable(step_now));
    if let Some(f) = reusable() {
        return Ok(f);
    }
    let gate = cache
        .lock()
        .map(|c| c.freezing.clone())
        .map_err(|_| "the state cache is poisoned".to_string())?;
    let _one_freeze_at_a_time = gate.lock().await;
    if let Some(f) = reusable() {
        // Frozen by the request this one waited for.
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::checkpoint::{HostTensor, Snapshot, StateInfo};

    /// Manifest requests that come together share one freeze: the trainer is asked for its
    /// state once, and every answer names the same state.
    #[tokio::test]
    async fn requests_that_come_together_share_one_freeze() {
        let cache = Arc::new(Mutex::new(Cache::default()));
        let (trainer, mut commands) = mpsc::channel(16);
        let asked = tokio::spawn(async move {
            let mut asked = 0;
            while let Some(command) = commands.recv().await {
                if let Command::Snapshot(reply) = command {
                    asked += 1;
                    // A freeze takes a while: the other requests arrive meanwhile.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let mut tensors = BTreeMap::new();
                    tensors.insert(
                        "fc0.weight".to_string(),
                        HostTensor {
                            shape: vec![2],
                            values: vec![1.0, 2.0],
                        },
                    );
                    let _ = reply.send(Snapshot {
                        info: StateInfo {
                            run_id: "r".into(),
                            config_hash: "c".into(),
                            layout_hash: "l".into(),
                            model: "mlp".into(),
                            optimizer: "sgd".into(),
                            step: 100 + asked,
                            samples_seen: 0,
                            optimizer_steps: 0,
                        },
                        tensors,
                    });
                }
            }
            asked
        });
        let answers: Vec<BulkResponse> = futures::future::join_all(
            (0..4).map(|_| manifest(cache.clone(), trainer.clone(), 100)),
        )
        .await;
        drop(trainer);
        let hashes: Vec<Vec<u8>> = answers
            .into_iter()
            .map(|a| match a {
                BulkResponse::StateManifest(m) => m.hash.to_vec(),
                other => panic!("not a manifest: {other:?}"),
            })
            .collect();
        assert!(hashes.iter().all(|h| *h == hashes[0]), "{hashes:?}");
        assert_eq!(asked.await.expect("trainer task"), 1, "one freeze");
    }
}
