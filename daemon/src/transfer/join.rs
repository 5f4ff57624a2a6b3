//! A joiner's start: wait for members of the run to connect (told by the mesh actor's
//! [`Reached`] watch, never by polling status), download the mesh's state from them
//! ([`super::download`]), check it is of this run, have the trainer load it, and offer it to
//! later joiners; a state the trainer refuses rules its donor out and the next is tried. With
//! no member within its wait (`network.join_wait_secs`), no state to be had, or none by its
//! deadline, the node trains from the run's initial weights; so does a `gossip` joiner of a
//! mesh started together whose members are all still at step 0 (`Joiner::own_initial_state`).
//! A joiner whose bootstrap peers train another run, and which no member reached, fails
//! ([`JoinError::OtherRun`]) before its first step: training alone is not what its user asked
//! for.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::PeerId;
use tokio::sync::{mpsc, oneshot, watch};

use super::{download, Cache, DownloadError, DownloadReport, Frozen, Limits};
use crate::network::Client;
use crate::store;
use crate::trainer::{self, Command, Stats};

/// After the first member connects, how long to wait for the others: more donors, less load
/// on each.
const MORE_MEMBERS_WAIT: Duration = Duration::from_millis(500);
/// Donors a joiner tries before it trains from the run's initial weights, at least: with more
/// members than this, as many as there are (each refused state rules its donor out, so a few
/// colluding liars cannot spend a joiner's tries while an honest donor waits untried).
const JOIN_ATTEMPTS: usize = 3;

/// What a joiner waits on, as the mesh actor sees it.
#[derive(Debug, Clone, Default)]
pub struct Reached {
    /// The run's connected members.
    pub members: Vec<PeerId>,
    /// Bootstrap peers found to train another run, each once, with what differs.
    pub other_runs: Vec<(PeerId, String)>,
}

impl Reached {
    /// Notes bootstrap peer `peer` refused for another run (once a peer).
    pub fn other_run(&mut self, peer: PeerId, differs: String) {
        if !self.other_runs.iter().any(|(p, _)| *p == peer) {
            self.other_runs.push((peer, differs));
        }
    }
}

/// What a joiner does next with what it has reached.
#[derive(Debug, PartialEq)]
enum Next {
    /// Keep waiting: nobody yet, or only bootstrap peers of another run while other bootstrap
    /// addresses may still bring a member within the wait.
    Wait,
    /// Download the state from these members.
    Download(Vec<PeerId>),
    /// Give up: the bootstrap peers train another run and no member came.
    OtherRun(PeerId, String),
    /// Nobody came within the wait: train from the run's initial weights.
    Alone,
}

/// The joiner's decision, pure: members win; bootstrap peers of another run end the join
/// once every bootstrap peer was such a one (`bootstrap_peers`, those named in bootstrap
/// addresses) or the wait is over (`out_of_time`), so a slow honest bootstrap member still
/// has the whole wait to answer.
fn next(reached: &Reached, bootstrap_peers: usize, out_of_time: bool) -> Next {
    if !reached.members.is_empty() {
        return Next::Download(reached.members.clone());
    }
    match reached.other_runs.first() {
        Some((peer, differs)) if out_of_time || reached.other_runs.len() >= bootstrap_peers => {
            Next::OtherRun(*peer, differs.clone())
        }
        _ if out_of_time => Next::Alone,
        _ => Next::Wait,
    }
}

/// Why a joiner gave up before its first step.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The bootstrap peer trains another run (or in another sync mode, or another release),
    /// and no member of this run connected.
    #[error("the bootstrap peer {peer} trains another run, so this node would train alone; what differs: {differs}. Join with the mesh's config and data (and its p2ptrain release), or leave out --bootstrap to start a mesh of your own")]
    OtherRun {
        /// The bootstrap peer.
        peer: PeerId,
        /// What differs, as [`crate::network::what_differs`] says it.
        differs: String,
    },
    /// The join task itself failed (a bug: it panicked), so no state will come; the node
    /// stops rather than wait for one. Its checkpoints and downloaded chunks are kept.
    #[error("joining the mesh failed inside this node ({0}); nothing was trained. Start it again: what it downloaded is kept")]
    Failed(String),
}

