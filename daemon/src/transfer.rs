//! State transfer: donors freeze their state and serve it in verified chunks; a joiner
//! downloads one frozen state from every peer that holds it, in parallel, and carries on from
//! another donor when one dies mid-transfer.
//!
//! A frozen state is a checkpoint file's bytes (so it carries its own checksum) addressed by
//! its SHA-256. A donor keeps a few recent ones; any peer that has one (a donor, or a joiner
//! that finished downloading it) can serve its chunks, so a crowd of joiners spreads over
//! several holders instead of hammering one donor.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use sha2::{Digest, Sha256};

use crate::network::{BulkRequest, BulkResponse, Client, StateManifest};

/// Bytes per chunk: small enough that a dead donor costs little, large enough to be cheap.
pub const CHUNK_SIZE: usize = 256 * 1024;
/// Chunk requests in flight per source.
pub const WINDOW_PER_SOURCE: usize = 4;
/// How long a frozen state is kept for joiners.
pub const FROZEN_TTL: Duration = Duration::from_secs(120);
/// A manifest request within this long of the last freeze reuses it, so joiners arriving
/// together download the same state and can share it.
pub const REUSE_WITHIN: Duration = Duration::from_secs(5);
/// Frozen states kept at most.
const FROZEN_CAP: usize = 3;

/// A state frozen for download.
pub struct Frozen {
    /// SHA-256 of `bytes`.
    pub hash: [u8; 32],
    /// The donor's step.
    pub step: u64,
    /// A checkpoint file's bytes.
    pub bytes: Vec<u8>,
    /// Per-chunk SHA-256.
    pub chunk_hashes: Vec<[u8; 32]>,
    /// This node's own state (false: one it downloaded and can pass on).
    pub own: bool,
    created: Instant,
}

impl Frozen {
    /// Freezes `bytes` taken at `step`; `own` says whether it is this node's own state.
    pub fn new(step: u64, bytes: Vec<u8>, own: bool) -> Frozen {
        let hash: [u8; 32] = Sha256::digest(&bytes).into();
        let chunk_hashes = bytes
            .chunks(CHUNK_SIZE)
            .map(|c| Sha256::digest(c).into())
            .collect();
        Frozen {
            hash,
            step,
            bytes,
            chunk_hashes,
            own,
            created: Instant::now(),
        }
    }

    /// The manifest describing it; `cached` lists other states the donor can serve.
    pub fn manifest(&self, load: u32, cached: Vec<[u8; 32]>) -> StateManifest {
        StateManifest {
            hash: ByteBuf::from(self.hash.to_vec()),
            step: self.step,
            total: self.bytes.len() as u64,
            chunk_size: CHUNK_SIZE as u32,
            chunk_hashes: self
                .chunk_hashes
                .iter()
                .map(|h| ByteBuf::from(h.to_vec()))
                .collect(),
            load,
            cached: cached
                .into_iter()
                .map(|h| ByteBuf::from(h.to_vec()))
                .collect(),
        }
    }

    /// Chunk `index`, if it exists.
    pub fn chunk(&self, index: u32) -> Option<&[u8]> {
        self.bytes.chunks(CHUNK_SIZE).nth(index as usize)
    }
}

/// The frozen states this node can serve, and who is downloading from it.
#[derive(Default)]
pub struct Cache {
    frozen: VecDeque<Arc<Frozen>>,
    /// Peer -> last chunk request, to report the donor's load.
    downloaders: HashMap<PeerId, Instant>,
}

impl Cache {
    /// This node's newest own frozen state if it is recent enough to hand to another joiner
    /// (joiners arriving together then share one state, and can serve it to each other). A
    /// state downloaded from elsewhere is never handed out as this node's own.
    pub fn reusable(&mut self) -> Option<Arc<Frozen>> {
        self.expire();
        self.frozen
            .iter()
            .rev()
            .find(|f| f.own && f.created.elapsed() < REUSE_WITHIN)
            .cloned()
    }

    /// Adds a frozen state.
    pub fn insert(&mut self, frozen: Arc<Frozen>) {
        self.expire();
        if self.frozen.iter().any(|f| f.hash == frozen.hash) {
            return;
        }
        if self.frozen.len() == FROZEN_CAP {
            self.frozen.pop_front();
        }
        self.frozen.push_back(frozen);
    }

    /// A frozen state by hash.
    pub fn get(&mut self, hash: &[u8]) -> Option<Arc<Frozen>> {
        self.expire();
        self.frozen.iter().find(|f| f.hash[..] == *hash).cloned()
    }

