//! The hops a node receives: which attempt a hop belongs to (a later one is joined, one not
//! reached yet waits in the inbox, a stale one is dropped), and taking the expected hops in
//! order, adding or copying each chunk and sending the next. Part of [`super::Rounds`].

use std::time::Instant;

use libp2p::PeerId;

use super::ring::{all_finite, decode_values, hop_message};
use super::{
    Hop, HopKey, Output, Rounds, Stage, ATTEMPT_LIMIT, INBOX_CAP, INBOX_VALUES, ROUND_LIMIT,
    STEP_LIMIT,
};
use crate::wire::RingMessage;

/// Reports a hop no honest member sends: named for a ban's reason (status shows each peer's
/// count and last offence; the ban is logged with it), and penalised (the peer's score falls;
/// enough such hops in a short time ban it). Hops travel as bulk requests, which gossipsub's
/// own rejection count never sees. Logged at debug level: a peer sending them as fast as it
/// can would otherwise fill the log before its ban.
fn offence(out: &mut Vec<Output>, from: PeerId, why: String) {
    tracing::debug!(peer = %from, "refused a ring hop: {why}");
    out.push(Output::Offence { peer: from, why });
    out.push(Output::Penalise(from));
}

impl Rounds {
    /// A hop from `from`. Hops of a later attempt make this node join it; hops of attempts
    /// it has not reached wait in the inbox; stale ones are dropped. A hop that cannot be
    /// honest is an offence: one of odd size, with values that are not finite, or naming a
    /// round, attempt or step past any mesh's changes nothing.
    pub fn message(&mut self, from: PeerId, msg: RingMessage, now: Instant, out: &mut Vec<Output>) {
        let Some(values) = decode_values(&msg.values, msg.bf16) else {
            offence(out, from, "ring hop of odd length".into());
            return;
        };
        if !all_finite(&values) {
            offence(out, from, "ring hop with NaN or infinite values".into());
            return;
        }
        if msg.round >= ROUND_LIMIT || msg.attempt >= ATTEMPT_LIMIT || msg.step >= STEP_LIMIT {
            offence(
                out,
                from,
                format!(
                    "ring hop of round {} attempt {} at step {}, past what any mesh reaches",
                    msg.round, msg.attempt, msg.step
                ),
            );
            return;
        }
        // A hop is proof that its sender takes part in rounds now.
        self.ready.insert(from, now);
        let key = (msg.round, msg.attempt, msg.hop);
        let reducing = matches!(self.stage, Stage::Reducing { .. });
        match self.round {
            // A round this node has not reached. Right after a round, a faster member may
            // already be in the next one while this node waits for its last hop: that hop
            // waits. A member can only have finished an attempt this node took part in once
            // this node had hops of it, so an attempt without any is not finishing. Otherwise
            // the mesh went on without this node (it joined, was cut off, or aborted an
            // attempt the others completed): `start` takes the mesh's round (with weight 0
            // only where most members say they are past this one, see `adopt_newer_round`).
            Some(r) if msg.round > r => {
                let finishing = msg.round == r.saturating_add(1)
                    && matches!(&self.stage, Stage::Reducing { ring: Some(ring), .. } if ring.next_hop > 0);
                self.keep(key, (from, msg.members, values, msg.step));
                if reducing && !finishing {
                    self.restart(now, out);
                } else if let Stage::Reducing {
                    ring: Some(ring), ..
                } = &mut self.stage
                {
                    if ring.predecessor() == from {
                        ring.predecessor_went_on.get_or_insert(now);
                    }
                }
                return;
            }
            None => {
                self.keep(key, (from, msg.members, values, msg.step));
                if reducing {
                    self.restart(now, out);
                }
                return;
            }
            Some(r) if msg.round < r => return,
            Some(_) if msg.attempt < self.attempt => return,
            Some(_) if msg.attempt > self.attempt => {
                self.attempt = msg.attempt;
                self.keep(key, (from, msg.members, values, msg.step));
                if reducing {
                    self.restart(now, out);
                }
                return;
            }
            Some(_) => {}
        }
        self.keep(key, (from, msg.members, values, msg.step));
        self.drain(now, out);
    }