/// What a joiner needs of its node.
pub struct Joiner {
    /// The network.
    pub net: Client,
    /// This node's run: a state of another is refused.
    pub run_id: String,
    /// The trainer, which loads the state or starts from its own.
    pub trainer: mpsc::Sender<Command>,
    /// The trainer's progress (its first evaluation after loading goes into the report).
    pub stats: watch::Receiver<Stats>,
    /// The run's connected members, and bootstrap peers of another run, as the mesh actor
    /// sees them.
    pub reached: watch::Receiver<Reached>,
    /// Turns true when the node stops.
    pub stop: watch::Receiver<bool>,
    /// Bounds and folder of the download.
    pub limits: Limits,
    /// Frozen states this node serves: the downloaded one joins them.
    pub cache: Arc<Mutex<Cache>>,
    /// Where the finished download's report goes, for status.
    pub report: Arc<Mutex<Option<DownloadReport>>>,
    /// How long to wait for a member to connect (`network.join_wait_secs`).
    pub wait: Duration,
    /// Distinct peers named in the bootstrap addresses (`/p2p/<id>`): once each of them
    /// turned out to train another run, the joiner need not wait out `wait`.
    pub bootstrap_peers: usize,
    /// How long the downloads may take in all, over every donor tried
    /// (`network.join_deadline_secs`; `None`: no limit).
    pub deadline: Option<Duration>,
    /// Whether the run's initial weights this node builds itself (from the run's seed) are
    /// as good as a state at step 0 downloaded from a member: in a `gossip` mesh started
    /// together (its members wait for each other before their first step), no member needs
    /// another's exact bits, and the members wait for this one while it downloads (at
    /// 10 Mbit/s, 8.7 s for the small GPT's 10 MB with its optimizer's moments, all zero).
    /// A state past step 0 is downloaded as ever.
    pub own_initial_state: bool,
}

impl Joiner {
    /// Joins; see the module docs. Fails only when the bootstrap peers train another run.
    pub async fn run(mut self) -> Result<(), JoinError> {
        let Some(mut donors) = self.wait_for_members().await? else {
            return Ok(());
        };
        let until = self.deadline.map(|d| tokio::time::Instant::now() + d);
        // States this node failed to load for a reason of its own (a device out of memory):
        // another donor's would most likely fail alike, so these stop at JOIN_ATTEMPTS.
        let mut own_failures = 0;
        for _ in 0..JOIN_ATTEMPTS.max(donors.len()) {
            let downloaded = match until {
                Some(until) => tokio::time::timeout_at(until, self.download_state(&donors)).await,
                None => Ok(self.download_state(&donors).await),
            };
            let Ok(downloaded) = downloaded else {
                tracing::warn!(
                    "no state within the join deadline of {:?}; training from the run's initial weights",
                    self.deadline.unwrap_or_default()
                );
                break;
            };
            let (loaded, report, bytes) = match downloaded {
                Ok(v) => v,
                Err(JoinFailure::Donor { donor, why }) => {
                    self.rule_out(&mut donors, donor, &why, true).await;
                    continue;
                }
                Err(JoinFailure::MembersAtStart) => {
                    tracing::info!(
                        "the members are at step 0: training from the run's initial weights, as they do, without a download"
                    );
                    break;
                }
                Err(JoinFailure::Download(e)) => {
                    tracing::warn!(
                        "state download failed ({e}); training from the run's initial weights"
                    );
                    break;
                }
            };
            tracing::info!(donor = %report.donor, step = report.step, bytes = report.bytes, secs = format!("{:.2}", report.secs), sources = report.sources.len(), reused_chunks = report.reused_chunks, "state downloaded");
            let (tx, rx) = oneshot::channel();
            let restore = Command::Restore(Box::new(loaded), trainer::RestoreFrom::Members, tx);
            if self.trainer.send(restore).await.is_err() {
                return Ok(());
            }
            match rx.await {
                Ok(Ok(())) => {
                    // This node can now serve the same state to later joiners, and offers it
                    // as its own for a while (see `Cache::reusable`).
                    if let Ok(mut c) = self.cache.lock() {
                        c.insert(Arc::new(Frozen::new(report.step, bytes)));
                    }
                    let mut report = report;
                    report.first_accuracy = self.stats.borrow().training.eval.map(|e| e.accuracy);
                    if let Ok(mut d) = self.report.lock() {
                        *d = Some(report);
                    }
                    return Ok(());
                }
                Ok(Err(e)) => {
                    // Only what the state itself shows (another run or layout, non-finite
                    // values, counters no run reaches) is the donor's doing; a failure to load
                    // it here (a device out of memory) is not.
                    let donors_doing = matches!(e, trainer::TrainerError::Refused(_));
                    self.rule_out(&mut donors, report.donor, &e.to_string(), donors_doing)
                        .await;
                    if !donors_doing {
                        own_failures += 1;
                        if own_failures >= JOIN_ATTEMPTS {
                            break;
                        }
                    }
                }
                Err(_) => return Ok(()),
            }
        }
        // No state: whatever was shown of a download ends here.
        self.limits.progress.give_up();
        let _ = self.trainer.send(Command::Start).await;
        Ok(())
    }

    /// Rules `donor` out after its state was refused for `why`, and, where the refusal is
    /// `the_donors_doing`, reports it to the network as an offence (its score, and a ban that
    /// names it): an honest member never serves a state these checks refuse, since its bytes
    /// are those its own manifest hashed, of its own run, layout and step, finite and within
    /// every counter's range.
    async fn rule_out(
        &self,
        donors: &mut Vec<PeerId>,
        donor: PeerId,
        why: &str,
        the_donors_doing: bool,
    ) {
        tracing::warn!(donor = %donor, "downloaded state refused: {why}; trying another donor");
        donors.retain(|p| *p != donor);
        if the_donors_doing {
            let why = format!("served a state a joiner refused: {why}");
            let _ = self.net.report_offence(donor, why).await;
            let _ = self.net.penalise(donor).await;
        }
    }