    /// Hashes of all frozen states held.
    pub fn hashes(&mut self) -> Vec<[u8; 32]> {
        self.expire();
        self.frozen.iter().map(|f| f.hash).collect()
    }

    /// Notes a chunk request from `peer`.
    pub fn note_downloader(&mut self, peer: PeerId) {
        self.downloaders.insert(peer, Instant::now());
    }

    /// Peers that requested a chunk in the last few seconds.
    pub fn load(&mut self) -> u32 {
        self.downloaders
            .retain(|_, t| t.elapsed() < Duration::from_secs(2));
        self.downloaders.len() as u32
    }

    fn expire(&mut self) {
        self.frozen.retain(|f| f.created.elapsed() < FROZEN_TTL);
    }
}

/// What a finished download reports (shown in status).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DownloadReport {
    /// The donor whose state was chosen.
    pub donor: String,
    /// Peers that served chunks.
    pub sources: Vec<String>,
    /// The state's step.
    pub step: u64,
    /// Bytes downloaded.
    pub bytes: u64,
    /// Chunks.
    pub chunks: usize,
    /// Seconds it took.
    pub secs: f64,
    /// Sources lost mid-transfer.
    pub failed_sources: usize,
    /// Times the download started over with another donor's state.
    pub restarts: usize,
    /// Held-out accuracy of the downloaded state, evaluated right after loading it.
    #[serde(default)]
    pub first_accuracy: Option<f64>,
}

/// Downloads a state from `peers`: asks each for a manifest, picks the most advanced of the
/// least loaded, fetches its chunks from every holder in parallel, verifies each chunk, and
/// falls back to the next donor if all holders of the chosen state vanish. Returns the bytes
/// (a checkpoint file, verified again by the caller) and a report.
pub async fn download(net: &Client, peers: &[PeerId]) -> Result<(Vec<u8>, DownloadReport), String> {
    let started = Instant::now();
    let mut manifests: Vec<(PeerId, StateManifest, Vec<Vec<u8>>)> = Vec::new();
    let asks = peers.iter().map(|p| {
        let net = net.clone();
        let p = *p;
        async move { (p, net.request(p, BulkRequest::StateManifest).await) }
    });
    for (peer, answer) in futures::future::join_all(asks).await {
        match answer {
            Ok(BulkResponse::StateManifest(m)) if valid_manifest(&m) => {
                manifests.push((peer, m, Vec::new()))
            }
            Ok(other) => tracing::info!(peer = %peer, "no state from this peer: {other:?}"),
            Err(e) => tracing::info!(peer = %peer, "no state from this peer: {e}"),
        }
    }
    if manifests.is_empty() {
        return Err("no peer offered its state".into());
    }
    // Most advanced first; among those within 10% of the best step, the least loaded.
    let best_step = manifests.iter().map(|m| m.1.step).max().unwrap_or(0);
    manifests.sort_by_key(|(_, m, _)| {
        (
            m.step * 10 < best_step * 9,
            m.load,
            std::cmp::Reverse(m.step),
        )
    });
    let mut restarts = 0;
    let mut failed_sources = 0;
    let order: Vec<(PeerId, StateManifest)> =
        manifests.into_iter().map(|(p, m, _)| (p, m)).collect();
    for (i, (donor, manifest)) in order.iter().enumerate() {
        // Holders of this exact state: the donor and any peer whose manifest names it.
        let mut sources: Vec<PeerId> = order
            .iter()
            .filter(|(_, m)| m.hash == manifest.hash || m.cached.contains(&manifest.hash))
            .map(|(p, _)| *p)
            .collect();
        sources.dedup();
        match fetch(net, manifest, &mut sources, &mut failed_sources).await {
            Ok((bytes, used)) => {
                let report = DownloadReport {
                    donor: donor.to_string(),
                    sources: used.iter().map(|p| p.to_string()).collect(),
                    step: manifest.step,
                    bytes: bytes.len() as u64,
                    chunks: manifest.chunk_hashes.len(),
                    secs: started.elapsed().as_secs_f64(),
                    failed_sources,
                    restarts,
                    first_accuracy: None,
                };
                return Ok((bytes, report));
            }
            Err(e) => {
                tracing::warn!(donor = %donor, "state download from this donor failed ({e}); trying the next donor");
                if i + 1 < order.len() {
                    restarts += 1;
                }
            }
        }
    }
    Err("every donor failed".into())
}

fn valid_manifest(m: &StateManifest) -> bool {
    let n = m.chunk_hashes.len() as u64;
    m.hash.len() == 32
        && m.chunk_size as usize == CHUNK_SIZE
        && m.total > 0
        && m.total <= crate::network::BULK_RESPONSE_MAX * 64
        && n == m.total.div_ceil(CHUNK_SIZE as u64)
        && m.chunk_hashes.iter().all(|h| h.len() == 32)
}