    /// Drops the attempt under way (if any) and starts again at once, with what the inbox
    /// says of the mesh's round and attempt.
    pub(super) fn restart(&mut self, now: Instant, out: &mut Vec<Output>) {
        if let Stage::Reducing { ring, .. } = &mut self.stage {
            *ring = None;
        }
        self.start(now, out);
    }

    /// Keeps a hop in the inbox, within [`INBOX_CAP`] hops and [`INBOX_VALUES`] values: when
    /// full, the hops of the oldest rounds and attempts give way, as they always did (a node
    /// left behind needs the mesh's newest round to take it); one larger than the whole bound
    /// is not kept.
    pub(super) fn keep(&mut self, key: HopKey, hop: Hop) {
        if hop.2.len() > INBOX_VALUES {
            return;
        }
        self.inbox.remove(&key);
        let mut held: usize = self.inbox.values().map(|h| h.2.len()).sum();
        while self.inbox.len() >= INBOX_CAP || held + hop.2.len() > INBOX_VALUES {
            match self.inbox.pop_first() {
                Some((_, old)) => held -= old.2.len(),
                None => break,
            }
        }
        self.inbox.insert(key, hop);
    }

    /// Takes the hops the running attempt expects, in order, from the inbox.
    pub(super) fn drain(&mut self, now: Instant, out: &mut Vec<Output>) {
        loop {
            let Some(round) = self.round else {
                return;
            };
            let attempt = self.attempt;
            let Stage::Reducing {
                ring: Some(ring), ..
            } = &mut self.stage
            else {
                return;
            };
            // Hops of older attempts of this round, or of older rounds, are no use any more.
            let stale: Vec<_> = self
                .inbox
                .keys()
                .filter(|(r, a, _)| *r < round || (*r == round && *a < attempt))
                .copied()
                .collect();
            for k in stale {
                self.inbox.remove(&k);
            }
            let key = (round, attempt, ring.next_hop);
            let Some((from, digest, values, step)) = self.inbox.remove(&key) else {
                // A hop of this attempt with another member list means the lists differ.
                let differs = self
                    .inbox
                    .range((round, attempt, 0)..=(round, attempt, u32::MAX))
                    .any(|(_, (_, d, _, _))| *d != ring.digest);
                if differs {
                    self.abort("member lists differ", now);
                }
                return;
            };
            if digest != ring.digest {
                self.abort("member lists differ", now);
                return;
            }
            if from != ring.predecessor() {
                // The same list puts the sender elsewhere: cannot be honest.
                offence(out, from, "ring hop out of turn".into());
                self.abort("hop out of turn", now);
                return;
            }
            let hop = ring.next_hop;
            let range = ring.received_range(hop);
            if values.len() != range.len() {
                offence(
                    out,
                    from,
                    format!(
                        "ring hop of {} values where {} belong",
                        values.len(),
                        range.len()
                    ),
                );
                self.abort("hop of the wrong size", now);
                return;
            }
            let reducing = hop < ring.len() as u32 - 1 || ring.direct();
            for (a, v) in ring.acc[range].iter_mut().zip(&values) {
                if reducing {
                    *a += v;
                } else {
                    *a = *v;
                }
            }
            ring.step = ring.step.max(step);
            ring.next_hop += 1;
            ring.last_progress = now;
            if ring.next_hop == ring.hops() {
                let acc = std::mem::take(&mut ring.acc);
                let (step, carried) = (ring.step, ring.carries_state);
                self.finish(round, acc, step, carried, now, out);
                return;
            }
            let msg = hop_message(round, attempt, ring, ring.next_hop);
            let peer = ring.successor();
            self.bytes_sent += msg.values.len() as u64;
            out.push(Output::SendRing { peer, msg });
        }
    }
}
