//! State transfer: donors freeze their state and serve it in verified chunks; a joiner
//! downloads one frozen state from every peer that holds it, in parallel, and carries on from
//! another donor when one dies mid-transfer.
//!
//! A frozen state is a checkpoint file's bytes (so it carries its own checksum) addressed by
//! its SHA-256. A donor keeps a few recent ones; any peer that has one (a donor, or a joiner
//! that finished downloading it) can serve its chunks, so a crowd of joiners spreads over
//! several holders instead of hammering one donor.
//!
//! [`Joiner`] (`join.rs`) is a fresh node's whole start: waiting for members, the download,
//! and handing the state to the trainer. [`serve`] is a donor's side: it freezes the
//! trainer's state into the [`Cache`] and answers chunk requests from it, in the mesh actor's
//! request tasks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use sha2::{Digest, Sha256};

use crate::network::{BulkRequest, BulkResponse, Client, StateManifest};
use crate::wire::STATE_CHUNK_BYTES;

mod join;
pub mod serve;
pub use join::{JoinError, Joiner, Reached};

/// Chunk requests in flight per source.
pub const WINDOW_PER_SOURCE: usize = 4;
/// Chunk requests of one source whose connection closed under them (with the source still
/// connected otherwise) that are asked again before the source counts as failed: see
/// [`keeps_source`].
pub const CLOSED_UNDER_RETRIES: u32 = 4;
/// How long a frozen state is kept for joiners.
pub const FROZEN_TTL: Duration = Duration::from_secs(120);
/// A manifest request within this long of the last freeze may reuse it (if this node has not
/// trained past the freeze's [`within_step_window`] since), so joiners arriving together
/// download the same state and can share it: a joiner that finished serves the next one
/// beside the donor. Long enough for a joiner that starts a few seconds after another (on a
/// loaded box, start-up, identify and the join wait take seconds).
pub const REUSE_WITHIN: Duration = Duration::from_secs(15);

/// Whether a state at `state_step` is recent enough beside the most advanced one, at
/// `best_step`: at most 10% of its steps behind. A joiner passes over states further behind
/// than this among those offered, and a donor freezes anew rather than offer one: a freeze
/// reused for 15 s whatever the steps handed the digits model's joiners states 500 to 1500
/// steps behind their neighbours, whose full-sync replies then lay beyond the distance bound
/// (0.87 in CI, 1.08 here) and were refused.
pub fn within_step_window(state_step: u64, best_step: u64) -> bool {
    state_step.saturating_mul(10) >= best_step.saturating_mul(9)
}
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
    /// When this node's own state was last equal to it: the freeze, or the restore of a
    /// downloaded state.
    created: Instant,
}

impl Frozen {
    /// Freezes `bytes`, this node's state at `step` as of now: a snapshot of its own training,
    /// or a downloaded state it has just restored.
    pub fn new(step: u64, bytes: Vec<u8>) -> Frozen {
        let hash: [u8; 32] = Sha256::digest(&bytes).into();
        let chunk_hashes = bytes
            .chunks(STATE_CHUNK_BYTES)
            .map(|c| Sha256::digest(c).into())
            .collect();
        Frozen {
            hash,
            step,
            bytes,
            chunk_hashes,
            created: Instant::now(),
        }
    }

