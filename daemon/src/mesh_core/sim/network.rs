//! The simulated network: links and their delays, dials, partitions' cut edges, gossip to
//! subscribers, full syncs answered in the real dense format, ring hops in order on each
//! link, hostile nodes' forged updates, and carrying out a core's outputs.

use super::*;

impl Sim {
    pub(super) fn connected(&self, a: usize, b: usize) -> bool {
        self.nodes[a].alive
            && self.nodes[b].alive
            && !self.bans.contains_key(&(a, b))
            && !self.bans.contains_key(&(b, a))
            && (!self.partitioned || self.nodes[a].side == self.nodes[b].side)
            && self.links.as_ref().is_none_or(|l| l[a].contains(&b))
    }

    /// The nodes `i` may be connected to: its links, or everybody.
    pub(super) fn peers_of(&self, i: usize) -> Vec<usize> {
        match &self.links {
            Some(l) => l[i].iter().copied().collect(),
            None => (0..self.nodes.len()).filter(|&j| j != i).collect(),
        }
    }

    /// Node `i` dials `k` random live others (drawn with replacement, so a repeat leaves it
    /// fewer); both ends see the other come up within `within` ms.
    pub(super) fn dial(&mut self, i: usize, k: usize, within: u64) {
        let live: Vec<usize> = (0..self.nodes.len())
            .filter(|&j| j != i && self.nodes[j].alive)
            .collect();
        for _ in 0..k.min(live.len()) {
            let j = live[self.rng.random_range(0..live.len())];
            let Some(links) = self.links.as_mut() else {
                return;
            };
            if !links[i].insert(j) {
                continue;
            }
            links[j].insert(i);
            for (a, b) in [(i, j), (j, i)] {
                let id = self.nodes[b].id;
                let d = self.rng.random_range(0..within);
                self.at(d, Ev::Deliver(a, Box::new(Input::PeerUp(id))));
            }
        }
    }

    /// One-way delay: slow boxes sit behind slow links.
    pub(super) fn delay(&mut self, a: usize, b: usize) -> u64 {
        let slow = self.nodes[a].step_ms > 10 || self.nodes[b].step_ms > 10;
        let base = if slow { 80 } else { 5 };
        base + self.rng.random_range(0..base)
    }

    pub(super) fn input(&mut self, i: usize, input: Input) {
        // Names the node in what its core logs (a subscriber sees it only in tests that
        // install one).
        let span = tracing::debug_span!("node", i, ms = self.t);
        let _entered = span.enter();
        let mut work = vec![input];
        while let Some(input) = work.pop() {
            let now = self.now();
            let outs = self.nodes[i].core.handle(input, now);
            work.extend(self.carry_out(i, outs));
            while let Some(apply) = self.nodes[i].core.next_apply() {
                // An apply has no answer.
                self.train(i, apply);
            }
            let sizes = self.nodes[i].core.sizes();
            self.report.largest_map = self.report.largest_map.max(sizes.per_peer_max);
            self.report.largest_queue = self
                .report
                .largest_queue
                .max(self.nodes[i].core.pending_applies());
        }
    }

    pub(super) fn blame(&mut self, i: usize, peer: &PeerId, why: &str) {
        if self.nodes[i].hostile {
            return;
        }
        if self.p.rounds.is_some() {
            if let Some(&j) = self.index.get(peer) {
                let count = self.offences.entry((i, j)).or_default();
                *count += 1;
                if *count == BAN_OFFENCES && self.connected(i, j) {
                    let completed = self.nodes[i]
                        .core
                        .status(self.now())
                        .rounds
                        .map_or(0, |r| r.completed);
                    self.bans.insert((i, j), completed);
                    for (a, b) in [(i, j), (j, i)] {
                        let id = self.nodes[b].id;
                        self.at(0, Ev::Deliver(a, Box::new(Input::PeerDown(id))));
                    }
                }
            }
        }
        match self.index.get(peer) {
            Some(&j) if self.nodes[j].hostile => self.report.hostile_blamed += 1,
            _ => {
                self.report.honest_blamed += 1;
                if self.report.honest_why.len() < 5 {
                    self.report
                        .honest_why
                        .push(format!("t={} ms: {why}", self.t));
                }
            }
        }
    }