    /// The members once at least one is connected (and the others had a moment to show up);
    /// `None` when the node stops first, or after starting the trainer on its own weights
    /// when nobody came within its wait; an error when the bootstrap peers train another run
    /// and no member came (see [`next`]).
    async fn wait_for_members(&mut self) -> Result<Option<Vec<PeerId>>, JoinError> {
        let deadline = tokio::time::Instant::now() + self.wait;
        // Whether the others had their moment after the first member or refusal.
        let mut settled = false;
        loop {
            let out_of_time = tokio::time::Instant::now() >= deadline;
            let step = next(
                &self.reached.borrow_and_update(),
                self.bootstrap_peers,
                out_of_time,
            );
            match step {
                Next::Wait => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(deadline) => {}
                        changed = self.reached.changed() => {
                            // The mesh actor is gone: the node is stopping.
                            if changed.is_err() {
                                return Ok(None);
                            }
                        }
                        _ = self.stop.wait_for(|stop| *stop) => return Ok(None),
                    }
                }
                Next::Alone => {
                    tracing::warn!("no member of run {} answered within {:?}; training from the run's initial weights", self.run_id, self.wait);
                    let _ = self.trainer.send(Command::Start).await;
                    return Ok(None);
                }
                // Another bootstrap address may still bring a member.
                Next::Download(_) | Next::OtherRun(..) if !settled => {
                    settled = true;
                    tokio::select! {
                        _ = tokio::time::sleep(MORE_MEMBERS_WAIT) => {}
                        _ = self.stop.wait_for(|stop| *stop) => return Ok(None),
                    }
                }
                Next::Download(members) => return Ok(Some(members)),
                Next::OtherRun(peer, differs) => return Err(JoinError::OtherRun { peer, differs }),
            }
        }
    }

    async fn download_state(
        &self,
        members: &[PeerId],
    ) -> Result<(store::Loaded, DownloadReport, Vec<u8>), JoinFailure> {
        let started = Instant::now();
        let downloaded = download(&self.net, members, &self.limits, self.own_initial_state).await;
        crate::timeline::record(
            crate::timeline::Lane::Transfer,
            "state_download",
            started,
            Instant::now(),
            None,
        );
        let (bytes, report) = downloaded.map_err(|e| match e {
            DownloadError::MembersAtStart => JoinFailure::MembersAtStart,
            e => JoinFailure::Download(e.to_string()),
        })?;
        let refuse = |why: String| JoinFailure::Donor {
            donor: report.donor,
            why,
        };
        let decoded = {
            let bytes = bytes.clone();
            tokio::task::spawn_blocking(move || {
                crate::checkpoint::decode(&bytes, "downloaded state")
            })
            .await
            .map_err(|e| JoinFailure::Download(e.to_string()))?
            .map_err(|e| refuse(format!("it failed verification: {e}")))?
        };
        let (meta, tensors) = decoded;
        if meta.info.run_id != self.run_id {
            return Err(refuse(format!("a state of run {}", meta.info.run_id)));
        }
        if meta.info.step != report.step {
            return Err(refuse(format!(
                "its manifest claimed step {}, the state holds {}",
                report.step, meta.info.step
            )));
        }
        Ok((store::Loaded { meta, tensors }, report, bytes))
    }
}

/// Why a download gave no state to restore.
enum JoinFailure {
    /// The donor's state is no good (it fails verification, is of another run, or is not
    /// at the step its manifest claimed): the next donor is tried.
    Donor {
        /// The donor.
        donor: PeerId,
        /// What was wrong.
        why: String,
    },
    /// No state could be downloaded at all.
    Download(String),
    /// The members are at step 0 and this node builds their state itself.
    MembersAtStart,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> PeerId {
        PeerId::random()
    }

    #[test]
    fn members_win_over_bootstrap_peers_of_another_run() {
        let member = peer();
        let mut r = Reached::default();
        r.other_run(peer(), "init seed".into());
        r.members.push(member);
        assert_eq!(next(&r, 2, false), Next::Download(vec![member]));
        assert_eq!(next(&r, 1, true), Next::Download(vec![member]));
    }

    #[test]
    fn a_joiner_gives_up_once_every_bootstrap_peer_trains_another_run_or_its_wait_is_over() {
        let (a, b) = (peer(), peer());
        let mut r = Reached::default();
        assert_eq!(next(&r, 2, false), Next::Wait);
        assert_eq!(next(&r, 2, true), Next::Alone);
        r.other_run(a, "model".into());
        r.other_run(a, "model again".into());
        assert_eq!(r.other_runs.len(), 1, "a peer is noted once");
        // One of two bootstrap peers refused: the other still has the whole wait.
        assert_eq!(next(&r, 2, false), Next::Wait);
        assert_eq!(next(&r, 2, true), Next::OtherRun(a, "model".into()));
        r.other_run(b, "seed".into());
        assert_eq!(next(&r, 2, false), Next::OtherRun(a, "model".into()));
    }
}