/// Fetches all chunks of `manifest` from `sources`, several at a time per source.
async fn fetch(
    net: &Client,
    manifest: &StateManifest,
    sources: &mut Vec<PeerId>,
    failed_sources: &mut usize,
) -> Result<(Vec<u8>, Vec<PeerId>), String> {
    let n = manifest.chunk_hashes.len();
    let chunks: Arc<Mutex<Vec<Option<Vec<u8>>>>> = Arc::new(Mutex::new(vec![None; n]));
    let mut todo: VecDeque<u32> = (0..n as u32).collect();
    let mut used = HashSet::new();
    let mut in_flight = futures::stream::FuturesUnordered::new();
    let mut busy: HashMap<PeerId, usize> = HashMap::new();
    loop {
        // Hand out work to every source with room in its window.
        while let Some(index) = todo.front().copied() {
            let Some(peer) = sources
                .iter()
                .copied()
                .filter(|p| busy.get(p).copied().unwrap_or(0) < WINDOW_PER_SOURCE)
                .min_by_key(|p| busy.get(p).copied().unwrap_or(0))
            else {
                break;
            };
            todo.pop_front();
            *busy.entry(peer).or_default() += 1;
            let net = net.clone();
            let hash = manifest.hash.clone();
            in_flight.push(async move {
                let r = net
                    .request(peer, BulkRequest::StateChunk { state: hash, index })
                    .await;
                (peer, index, r)
            });
        }
        if in_flight.is_empty() {
            if todo.is_empty() {
                break;
            }
            return Err("no source left for the remaining chunks".into());
        }
        let Some((peer, index, result)) = futures::StreamExt::next(&mut in_flight).await else {
            break;
        };
        if let Some(b) = busy.get_mut(&peer) {
            *b = b.saturating_sub(1);
        }
        let expected = &manifest.chunk_hashes[index as usize];
        match result {
            Ok(BulkResponse::StateChunk(bytes)) if Sha256::digest(&bytes)[..] == expected[..] => {
                used.insert(peer);
                if let Ok(mut c) = chunks.lock() {
                    c[index as usize] = Some(bytes.into_vec());
                }
            }
            other => {
                let why = match other {
                    Ok(BulkResponse::StateChunk(_)) => "chunk failed verification".to_string(),
                    Ok(r) => format!("unexpected answer {r:?}"),
                    Err(e) => e,
                };
                tracing::warn!(peer = %peer, chunk = index, "state source failed ({why}); continuing with the others");
                if sources.contains(&peer) {
                    sources.retain(|p| *p != peer);
                    *failed_sources += 1;
                }
                todo.push_back(index);
            }
        }
    }
    let chunks = std::mem::take(&mut *chunks.lock().map_err(|_| "poisoned".to_string())?);
    let mut out = Vec::with_capacity(manifest.total as usize);
    for c in chunks {
        out.extend(c.ok_or("missing chunk")?);
    }
    if Sha256::digest(&out)[..] != manifest.hash[..] || out.len() as u64 != manifest.total {
        return Err("assembled state does not match its hash".into());
    }
    Ok((out, used.into_iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_own_recent_states_are_reused() {
        let mut cache = Cache::default();
        cache.insert(Arc::new(Frozen::new(1, vec![1; 10], false)));
        assert!(
            cache.reusable().is_none(),
            "a downloaded state is not handed out as ours"
        );
        cache.insert(Arc::new(Frozen::new(2, vec![2; 10], true)));
        assert_eq!(cache.reusable().map(|f| f.step), Some(2));
        assert_eq!(cache.hashes().len(), 2);
    }

    #[test]
    fn frozen_chunks_cover_the_bytes_and_manifest_validates() {
        let bytes: Vec<u8> = (0..(CHUNK_SIZE * 2 + 10))
            .map(|i| (i % 251) as u8)
            .collect();
        let f = Frozen::new(5, bytes.clone(), true);
        let m = f.manifest(0, Vec::new());
        assert!(valid_manifest(&m));
        assert_eq!(m.chunk_hashes.len(), 3);
        let joined: Vec<u8> = (0..3)
            .flat_map(|i| f.chunk(i).expect("chunk").to_vec())
            .collect();
        assert_eq!(joined, bytes);
        assert!(f.chunk(3).is_none());
        let mut bad = m.clone();
        bad.chunk_hashes.pop();
        assert!(!valid_manifest(&bad));
    }
}