    pub(super) fn deliver_to_subscribers(&mut self, i: usize, topic: &str, data: Vec<u8>) {
        self.msg_ids += 1;
        let id = MessageId::from(self.msg_ids.to_le_bytes().to_vec());
        for j in self.peers_of(i) {
            if self.connected(i, j) && self.nodes[j].subs.contains(topic) {
                if !self.nodes[i].hostile {
                    self.report.bytes_sent += data.len() as u64;
                }
                let d = self.delay(i, j);
                let input = Input::Gossip {
                    source: self.nodes[i].id,
                    author: Some(self.nodes[i].id),
                    id: id.clone(),
                    topic: topic.to_string(),
                    data: data.clone(),
                };
                self.at(d, Ev::Deliver(j, Box::new(input)));
            }
        }
    }

    /// What a hostile node publishes instead of its update: garbage, or a huge update.
    pub(super) fn hostile_update(&mut self, i: usize, data: Vec<u8>) -> Vec<u8> {
        match self.rng.random_range(0..3) {
            0 => (0..64).map(|_| self.rng.random()).collect(),
            1 => {
                let values: Vec<f32> = self.nodes[i].x.iter().map(|v| v * 1000.0).collect();
                let header = self.header(i, self.nodes[i].step);
                let bytes = codec::encode(&header, &self.layout, &values, 1.0)
                    .expect("encode")
                    .bytes;
                crate::wire::encode_update_frame(&crate::wire::UpdateFrame::Inline(&bytes))
            }
            _ => data,
        }
    }

    pub(super) fn header(&self, i: usize, step: u64) -> UpdateHeader {
        UpdateHeader {
            run_id: codec::id_bytes(RUN),
            layout: codec::id_bytes(&self.layout.hash()),
            sender: codec::sender_bytes(&self.nodes[i].id.to_bytes()),
            base_step: step,
            step,
            codec: Codec::Dense,
            numel: self.p.dim as u32,
        }
    }

    pub(super) fn carry_out(&mut self, i: usize, outs: Vec<Output>) -> Vec<Input> {
        let mut back = Vec::new();
        for out in outs {
            match out {
                Output::SendRing { peer, msg } => self.send_ring(i, peer, msg),
                Output::Subscribe(t) => {
                    self.nodes[i].subs.insert(t);
                }
                Output::Unsubscribe(t) => {
                    self.nodes[i].subs.remove(&t);
                }
                Output::PublishUpdate { topic, data } => {
                    let payload = data.len() as u64;
                    let data = if self.nodes[i].hostile {
                        self.hostile_update(i, data)
                    } else {
                        data
                    };
                    self.deliver_to_subscribers(i, &topic, data);
                    back.push(Input::UpdatePublished { payload, ok: true });
                }
                Output::Publish { topic, data } => self.deliver_to_subscribers(i, &topic, data),
                Output::Validate { acceptance, .. } => {
                    let _ = acceptance == MessageAcceptance::Reject;
                }
                Output::Offence { peer, why } => self.blame(i, &peer, &why),
                Output::Penalise(_) | Output::Forget(_) => {}
                Output::Fetch {
                    owner,
                    source,
                    id,
                    hash,
                } => {
                    // Served at once by the author, if it still keeps the update.
                    let kept = self
                        .index
                        .get(&owner)
                        .filter(|&&j| self.nodes[j].alive && self.connected(i, j))
                        .and_then(|&j| self.nodes[j].core.large_update(&hash));
                    back.push(Input::Fetched {
                        owner,
                        source,
                        id,
                        hash,
                        answer: match kept {
                            Some(bytes) => FetchAnswer::Bytes(bytes.to_vec()),
                            None => FetchAnswer::Unavailable,
                        },
                    })
                }
                Output::RequestParams(peer) => self.answer_sync(i, peer),
                Output::Trainer(cmd) => {
                    let answers = self.train(i, cmd);
                    back.extend(self.when_trainer_free(i, answers));
                }
            }
        }
        back
    }