    /// The manifest describing it; `cached` lists other states the donor can serve.
    pub fn manifest(&self, load: u32, cached: Vec<[u8; 32]>) -> StateManifest {
        StateManifest {
            hash: ByteBuf::from(self.hash.to_vec()),
            step: self.step,
            total: self.bytes.len() as u64,
            chunk_size: STATE_CHUNK_BYTES as u32,
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
        self.bytes.chunks(STATE_CHUNK_BYTES).nth(index as usize)
    }
}

/// The frozen states this node can serve, and who is downloading from it.
#[derive(Default)]
pub struct Cache {
    frozen: VecDeque<Arc<Frozen>>,
    /// Peer -> last chunk request, to report the donor's load.
    downloaders: HashMap<PeerId, Instant>,
    /// Held while a state is being frozen: manifest requests that come together wait for
    /// the one freeze and share it, instead of each copying and encoding the whole state
    /// (a peer's burst of requests would otherwise cost a model's worth of memory each).
    freezing: Arc<tokio::sync::Mutex<()>>,
}

impl Cache {
    /// This node's newest frozen state if it is recent enough to hand to another joiner
    /// (joiners arriving together then share one state, and can serve it to each other).
    ///
    /// A joiner that has just restored a downloaded state offers that state, not a fresh
    /// freeze of the steps it trained since: a second joiner asking it and the donor together
    /// would otherwise see two states tens of steps apart, and a fast model outruns the
    /// joiner's 10% step window in a fraction of a second, so the two joiners would end on
    /// different states that cannot be served together (CI saw steps 237 and 284). Staleness
    /// stays bounded: the offer lasts [`REUSE_WITHIN`] from the restore, and only while this
    /// node, now at `step_now`, has not trained past the state's [`within_step_window`], so a
    /// fast model's joiner gets a fresh state even seconds after another.
    pub fn reusable(&mut self, step_now: u64) -> Option<Arc<Frozen>> {
        self.expire();
        self.frozen
            .iter()
            .rev()
            .find(|f| f.created.elapsed() < REUSE_WITHIN && within_step_window(f.step, step_now))
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
    pub donor: PeerId,
    /// Peers that served chunks.
    pub sources: Vec<PeerId>,
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
    /// Held-out accuracy of the downloaded state, evaluated right after loading it (`None`
    /// for a `ddp` joiner or a state at step 0, not evaluated: see `trainer::RestoreFrom`).
    #[serde(default)]
    pub first_accuracy: Option<f64>,
    /// Chunks found verified on disk from an earlier, interrupted download of the same state
    /// (the joiner was killed or restarted), so not fetched again.
    #[serde(default)]
    pub reused_chunks: usize,
    /// Donors whose manifest was refused (larger than this layout's largest checkpoint, or
    /// malformed).
    #[serde(default)]
    pub refused_manifests: usize,
}

/// What a download may hold and where it keeps its chunks.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The largest state accepted: the largest checkpoint this run's layout can produce. A
    /// manifest claiming more is refused before anything is fetched.
    pub max_total: u64,
    /// Where verified chunks are kept (one folder per state), so a joiner killed mid-download
    /// fetches only what it lacks when it starts again.
    pub dir: PathBuf,
    /// Where the download reports how far it has come.
    pub progress: Arc<DownloadProgress>,
}

/// How far the state download under way has come, in bytes of the chosen state: read by
/// status, `/metrics` and the CLI's progress bar while the download runs. Chunks reused from
/// an interrupted download count as done.
#[derive(Debug, Default)]
pub struct DownloadProgress {
    done: AtomicU64,
    total: AtomicU64,
    /// The joiner gave up downloading and trains from the run's initial weights.
    given_up: std::sync::atomic::AtomicBool,
}

impl DownloadProgress {
    /// `(bytes done, bytes in all)`; `(0, 0)` before a state was chosen.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }

    /// Whether the joiner gave up downloading (a bar showing the download ends there).
    pub fn given_up(&self) -> bool {
        self.given_up.load(Ordering::Relaxed)
    }

    /// The joiner gave up downloading.
    fn give_up(&self) {
        self.given_up.store(true, Ordering::Relaxed);
    }

    /// A new state of `total` bytes was chosen, `done` of them already at hand.
    fn start(&self, done: u64, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        self.done.store(done, Ordering::Relaxed);
    }

    fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl Limits {
    /// Limits for a model of `params` scalars: its largest state
    /// ([`crate::wire::largest_state_bytes`]).
    pub fn for_params(params: usize, dir: PathBuf) -> Limits {
        Limits {
            max_total: crate::wire::largest_state_bytes(params),
            dir,
            progress: Arc::default(),
        }
    }
}

/// Downloads a state from `peers`: asks each for a manifest, picks the most advanced of the
/// least loaded, fetches its chunks from every holder in parallel, verifies each chunk, keeps
/// it on disk under `limits.dir`, and falls back to the next donor if all holders of the
/// chosen state vanish. A state an earlier run of this node left half-downloaded is resumed
/// first if some peer still serves it. Returns the bytes (a checkpoint file, verified again by
/// the caller) and a report. With `own_initial_state` (see `Joiner::own_initial_state`),
/// members whose manifests all say step 0 are not downloaded from:
/// [`DownloadError::MembersAtStart`].
pub async fn download(
    net: &Client,
    peers: &[PeerId],
    limits: &Limits,
    own_initial_state: bool,
) -> Result<(Vec<u8>, DownloadReport), DownloadError> {
    let started = Instant::now();
    let mut manifests: Vec<(PeerId, StateManifest)> = Vec::new();
    let mut refused_manifests = 0;
    let asks = peers.iter().map(|p| {
        let net = net.clone();
        let p = *p;
        async move { (p, net.request(p, BulkRequest::StateManifest).await) }
    });
    for (peer, answer) in futures::future::join_all(asks).await {
        match answer {
            Ok(BulkResponse::StateManifest(m)) => match check_manifest(&m, limits.max_total) {
                Ok(()) => manifests.push((peer, m)),
                Err(why) => {
                    refused_manifests += 1;
                    tracing::warn!(peer = %peer, "state manifest refused: {why}");
                }
            },
            Ok(other) => tracing::info!(peer = %peer, "no state from this peer: {other:?}"),
            Err(e) => tracing::info!(peer = %peer, "no state from this peer: {e}"),
        }
    }
    if manifests.is_empty() {
        return Err(DownloadError::NoValidState);
    }
    if own_initial_state && manifests.iter().all(|(_, m)| m.step == 0) {
        return Err(DownloadError::MembersAtStart);
    }
    let manifests = donor_order(manifests);
    let mut order = manifests.clone();
    // A state left half-downloaded goes first while some peer still serves it; otherwise its
    // chunks are of no use any more.
    if let Some((hash, manifest)) = partial_download(&limits.dir, limits.max_total) {
        let offered = manifests
            .iter()
            .find(|(_, m)| m.hash[..] == hash[..] || m.cached.iter().any(|c| c[..] == hash[..]));
        match offered {
            Some((donor, _)) => {
                tracing::info!(donor = %donor, "resuming an interrupted state download");
                order.insert(0, (*donor, manifest));
            }
            None => {
                tracing::info!("an interrupted state download is no longer served; starting over");
                let _ = std::fs::remove_dir_all(limits.dir.join(hex::encode(hash)));
            }
        }
    }
    let mut restarts = 0;
    let mut failed_sources = 0;
    for (i, (donor, manifest)) in order.iter().enumerate() {
        // Holders of this exact state: the donor and any peer whose manifest names it.
        let mut sources: Vec<PeerId> = manifests
            .iter()
            .filter(|(_, m)| m.hash == manifest.hash || m.cached.contains(&manifest.hash))
            .map(|(p, _)| *p)
            .collect();
        sources.dedup();
        match fetch(
            net,
            manifest,
            &mut sources,
            &mut failed_sources,
            &limits.dir,
            &limits.progress,
        )
        .await
        {
            Ok((bytes, used, reused_chunks)) => {
                let report = DownloadReport {
                    donor: *donor,
                    sources: used,
                    step: manifest.step,
                    bytes: bytes.len() as u64,
                    chunks: manifest.chunk_hashes.len(),
                    secs: started.elapsed().as_secs_f64(),
                    failed_sources,
                    restarts,
                    first_accuracy: None,
                    reused_chunks,
                    refused_manifests,
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
    Err(DownloadError::EveryDonorFailed)
}

/// Why a joiner got no state at all (each donor's own failure is logged as it happens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DownloadError {
    /// No peer answered with a manifest this node would accept.
    #[error("no peer offered a valid state")]
    NoValidState,
    /// Every donor tried failed or vanished mid-transfer.
    #[error("every donor failed")]
    EveryDonorFailed,
    /// Every member offered its state at step 0, the run's initial weights, which this node
    /// builds itself (see `Joiner::own_initial_state`).
    #[error("the members are at step 0")]
    MembersAtStart,
}

/// Why a manifest cannot describe a state of this run, if it cannot.
fn check_manifest(m: &StateManifest, max_total: u64) -> Result<(), String> {
    let n = m.chunk_hashes.len() as u64;
    if m.hash.len() != 32 || m.chunk_hashes.iter().any(|h| h.len() != 32) {
        return Err("hashes are not SHA-256".into());
    }
    if m.chunk_size as usize != STATE_CHUNK_BYTES {
        return Err(format!(
            "chunk size {} (this node uses {STATE_CHUNK_BYTES})",
            m.chunk_size
        ));
    }
    if m.total == 0 || m.total > max_total {
        return Err(format!(
            "it claims {} bytes; the largest checkpoint this run's layout can produce is {max_total}",
            m.total
        ));
    }
    if n != m.total.div_ceil(STATE_CHUNK_BYTES as u64) {
        return Err(format!("{n} chunk hashes for {} bytes", m.total));
    }
    Ok(())
}

/// The length chunk `index` of `manifest` must have.
fn chunk_len(manifest: &StateManifest, index: usize) -> usize {
    let size = manifest.chunk_size as u64;
    let start = index as u64 * size;
    manifest.total.saturating_sub(start).min(size) as usize
}

fn chunk_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("{index}.chunk"))
}

const MANIFEST_FILE: &str = "manifest.json";

/// The state a previous run of this node left half-downloaded under `dir`, if any (with its
/// manifest, checked again). Others found there are removed: one partial state is kept.
fn partial_download(dir: &Path, max_total: u64) -> Option<([u8; 32], StateManifest)> {
    let mut found = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let usable = std::fs::read(path.join(MANIFEST_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<StateManifest>(&b).ok())
            .filter(|m| check_manifest(m, max_total).is_ok())
            .filter(|m| path.file_name() == Some(std::ffi::OsStr::new(&hex::encode(&m.hash))));
        match usable {
            Some(m) if found.is_none() => {
                let mut hash = [0u8; 32];
                hash.copy_from_slice(&m.hash);
                found = Some((hash, m));
            }
            _ => {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }
    found
}

/// Whether a source whose chunk request failed with `error` stays a source, `closed_so_far`
/// of its requests having failed so before: a request whose connection closed under it is
/// asked again, up to [`CLOSED_UNDER_RETRIES`] times a source, since a peer holds several
/// connections and closes some on purpose (an AutoNAT dial-back is closed once spent:
/// libp2p sends each request on any of a peer's connections, and a chunk on its way out
/// when its connection closes is lost); were the peer gone, the request asked again fails
/// as not connected. Any other failure ends the source.
fn keeps_source(error: &crate::network::NetError, closed_so_far: u32) -> bool {
    matches!(
        error,
        crate::network::NetError::Request {
            error: libp2p::request_response::OutboundFailure::ConnectionClosed,
            ..
        }
    ) && closed_so_far < CLOSED_UNDER_RETRIES
}

/// Fetches all chunks of `manifest` from `sources`, several at a time per source, keeping
/// each verified chunk on disk under `root/<state hash>` and none in memory; chunks already
/// there from an interrupted download are verified and reused. Returns the assembled state
/// (memory held: the state's size, once, at the end), the sources used and the chunks reused.
async fn fetch(
    net: &Client,
    manifest: &StateManifest,
    sources: &mut Vec<PeerId>,
    failed_sources: &mut usize,
    root: &Path,
    progress: &DownloadProgress,
) -> Result<(Vec<u8>, Vec<PeerId>, usize), String> {
    let n = manifest.chunk_hashes.len();
    let dir = root.join(hex::encode(&manifest.hash));
    // Another state's chunks are of no use once this one is chosen.
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            if e.path() != dir {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| format!("cannot keep chunks in {}: {e}", dir.display()))?;
    let manifest_json = serde_json::to_vec(manifest).map_err(|e| e.to_string())?;
    write_atomic(&dir.join(MANIFEST_FILE), &manifest_json).await?;
    let mut done = vec![false; n];
    let mut reused = 0;
    for (i, slot) in done.iter_mut().enumerate() {
        if let Ok(bytes) = tokio::fs::read(chunk_path(&dir, i)).await {
            if bytes.len() == chunk_len(manifest, i)
                && Sha256::digest(&bytes)[..] == manifest.chunk_hashes[i][..]
            {
                *slot = true;
                reused += 1;
            }
        }
    }
    let at_hand = (0..n)
        .filter(|&i| done[i])
        .map(|i| chunk_len(manifest, i) as u64)
        .sum();
    progress.start(at_hand, manifest.total);
    let mut todo: VecDeque<u32> = (0..n as u32).filter(|i| !done[*i as usize]).collect();
    let mut used = HashSet::new();
    let mut in_flight = futures::stream::FuturesUnordered::new();
    let mut busy: HashMap<PeerId, usize> = HashMap::new();
    // Per source, its requests lost to a connection closed under them (see `keeps_source`).
    let mut closed_under: HashMap<PeerId, u32> = HashMap::new();
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
        let i = index as usize;
        if let Err(e) = &result {
            let closed = closed_under.entry(peer).or_insert(0);
            if keeps_source(e, *closed) {
                *closed += 1;
                tracing::info!(peer = %peer, chunk = index, "chunk request lost ({e}); asking again");
                todo.push_front(index);
                continue;
            }
        }
        let why = match result {
            Ok(BulkResponse::StateChunk(bytes)) if bytes.len() != chunk_len(manifest, i) => {
                format!(
                    "chunk of {} bytes, {} expected",
                    bytes.len(),
                    chunk_len(manifest, i)
                )
            }
            Ok(BulkResponse::StateChunk(bytes))
                if Sha256::digest(&bytes)[..] == manifest.chunk_hashes[i][..] =>
            {
                write_atomic(&chunk_path(&dir, i), &bytes).await?;
                used.insert(peer);
                done[i] = true;
                progress.add(bytes.len() as u64);
                continue;
            }
            Ok(BulkResponse::StateChunk(_)) => "chunk failed verification".to_string(),
            Ok(r) => format!("unexpected answer {r:?}"),
            Err(e) => e.to_string(),
        };
        tracing::warn!(peer = %peer, chunk = index, "state source failed ({why}); continuing with the others");
        if sources.contains(&peer) {
            sources.retain(|p| *p != peer);
            *failed_sources += 1;
        }
        todo.push_back(index);
    }
    let mut out = Vec::with_capacity(manifest.total as usize);
    for i in 0..n {
        let bytes = tokio::fs::read(chunk_path(&dir, i))
            .await
            .map_err(|e| format!("chunk {i} vanished from {}: {e}", dir.display()))?;
        out.extend_from_slice(&bytes);
    }
    if Sha256::digest(&out)[..] != manifest.hash[..] || out.len() as u64 != manifest.total {
        let _ = tokio::fs::remove_dir_all(&dir).await;
        return Err("assembled state does not match its hash".into());
    }
    let _ = tokio::fs::remove_dir_all(&dir).await;
    Ok((out, used.into_iter().collect(), reused))
}

/// Writes `bytes` to `path` atomically ([`crate::atomic_file`], off the async workers), so a
/// crash leaves either the whole chunk or none; not flushed to disk (each chunk's hash is
/// checked when it is read back).
async fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let (target, bytes) = (path.to_path_buf(), bytes.to_vec());
    tokio::task::spawn_blocking(move || {
        crate::atomic_file::write(
            &target,
            &bytes,
            None,
            crate::atomic_file::Durability::Cached,
        )
    })
    .await
    .map_err(|e| format!("cannot write {}: {e}", path.display()))?
    .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Steps a claim may lie above the median claim besides its 10%: honest members of a young
/// mesh differ by a few hundred steps.
const CLAIM_SLACK: u64 = 1000;

/// The lower median of `steps` (of an even count, the lower of the two middle ones); `None`
/// of none.
fn lower_median(steps: impl Iterator<Item = u64>) -> Option<u64> {
    let mut steps: Vec<u64> = steps.collect();
    steps.sort_unstable();
    steps.get(steps.len().saturating_sub(1) / 2).copied()
}

/// The donors in the order a joiner tries them. The mesh's progress first, as the median claim
/// measures it: a step more than 10% (plus [`CLAIM_SLACK`]) above the median of the claims is
/// no credible progress (a liar claiming the highest step would otherwise always go first), so
/// such a state goes last. A credible claim another donor corroborates (its own step within
/// 10% of it, or the same state) goes before one nobody does, when any is corroborated: a
/// liar claiming just under the ceiling, above every honest member, would otherwise still be
/// tried first, and honest members of one mesh train within a few percent of one another.
/// Among the states left, those within 10% of the (lower) median of their claims, those at
/// or below it before those above it, then the one most peers hold (its chunks come from all
/// of them at once, and no single donor carries the crowd), then the least loaded, then the
/// one nearest that median: never the highest first, since a liar can always claim a step
/// more than the most advanced honest member (and take the joiner's schedule and data
/// position ahead of the mesh), and say it is idle or list others as holding its state,
/// while the median claim is an honest member's as long as most of those asked are honest,
/// and honest members train within a few hundred steps of one another. This assumes that
/// most of the members a joiner asks are honest.
fn donor_order(manifests: Vec<(PeerId, StateManifest)>) -> Vec<(PeerId, StateManifest)> {
    let median = lower_median(manifests.iter().map(|m| m.1.step)).unwrap_or(0);
    let ceiling = median
        .saturating_add(median / 10)
        .saturating_add(CLAIM_SLACK);
    let credible = |step: u64| step <= ceiling;
    let holds =
        |o: &StateManifest, m: &StateManifest| o.hash == m.hash || o.cached.contains(&m.hash);
    let corroborated = |peer: &PeerId, m: &StateManifest| {
        manifests.iter().any(|(p, o)| {
            p != peer && (holds(o, m) || within_step_window(o.step.min(m.step), o.step.max(m.step)))
        })
    };
    let any_corroborated = manifests
        .iter()
        .any(|(p, m)| credible(m.step) && corroborated(p, m));
    let first_rank = |p: &PeerId, m: &StateManifest| {
        credible(m.step) && (!any_corroborated || corroborated(p, m))
    };
    // The lower median: of two claims, the lower, so a liar one step above a lone honest
    // donor is not the reference; of four, two colluders above two honest members are not.
    let reference = lower_median(
        manifests
            .iter()
            .filter(|(p, m)| first_rank(p, m))
            .map(|(_, m)| m.step),
    )
    .unwrap_or(median);
    let near_reference = |step: u64| within_step_window(step.min(reference), step.max(reference));
    let holders = |m: &StateManifest| manifests.iter().filter(|(_, o)| holds(o, m)).count();
    let mut keyed: Vec<_> = manifests
        .iter()
        .map(|(p, m)| {
            let key = (
                !credible(m.step),
                !first_rank(p, m),
                !near_reference(m.step),
                // Above the reference before anything a donor says of itself (its load, the
                // states it lists as cached), which a liar would set in its own favour.
                m.step > reference,
                std::cmp::Reverse(holders(m)),
                m.load,
                m.step.abs_diff(reference),
            );
            (key, (*p, m.clone()))
        })
        .collect();
    keyed.sort_by_key(|k| k.0);
    keyed.into_iter().map(|(_, v)| v).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_recent_state_is_reused_and_an_old_one_is_not() {
        let mut cache = Cache::default();
        assert!(cache.reusable(0).is_none(), "nothing frozen yet");
        cache.insert(Arc::new(Frozen::new(100, vec![1; 10])));
        cache.insert(Arc::new(Frozen::new(200, vec![2; 10])));
        assert_eq!(cache.reusable(200).map(|f| f.step), Some(200));
        assert_eq!(cache.reusable(222).map(|f| f.step), Some(200), "10% on");
        assert!(cache.reusable(223).is_none(), "trained past the window");
        assert_eq!(cache.hashes().len(), 2);
        let mut old = Frozen::new(3, vec![3; 10]);
        old.created = Instant::now()
            .checked_sub(REUSE_WITHIN + Duration::from_secs(1))
            .expect("a monotonic clock this far along");
        let mut stale = Cache::default();
        stale.insert(Arc::new(old));
        assert!(stale.reusable(3).is_none(), "a freeze past REUSE_WITHIN");
        assert_eq!(stale.hashes().len(), 1, "still served by hash");
    }

    /// A chunk whose connection closed under it is asked again from the same source, a few
    /// times; a source not connected, timing out or refusing the protocol is dropped at once.
    /// (A joiner's 10 MB download at 10 Mbit/s failed at 9.5 MB when its donor closed a
    /// spent AutoNAT dial-back the request went on, and the joiner trained from the run's
    /// initial weights.)
    #[test]
    fn a_chunk_whose_connection_closed_under_it_is_asked_again() {
        use crate::network::NetError;
        use libp2p::request_response::OutboundFailure;
        let peer = PeerId::random();
        let closed = NetError::Request {
            peer,
            error: OutboundFailure::ConnectionClosed,
        };
        for so_far in 0..CLOSED_UNDER_RETRIES {
            assert!(keeps_source(&closed, so_far), "after {so_far}");
        }
        assert!(!keeps_source(&closed, CLOSED_UNDER_RETRIES));
        for other in [
            NetError::NotConnected(peer),
            NetError::Request {
                peer,
                error: OutboundFailure::Timeout,
            },
            NetError::Request {
                peer,
                error: OutboundFailure::UnsupportedProtocols,
            },
            NetError::Stopped,
        ] {
            assert!(!keeps_source(&other, 0), "{other}");
        }
    }

    /// A liar claiming the highest step goes last while most claims are honest; an honest
    /// mesh's states go from the lower median claim's.
    #[test]
    fn a_claim_far_above_the_median_goes_last() {
        let state = |step: u64, tag: u8| Frozen::new(step, vec![tag; 10]).manifest(0, Vec::new());
        let (liar, a, b) = (PeerId::random(), PeerId::random(), PeerId::random());
        for claim in [u64::MAX, 1 << 40, 20_000] {
            let order = donor_order(vec![
                (liar, state(claim, 1)),
                (a, state(10_000, 2)),
                (b, state(10_200, 3)),
            ]);
            let peers: Vec<PeerId> = order.iter().map(|(p, _)| *p).collect();
            // Of the two honest claims, the lower median's first (see `donor_order`).
            assert_eq!(peers, [a, b, liar], "a claim of {claim}");
        }
        // Within the 10% and the slack, of two the lower claim goes first: one of them may be
        // a liar a step above the other.
        let order = donor_order(vec![(a, state(10_000, 2)), (b, state(11_500, 3))]);
        assert_eq!(order[0].0, a);
        assert!(donor_order(Vec::new()).is_empty());
    }

    /// A liar claiming exactly the ceiling (the median claim, 10% and the slack above it),
    /// above every honest member, goes after the honest states, which corroborate one
    /// another; an honest straggler far behind the others still goes after them.
    #[test]
    fn a_claim_no_other_donor_corroborates_goes_after_those_that_are() {
        let state = |step: u64, tag: u8| Frozen::new(step, vec![tag; 10]).manifest(0, Vec::new());
        let (liar, a, b, c) = (
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
        );
        let ceiling = 10_200 + 1_020 + CLAIM_SLACK;
        let order = donor_order(vec![
            (liar, state(ceiling, 1)),
            (a, state(10_000, 2)),
            (b, state(10_200, 3)),
        ]);
        let peers: Vec<PeerId> = order.iter().map(|(p, _)| *p).collect();
        assert_eq!(peers, [a, b, liar]);
        // Four donors, one an honest straggler: the two that agree, then the rest.
        let order = donor_order(vec![
            (liar, state(ceiling, 1)),
            (a, state(10_000, 2)),
            (b, state(10_200, 3)),
            (c, state(2_000, 4)),
        ]);
        let peers: Vec<PeerId> = order.iter().map(|(p, _)| *p).collect();
        assert_eq!(&peers[..2], [a, b]);
    }

    /// A liar's claim a step above the most advanced honest member, or 10% above it, still
    /// credible and corroborated, does not go first, nor when it says it is idle, nor two
    /// colluders sharing one state: the state nearest the median claim does
    /// (before, the highest credible claim went first, so a liar took the joiner's schedule
    /// and data position up to 10% ahead of the mesh, and the joiner offered that lie to the
    /// next joiner as a corroborated state). Of honest claims, the median's is as fresh as
    /// the mesh: its members train within a few hundred steps of one another.
    #[test]
    fn a_claim_just_above_the_honest_members_does_not_go_first() {
        let state = |step: u64, tag: u8| Frozen::new(step, vec![tag; 10]).manifest(0, Vec::new());
        let (liar, a, b) = (PeerId::random(), PeerId::random(), PeerId::random());
        for claim in [10_201, 11_219] {
            let order = donor_order(vec![
                (liar, state(claim, 1)),
                (a, state(10_000, 2)),
                (b, state(10_200, 3)),
            ]);
            assert_eq!(order[0].0, b, "a liar claiming step {claim}");
            // Saying it is idle while the honest donors serve others does not help it.
            let busy =
                |step: u64, tag: u8| Frozen::new(step, vec![tag; 10]).manifest(1, Vec::new());
            let order = donor_order(vec![
                (liar, state(claim, 1)),
                (a, busy(10_000, 2)),
                (b, busy(10_200, 3)),
            ]);
            assert_eq!(order[2].0, liar, "an idle liar claiming step {claim}");
        }
        // Two colluders holding one state a step above two honest members: not first either.
        let liar2 = PeerId::random();
        let shared = Frozen::new(10_201, vec![9; 10]).manifest(0, Vec::new());
        let order = donor_order(vec![
            (liar, shared.clone()),
            (liar2, shared),
            (a, state(10_000, 2)),
            (b, state(10_200, 3)),
        ]);
        let peers: Vec<PeerId> = order.iter().map(|(p, _)| *p).collect();
        assert_eq!(&peers[..2], [b, a]);
    }

    #[test]
    fn frozen_chunks_cover_the_bytes_and_manifest_validates() {
        let bytes: Vec<u8> = (0..(STATE_CHUNK_BYTES * 2 + 10))
            .map(|i| (i % 251) as u8)
            .collect();
        let f = Frozen::new(5, bytes.clone());
        let m = f.manifest(0, Vec::new());
        assert_eq!(check_manifest(&m, 1 << 30), Ok(()));
        assert_eq!(m.chunk_hashes.len(), 3);
        assert_eq!(chunk_len(&m, 0), STATE_CHUNK_BYTES);
        assert_eq!(chunk_len(&m, 2), 10);
        assert_eq!(chunk_len(&m, 3), 0);
        let joined: Vec<u8> = (0..3)
            .flat_map(|i| f.chunk(i).expect("chunk").to_vec())
            .collect();
        assert_eq!(joined, bytes);
        assert!(f.chunk(3).is_none());
        let mut bad = m.clone();
        bad.chunk_hashes.pop();
        assert!(check_manifest(&bad, 1 << 30).is_err());
        // More than this layout's largest checkpoint: refused before any fetch.
        assert!(check_manifest(&m, m.total - 1).is_err_and(|e| e.contains("largest checkpoint")));
        assert_eq!(
            Limits::for_params(1000, PathBuf::new()).max_total,
            12_000 + 1024 * 1024
        );
        let mut huge = m.clone();
        huge.total = u64::MAX;
        assert!(
            check_manifest(&huge, u64::MAX).is_err(),
            "chunk count must match"
        );
    }

    #[test]
    fn a_partial_download_is_found_once_and_strays_are_removed() {
        let root = tempfile::tempdir().expect("tmp");
        let f = Frozen::new(5, vec![7u8; STATE_CHUNK_BYTES + 3]);
        let m = f.manifest(0, Vec::new());
        let dir = root.path().join(hex::encode(&m.hash));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(
            dir.join(MANIFEST_FILE),
            serde_json::to_vec(&m).expect("json"),
        )
        .expect("write");
        // A folder whose manifest names another state, and one with no manifest: removed.
        let stray = root.path().join("00ff");
        std::fs::create_dir_all(&stray).expect("dir");
        std::fs::write(
            stray.join(MANIFEST_FILE),
            serde_json::to_vec(&m).expect("json"),
        )
        .expect("write");
        std::fs::create_dir_all(root.path().join("junk")).expect("dir");
        let (hash, found) = partial_download(root.path(), 1 << 30).expect("partial found");
        assert_eq!(hash, f.hash);
        assert_eq!(found, m);
        assert!(!stray.exists() && !root.path().join("junk").exists());
        // Past this layout's bound it is not resumed either.
        assert!(partial_download(root.path(), 100).is_none());
        assert!(!dir.exists());
    }
}