    /// A ring hop from node `i` reaches `peer` after the link's delay, never before an
    /// earlier hop on the same link ([`Sim::take_ring`]); a hop to a node gone or cut off
    /// comes back undelivered after a connection attempt's time.
    pub(super) fn send_ring(&mut self, i: usize, peer: PeerId, msg: RingMessage) {
        self.nodes[i].last_ring = Some((msg.round, msg.members));
        let msg = match self.p.ring_attack.filter(|_| self.nodes[i].hostile) {
            Some(attack) => {
                match attack.apply(msg, &peer, crate::wire::largest_hop_values(self.p.dim)) {
                    Some(msg) => msg,
                    None => return,
                }
            }
            None => msg,
        };
        let reachable = self
            .index
            .get(&peer)
            .copied()
            .filter(|&j| self.connected(i, j));
        let Some(j) = reachable else {
            let undelivered = Input::RingUndelivered {
                peer,
                round: msg.round,
                attempt: msg.attempt,
            };
            self.at(RING_DIAL_MS, Ev::Deliver(i, Box::new(undelivered)));
            return;
        };
        let arrival =
            (self.t + self.delay(i, j)).max(self.ring_arrivals.get(&(i, j)).copied().unwrap_or(0));
        self.ring_arrivals.insert((i, j), arrival);
        if !self.nodes[i].hostile {
            self.report.bytes_sent += msg.values.len() as u64;
        }
        // A large hop goes in pieces, as the daemon sends it; all arrive with the hop.
        let pieces = match self.nodes[i].core.ring_piece_bytes() {
            Some(bytes) => msg.into_pieces(bytes),
            None => vec![msg],
        };
        for piece in pieces {
            self.at(arrival - self.t, Ev::Hop(i, j, Box::new(piece)));
        }
    }

    /// Node `i`'s hop arrives at node `j`. As the daemon's network does, `j` takes it only
    /// from a member it knows (the two ends of a connection learn of each other
    /// independently) and while the link holds; otherwise it refuses it, and the refusal
    /// reaches `i` as an undelivered hop.
    pub(super) fn take_ring(&mut self, i: usize, j: usize, msg: RingMessage) {
        let from = self.nodes[i].id;
        let knows = self.nodes[j].core.membership.is_member(&from);
        if self.connected(i, j) && knows {
            self.input(j, Input::Ring { peer: from, msg });
        } else if self.nodes[i].alive {
            let refused = Input::RingUndelivered {
                peer: self.nodes[j].id,
                round: msg.round,
                attempt: msg.attempt,
            };
            let back = if self.connected(i, j) {
                self.delay(j, i)
            } else {
                RING_DIAL_MS
            };
            self.at(back, Ev::Deliver(i, Box::new(refused)));
        }
    }

    pub(super) fn answer_sync(&mut self, i: usize, peer: PeerId) {
        let Some(&j) = self.index.get(&peer) else {
            return;
        };
        if !self.connected(i, j) {
            let answer = Err(RequestFailed::Network("unreachable".into()));
            self.at(
                1_000,
                Ev::Deliver(i, Box::new(Input::ParamsReply { peer, answer })),
            );
            return;
        }
        let d = self.delay(i, j);
        self.at(d, Ev::Serve(i, j));
    }

    /// Node `j` answers node `i`'s sync request with its parameters as they are now (a hostile
    /// node with ten times them).
    pub(super) fn serve_sync(&mut self, i: usize, j: usize) {
        let peer = self.nodes[j].id;
        if !self.connected(i, j) {
            let answer = Err(RequestFailed::Network("unreachable".into()));
            self.at(
                1_000,
                Ev::Deliver(i, Box::new(Input::ParamsReply { peer, answer })),
            );
            return;
        }
        let scale = if self.nodes[j].hostile { 10.0 } else { 1.0 };
        let values: Vec<f32> = self.nodes[j].x.iter().map(|v| v * scale).collect();
        let step = self.nodes[j].step;
        let bytes = self.nodes[j]
            .core
            .params_encoder()
            .encode(step, &values)
            .expect("encode params");
        let bytes_len = bytes.len() as u64;
        let answer = Ok(BulkResponse::Params {
            step,
            layout: self.layout.hash(),
            values: ByteBuf::from(bytes),
        });
        if !self.nodes[j].hostile {
            self.report.bytes_sent += bytes_len;
        }
        let d = self.delay(j, i);
        self.at(
            d,
            Ev::Deliver(i, Box::new(Input::ParamsReply { peer, answer })),
        );
    }
}
