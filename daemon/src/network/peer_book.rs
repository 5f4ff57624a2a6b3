//! The peers a node remembers beyond its open connections: members it has seen (to redial
//! with backoff when they are lost, and to forget when they stay away), bans (with the score,
//! reason and end that status shows), the offences the mesh reported (the evidence a ban
//! names), and which graylisted members to ban ([`PeerBook::graylisted`]). It owns no sockets
//! and reads no clock: the event loop passes `now` in and acts on what comes back (dial these,
//! unblock those), so all of it is tested here without a swarm.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};

use crate::scoring;

/// Addresses kept per peer, whether found by mDNS or listed in its identify (a host may
/// listen on several; a hostile one lists as many as identify's 4 KiB message holds, ~100).
pub const ADDRS_MAX: usize = 8;
/// Peers remembered to redial at most: a member list this long is far past any home lab's,
/// while a public mesh's strangers that connect under fresh identities and leave would
/// otherwise each be remembered for [`FORGET_AFTER`]. When full, a peer identified over a
/// direct connection takes the place of the one seen longest ago (connected members are
/// seen again at every redial tick, so that is a lost one: such a flood can make this node
/// forget lost members, which then come back through Kademlia, mDNS or by dialling it).
pub const KNOWN_MAX: usize = 4096;
/// First wait before redialling a member that was lost (crashed, hung, or cut off by a
/// partition); it doubles per failed attempt up to [`REDIAL_MAX`].
pub const REDIAL_MIN: Duration = Duration::from_secs(1);
/// See [`REDIAL_MIN`]: a lost member is retried at least this often, so a healed partition
/// joins up again within seconds (a dial on a LAN costs one packet).
pub const REDIAL_MAX: Duration = Duration::from_secs(8);
/// A lost member not reached again for this long is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(30 * 60);
/// An offence counts towards a ban for this long (a ban's length: the squared rejection
/// count behind the score has decayed long before, at a half-life of about 69 s).
pub const OFFENCE_MEMORY: Duration = scoring::BAN_FOR;
/// A member kept below the graylist threshold by gossipsub's behaviour penalty alone (no
/// offence on record) is banned once such a spell lasts this long: a late answer earns the
/// penalty too, and it decays in seconds once answers come in time, while a peer that keeps
/// breaking its IWANT promises or grafting during a backoff stays below.
pub const UNPROVEN_SPELL_MAX: Duration = Duration::from_secs(60);
/// ... or at its this many-th such spell within [`OFFENCE_MEMORY`].
pub const UNPROVEN_SPELLS_MAX: u32 = 3;

/// A peer disconnected and refused for a while because its score fell below the graylist
/// threshold. An operator who sees one needs to know what it did and when it may come back:
/// a ban is the mesh's sharpest tool and must be explainable.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BannedPeer {
    /// Peer id.
    pub peer_id: String,
    /// Its score when it was banned.
    pub score: f64,
    /// Seconds until it may connect again.
    pub secs_left: f64,
    /// When the ban ends, in seconds since the Unix epoch.
    #[serde(default)]
    pub until: u64,
    /// The offence: what the peer did that this node reported (rejected messages, refused
    /// syncs, bad ring hops), or the gossip protocol penalties that kept its score below the
    /// graylist threshold too long or too often.
    #[serde(default)]
    pub reason: String,
}

/// A member this node has seen: where it listens and when to try it again.
#[derive(Debug)]
struct KnownPeer {
    addrs: Vec<Multiaddr>,
    last_seen: Instant,
    next_dial: Instant,
    backoff: Duration,
}

/// A ban in force.
#[derive(Debug, Clone)]
struct Ban {
    score: f64,
    until: Instant,
    until_unix: u64,
    reason: String,
    /// Addresses the peer was known at: a connection from one of them that breaks off
    /// mid-handshake is most likely the banned peer redialling (its other dial attempts are
    /// cancelled once one is refused), not a key mismatch.
    ips: HashSet<IpAddr>,
}

/// What a peer did wrong, as the mesh reported it: the evidence a ban names.
#[derive(Debug, Clone, Default)]
struct Offences {
    count: u64,
    last: String,
    /// When the last one was reported.
    at: Option<Instant>,
}

/// A member's spells below the graylist threshold with no offence on record (see
/// [`UNPROVEN_SPELL_MAX`]).
#[derive(Debug, Clone, Default)]
struct UnprovenSpells {
    /// When the last few began, oldest first (at most [`UNPROVEN_SPELLS_MAX`]).
    starts: std::collections::VecDeque<Instant>,
    /// When the spell under way began.
    current: Option<Instant>,
}

/// What to do with a member whose score is below the graylist threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraylistVerdict {
    /// Ban it: it committed an offence, or gossip protocol penalties alone kept it below for
    /// too long or too often.
    Ban,
    /// Keep it (gossipsub ignores it meanwhile); `new_spell` the first time this spell is
    /// seen, for the log.
    Spare {
        /// This spell began now.
        new_spell: bool,
    },
}

/// Known peers, bans and offences; see the module docs.
#[derive(Debug, Default)]
pub struct PeerBook {
    known: HashMap<PeerId, KnownPeer>,
    banned: HashMap<PeerId, Ban>,
    offences: HashMap<PeerId, Offences>,
    unproven: HashMap<PeerId, UnprovenSpells>,
}

/// The IP address in a multiaddr, if any: bans remember where a peer came from.
pub fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(ip.into()),
        Protocol::Ip6(ip) => Some(ip.into()),
        _ => None,
    })
}

/// The reason a ban gives: the score, and the offences behind it when the mesh reported any.
fn ban_reason(score: f64, offences: Option<&Offences>) -> String {
    let threshold = scoring::GRAYLIST_THRESHOLD;
    match offences {
        Some(o) if o.count > 0 => format!(
            "gossip score {score:.1} fell below the graylist threshold {threshold} after {} offences (last: {})",
            o.count, o.last
        ),
        _ => format!(
            "gossip score {score:.1} fell below the graylist threshold {threshold} with no offence recorded"
        ),
    }
}

impl PeerBook {
    /// A member was identified over a direct connection: remember where it listens, so it
    /// can be redialled if it is lost. Its backoff starts again from [`REDIAL_MIN`].
    /// At most [`ADDRS_MAX`] of its addresses are kept, and at most [`KNOWN_MAX`] peers.
    pub fn seen(&mut self, peer: PeerId, mut addrs: Vec<Multiaddr>, now: Instant) {
        addrs.truncate(ADDRS_MAX);
        self.make_room_for(&peer);
        self.known.insert(
            peer,
            KnownPeer {
                addrs,
                last_seen: now,
                next_dial: now + REDIAL_MIN,
                backoff: REDIAL_MIN,
            },
        );
    }

    /// A peer found on the local network (mDNS) before any connection: remember where, so a
    /// first dial that fails is retried like a lost member's. mDNS announces a peer once, not
    /// again until its record expires, so without this one lost dial kept two boxes on one
    /// LAN apart for minutes. At most [`ADDRS_MAX`] addresses are kept per peer; a full book
    /// takes no new peer this way (an mDNS announcement proves nothing, and a host on the LAN
    /// could announce thousands to push out the lost members the book is for).
    pub fn discovered(&mut self, peer: PeerId, addr: Multiaddr, now: Instant) {
        if self.known.len() >= KNOWN_MAX && !self.known.contains_key(&peer) {
            return;
        }
        let known = self.known.entry(peer).or_insert_with(|| KnownPeer {
            addrs: Vec::new(),
            last_seen: now,
            next_dial: now + REDIAL_MIN,
            backoff: REDIAL_MIN,
        });
        if !known.addrs.contains(&addr) && known.addrs.len() < ADDRS_MAX {
            known.addrs.push(addr);
        }
    }

    /// Forgets the peer seen longest ago when the book is full and `peer` is not in it.
    fn make_room_for(&mut self, peer: &PeerId) {
        if self.known.len() < KNOWN_MAX || self.known.contains_key(peer) {
            return;
        }
        if let Some(oldest) = self
            .known
            .iter()
            .min_by_key(|(_, k)| k.last_seen)
            .map(|(p, _)| *p)
        {
            self.known.remove(&oldest);
        }
    }

    /// The peer left for good: never redial it.
    pub fn forget(&mut self, peer: &PeerId) {
        self.known.remove(peer);
    }

    /// Whether the book still remembers `peer` (it was seen and not forgotten).
    #[cfg(test)]
    pub fn knows(&self, peer: &PeerId) -> bool {
        self.known.contains_key(peer)
    }

    /// The lost members to dial now, with every address they listened at. Members still
    /// connected (`is_member`) have their backoff reset; peers away for [`FORGET_AFTER`] are
    /// forgotten; `skip` peers (refused for another run) and banned ones are left alone. Each
    /// peer returned waits its backoff before the next attempt, and the backoff doubles up to
    /// [`REDIAL_MAX`].
    pub fn redial_due(
        &mut self,
        now: Instant,
        is_member: impl Fn(&PeerId) -> bool,
        skip: impl Fn(&PeerId) -> bool,
    ) -> Vec<(PeerId, Vec<Multiaddr>)> {
        for (peer, k) in self.known.iter_mut() {
            if is_member(peer) {
                k.last_seen = now;
                k.backoff = REDIAL_MIN;
                k.next_dial = now + REDIAL_MIN;
            }
        }
        self.known
            .retain(|_, k| now.duration_since(k.last_seen) < FORGET_AFTER);
        let banned = &self.banned;
        self.known
            .iter_mut()
            .filter(|(p, k)| {
                k.next_dial <= now && !is_member(p) && !skip(p) && !banned.contains_key(p)
            })
            .map(|(p, k)| {
                k.next_dial = now + k.backoff;
                k.backoff = (k.backoff * 2).min(REDIAL_MAX);
                (*p, k.addrs.clone())
            })
            .collect()
    }

    /// Records an offence of `peer` at `now`, for the reason a later ban gives.
    pub fn note_offence(&mut self, peer: PeerId, why: String, now: Instant) {
        let o = self.offences.entry(peer).or_default();
        o.count += 1;
        o.last = why;
        o.at = Some(now);
    }

    /// Records an offence of `peer`'s that the mesh may not have named (gossipsub told to
    /// reject its message, its score lowered for a refused sync or a bad ring hop), unless
    /// one is on record already (the mesh names most of them itself, just before).
    pub fn note_unnamed_offence(&mut self, peer: PeerId, what: &str, now: Instant) {
        if !self.offended(&peer, now) {
            self.note_offence(peer, what.to_string(), now);
        }
    }

    /// Whether an offence of `peer` was recorded within [`OFFENCE_MEMORY`] of `now` (and
    /// since its last ban ended).
    pub fn offended(&self, peer: &PeerId, now: Instant) -> bool {
        self.offences.get(peer).is_some_and(|o| {
            o.count > 0
                && o.at
                    .is_some_and(|at| now.saturating_duration_since(at) < OFFENCE_MEMORY)
        })
    }

    /// A member's score is below the graylist threshold at `now`: ban it if it committed an
    /// offence lately. gossipsub's behaviour penalty (P7: broken IWANT promises, grafts during
    /// a prune backoff) also lowers scores, and an honest box starved of CPU earns it by
    /// answering late; gossipsub ignores such a peer while its score is below the threshold
    /// (seconds, as the penalty decays) and the node keeps it, unless the spell lasts
    /// [`UNPROVEN_SPELL_MAX`] or is the [`UNPROVEN_SPELLS_MAX`]-th within
    /// [`OFFENCE_MEMORY`]: then the spells are the offence the ban names.
    pub fn graylisted(&mut self, peer: PeerId, now: Instant) -> GraylistVerdict {
        if self.offended(&peer, now) {
            return GraylistVerdict::Ban;
        }
        let s = self.unproven.entry(peer).or_default();
        let new_spell = s.current.is_none();
        let since = *s.current.get_or_insert(now);
        if new_spell {
            if s.starts.len() >= UNPROVEN_SPELLS_MAX as usize {
                s.starts.pop_front();
            }
            s.starts.push_back(now);
        }
        let recent = s
            .starts
            .iter()
            .filter(|t| now.saturating_duration_since(**t) < OFFENCE_MEMORY)
            .count();
        let why = if now.saturating_duration_since(since) >= UNPROVEN_SPELL_MAX {
            format!(
                "gossip protocol penalties alone (broken IWANT promises or grafts during a prune backoff) kept its score below the graylist threshold for {} s",
                UNPROVEN_SPELL_MAX.as_secs()
            )
        } else if recent >= UNPROVEN_SPELLS_MAX as usize {
            format!(
                "gossip protocol penalties alone (broken IWANT promises or grafts during a prune backoff) took its score below the graylist threshold {recent} times within {} minutes",
                OFFENCE_MEMORY.as_secs() / 60
            )
        } else {
            return GraylistVerdict::Spare { new_spell };
        };
        self.unproven.remove(&peer);
        self.note_offence(peer, why, now);
        GraylistVerdict::Ban
    }

    /// A member's score is at or above the graylist threshold: a spell of it below is over.
    pub fn not_graylisted(&mut self, peer: &PeerId) {
        if let Some(s) = self.unproven.get_mut(peer) {
            s.current = None;
        }
    }

    /// Forgets offences older than [`OFFENCE_MEMORY`] (a banned peer's stay until its ban
    /// ends) and spells that old: both maps stay as small as the peers that misbehaved
    /// lately. A peer that is no longer a member ends its spell, but its earlier ones are
    /// kept: leaving and coming back does not start its count again.
    pub fn forget_stale(&mut self, now: Instant, is_member: impl Fn(&PeerId) -> bool) {
        let fresh = |at: Instant| now.saturating_duration_since(at) < OFFENCE_MEMORY;
        let banned = &self.banned;
        self.offences
            .retain(|p, o| banned.contains_key(p) || o.at.is_some_and(fresh));
        self.unproven.retain(|p, s| {
            if !is_member(p) {
                s.current = None;
            }
            s.starts.retain(|t| fresh(*t));
            s.current.is_some() || !s.starts.is_empty()
        });
    }

    /// How many offences of `peer` were reported since its last ban ended, and the last one.
    pub fn offences_of(&self, peer: &PeerId) -> Option<(u64, &str)> {
        self.offences.get(peer).map(|o| (o.count, o.last.as_str()))
    }

    /// Ends the bans that are over at `now` (their offences are forgiven with them) and
    /// returns the peers, for the block list to let in again.
    pub fn end_expired_bans(&mut self, now: Instant) -> Vec<PeerId> {
        let expired: Vec<PeerId> = self
            .banned
            .iter()
            .filter(|(_, b)| b.until <= now)
            .map(|(p, _)| *p)
            .collect();
        for peer in &expired {
            self.banned.remove(peer);
            self.offences.remove(peer);
        }
        expired
    }

    /// Bans `peer` for [`scoring::BAN_FOR`] from `now` (`now_unix` in seconds since the
    /// epoch, for status) and returns the reason. `seen_at` is the address of its live
    /// connection, remembered with the ones it listened at.
    pub fn ban(
        &mut self,
        peer: PeerId,
        score: f64,
        now: Instant,
        now_unix: u64,
        seen_at: Option<Multiaddr>,
    ) -> String {
        let reason = ban_reason(score, self.offences.get(&peer));
        let ips = seen_at
            .into_iter()
            .chain(
                self.known
                    .get(&peer)
                    .into_iter()
                    .flat_map(|k| k.addrs.clone()),
            )
            .filter_map(|a| ip_of(&a))
            .collect();
        self.banned.insert(
            peer,
            Ban {
                score,
                until: now + scoring::BAN_FOR,
                until_unix: now_unix + scoring::BAN_FOR.as_secs(),
                reason: reason.clone(),
                ips,
            },
        );
        reason
    }

    /// Whether `peer` is banned (until [`PeerBook::end_expired_bans`] says otherwise).
    #[cfg(test)]
    pub fn is_banned(&self, peer: &PeerId) -> bool {
        self.banned.contains_key(peer)
    }

    /// A banned peer that was known at `ip`: an incoming connection from there that breaks
    /// off mid-handshake is most likely that peer redialling.
    pub fn banned_at(&self, ip: IpAddr) -> Option<PeerId> {
        self.banned
            .iter()
            .find(|(_, b)| b.ips.contains(&ip))
            .map(|(p, _)| *p)
    }

    /// A log text for a connection refused because of a ban, naming the ban when the
    /// denial's text names the peer.
    pub fn ban_text(&self, denial: &str, now: Instant) -> String {
        let found = self
            .banned
            .iter()
            .find(|(p, _)| denial.contains(&p.to_string()));
        match found {
            Some((p, b)) => format!(
                "peer {p} is banned for another {}s ({})",
                b.until.saturating_duration_since(now).as_secs(),
                b.reason
            ),
            None => format!("the peer is banned ({denial})"),
        }
    }

    /// The bans in force at `now`, sorted by peer id, as status shows them.
    pub fn banned(&self, now: Instant) -> Vec<BannedPeer> {
        let mut banned: Vec<BannedPeer> = self
            .banned
            .iter()
            .filter(|(_, b)| b.until > now)
            .map(|(id, b)| BannedPeer {
                peer_id: id.to_string(),
                score: b.score,
                secs_left: b.until.duration_since(now).as_secs_f64(),
                until: b.until_unix,
                reason: b.reason.clone(),
            })
            .collect();
        banned.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
        banned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Multiaddr {
        s.parse().expect("multiaddr")
    }

    /// The offsets from `t0` at which a peer lost at `t0` is redialled, over `span`.
    fn dial_times(book: &mut PeerBook, t0: Instant, span: Duration) -> Vec<Duration> {
        let step = Duration::from_millis(100);
        let mut out = Vec::new();
        let mut t = Duration::ZERO;
        while t <= span {
            if !book.redial_due(t0 + t, |_| false, |_| false).is_empty() {
                out.push(t);
            }
            t += step;
        }
        out
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.seen(p, vec![addr("/ip4/10.0.0.1/tcp/4001")], t0);
        let times = dial_times(&mut book, t0, Duration::from_secs(45));
        let gaps: Vec<u64> = times.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
        assert_eq!(times[0], REDIAL_MIN);
        assert_eq!(gaps[..5], [1, 2, 4, 8, 8], "{times:?}");
        assert!(gaps.iter().all(|g| *g <= REDIAL_MAX.as_secs()), "{gaps:?}");
    }

    #[test]
    fn a_connected_member_is_not_dialled_and_its_backoff_resets() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.seen(p, vec![addr("/ip4/10.0.0.1/tcp/4001")], t0);
        let _ = dial_times(&mut book, t0, Duration::from_secs(20));
        let t1 = t0 + Duration::from_secs(21);
        assert!(book.redial_due(t1, |_| true, |_| false).is_empty());
        // Lost again: the first retry comes after REDIAL_MIN, not the old capped backoff.
        let due = book.redial_due(t1 + REDIAL_MIN, |_| false, |_| false);
        assert_eq!(due, vec![(p, vec![addr("/ip4/10.0.0.1/tcp/4001")])]);
    }

    #[test]
    fn skipped_and_banned_peers_are_not_dialled() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let (a, b) = (PeerId::random(), PeerId::random());
        book.seen(a, vec![addr("/ip4/10.0.0.1/tcp/1")], t0);
        book.seen(b, vec![addr("/ip4/10.0.0.2/tcp/1")], t0);
        book.ban(b, -100.0, t0, 0, None);
        let due = book.redial_due(t0 + REDIAL_MIN, |_| false, |p| *p == a);
        assert!(due.is_empty(), "{due:?}");
    }

    #[test]
    fn a_peer_away_too_long_is_forgotten() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.seen(p, vec![addr("/ip4/10.0.0.1/tcp/4001")], t0);
        book.redial_due(
            t0 + FORGET_AFTER - Duration::from_secs(1),
            |_| false,
            |_| false,
        );
        assert!(book.knows(&p));
        assert!(book
            .redial_due(t0 + FORGET_AFTER, |_| false, |_| false)
            .is_empty());
        assert!(!book.knows(&p));
    }

    #[test]
    fn a_peer_found_on_the_lan_is_redialled_until_it_connects() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let a = PeerId::random();
        for i in 0..20 {
            let addr: Multiaddr = format!("/ip4/10.77.0.2/tcp/{}", 4000 + i)
                .parse()
                .expect("addr");
            book.discovered(a, addr, t0);
        }
        let due = book.redial_due(t0 + REDIAL_MIN, |_| false, |_| false);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].1.len(), ADDRS_MAX);
        // Once connected it is a member like any other: no more dials.
        assert!(book
            .redial_due(t0 + REDIAL_MAX * 2, |_| true, |_| false)
            .is_empty());
    }

    #[test]
    fn the_book_keeps_a_bounded_number_of_peers_and_addresses() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let many: Vec<Multiaddr> = (0..100)
            .map(|i| addr(&format!("/ip4/10.0.0.1/tcp/{}", 4000 + i)))
            .collect();
        let first = PeerId::random();
        book.seen(first, many, t0);
        assert_eq!(book.known[&first].addrs.len(), ADDRS_MAX);
        for i in 1..KNOWN_MAX as u64 + 10 {
            book.seen(PeerId::random(), vec![], t0 + Duration::from_millis(i));
        }
        assert_eq!(book.known.len(), KNOWN_MAX);
        assert!(!book.knows(&first), "the peer seen longest ago made room");
        // Seeing a known peer again takes no one's place.
        let newest = *book
            .known
            .iter()
            .max_by_key(|(_, k)| k.last_seen)
            .map(|(p, _)| p)
            .expect("full");
        book.seen(newest, vec![], t0 + Duration::from_secs(60));
        assert_eq!(book.known.len(), KNOWN_MAX);
    }

    #[test]
    fn forget_stops_redials() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.seen(p, vec![addr("/ip4/10.0.0.1/tcp/4001")], t0);
        book.forget(&p);
        assert!(book
            .redial_due(t0 + REDIAL_MIN, |_| false, |_| false)
            .is_empty());
    }

    #[test]
    fn offences_are_noted_and_named_by_the_ban() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.note_offence(p, "rejected update (bad shape)".into(), t0);
        book.note_offence(p, "rejected update (replayed)".into(), t0);
        assert_eq!(
            book.offences_of(&p),
            Some((2, "rejected update (replayed)"))
        );
        let reason = book.ban(p, -123.45, t0, 1_000, None);
        assert_eq!(
            reason,
            format!(
                "gossip score -123.5 fell below the graylist threshold {} after 2 offences (last: rejected update (replayed))",
                scoring::GRAYLIST_THRESHOLD
            )
        );
        let shown = book.banned(t0);
        assert_eq!(shown.len(), 1);
        assert_eq!(shown[0].peer_id, p.to_string());
        assert_eq!(shown[0].reason, reason);
        assert_eq!(shown[0].until, 1_000 + scoring::BAN_FOR.as_secs());
        assert_eq!(shown[0].secs_left, scoring::BAN_FOR.as_secs_f64());
    }

    #[test]
    fn only_a_peer_with_a_recent_offence_is_offended_and_an_unnamed_one_counts() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let (named, rejected, idle) = (PeerId::random(), PeerId::random(), PeerId::random());
        book.note_offence(named, "rejected update (replayed)".into(), t0);
        book.note_unnamed_offence(named, "a gossip message the node rejected", t0);
        book.note_unnamed_offence(rejected, "a gossip message the node rejected", t0);
        assert!(book.offended(&named, t0) && book.offended(&rejected, t0));
        assert!(!book.offended(&idle, t0));
        // The mesh's own word is kept: an offence it already named adds nothing.
        assert_eq!(
            book.offences_of(&named),
            Some((1, "rejected update (replayed)"))
        );
        assert_eq!(
            book.offences_of(&rejected),
            Some((1, "a gossip message the node rejected"))
        );
        // An old offence is no evidence, and is forgotten.
        let later = t0 + OFFENCE_MEMORY;
        assert!(!book.offended(&named, later));
        book.forget_stale(later, |_| true);
        assert_eq!(book.offences_of(&named), None);
        let reason = book.ban(idle, -80.0, t0, 0, None);
        assert!(
            reason.starts_with("gossip score -80.0 fell below") && reason.contains("no offence"),
            "{reason}"
        );
    }

    /// The flood test's starved honest node (CI banned it for broken promises or grafts
    /// during a backoff alone): a spell below the graylist threshold without an offence is
    /// spared, one that lasts a minute or is the third within ten is banned, naming it; an
    /// offence bans at once.
    #[test]
    fn a_graylisting_without_an_offence_bans_only_when_it_lasts_or_recurs() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let (late, stuck, recurring, offender) = (
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
        );
        let spared = |new_spell| GraylistVerdict::Spare { new_spell };
        assert_eq!(book.graylisted(late, t0), spared(true));
        assert_eq!(book.graylisted(late, t0 + s(8)), spared(false));
        book.not_graylisted(&late);
        assert!(!book.offended(&late, t0 + s(9)));
        // One that stays below for a minute.
        assert_eq!(book.graylisted(stuck, t0), spared(true));
        assert_eq!(book.graylisted(stuck, t0 + s(59)), spared(false));
        assert_eq!(book.graylisted(stuck, t0 + s(60)), GraylistVerdict::Ban);
        assert!(book
            .offences_of(&stuck)
            .is_some_and(|(_, why)| why.contains("for 60 s")));
        // One that comes back below: the third spell within ten minutes is banned, while
        // spells further apart are not.
        for (k, at) in [0, 200, 400].into_iter().enumerate() {
            let verdict = book.graylisted(recurring, t0 + s(at));
            book.not_graylisted(&recurring);
            let want = if k < 2 {
                spared(true)
            } else {
                GraylistVerdict::Ban
            };
            assert_eq!(verdict, want, "spell {k}");
        }
        assert!(book
            .offences_of(&recurring)
            .is_some_and(|(_, why)| why.contains("3 times within 10 minutes")));
        let apart = PeerId::random();
        for at in [0, 400, 800, 1200] {
            assert_eq!(book.graylisted(apart, t0 + s(at)), spared(true), "at {at}");
            book.not_graylisted(&apart);
        }
        // The ten minutes slide: three spells within 3 s are three, wherever they fall.
        let sliding = PeerId::random();
        for (at, want) in [
            (0, spared(true)),
            (598, spared(true)),
            (600, spared(true)),
            (601, GraylistVerdict::Ban),
        ] {
            assert_eq!(book.graylisted(sliding, t0 + s(at)), want, "at {at}");
            book.not_graylisted(&sliding);
        }
        book.note_offence(offender, "rejected update (replayed)".into(), t0);
        assert_eq!(book.graylisted(offender, t0), GraylistVerdict::Ban);
        // A peer that leaves ends its spell but not its count: back, its next two spells
        // within ten minutes are its third.
        let leaver = PeerId::random();
        assert_eq!(book.graylisted(leaver, t0), spared(true));
        assert_eq!(book.graylisted(leaver, t0 + s(50)), spared(false));
        book.forget_stale(t0 + s(51), |p| *p != leaver);
        assert_eq!(book.graylisted(leaver, t0 + s(52)), spared(true));
        book.not_graylisted(&leaver);
        assert_eq!(book.graylisted(leaver, t0 + s(53)), GraylistVerdict::Ban);
        // Spells older than ten minutes are forgotten, and with them the peer.
        book.forget_stale(t0 + s(9) + OFFENCE_MEMORY, |_| true);
        assert!(!book.unproven.contains_key(&late));
    }

    #[test]
    fn a_ban_expires_and_forgives_its_offences() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.note_offence(p, "first".into(), t0);
        book.ban(p, -100.0, t0, 0, None);
        assert!(book.is_banned(&p));
        let almost = t0 + scoring::BAN_FOR - Duration::from_millis(1);
        assert!(book.end_expired_bans(almost).is_empty());
        assert_eq!(book.banned(almost).len(), 1);
        assert_eq!(book.end_expired_bans(t0 + scoring::BAN_FOR), vec![p]);
        assert!(!book.is_banned(&p));
        assert!(book.banned(t0 + scoring::BAN_FOR).is_empty());
        // Banned again later, the old offence is not held against it.
        let reason = book.ban(p, -100.0, t0 + scoring::BAN_FOR, 0, None);
        assert!(reason.contains("with no offence recorded"), "{reason}");
    }

    #[test]
    fn a_ban_remembers_where_the_peer_was_and_names_itself() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.seen(p, vec![addr("/ip4/10.0.0.7/tcp/4001")], t0);
        book.ban(p, -100.0, t0, 0, Some(addr("/ip4/10.0.0.8/tcp/5555")));
        assert_eq!(book.banned_at("10.0.0.7".parse().expect("ip")), Some(p));
        assert_eq!(book.banned_at("10.0.0.8".parse().expect("ip")), Some(p));
        assert_eq!(book.banned_at("10.0.0.9".parse().expect("ip")), None);
        let text = book.ban_text(&format!("peer {p} is blocked"), t0);
        assert!(
            text.starts_with(&format!(
                "peer {p} is banned for another {}s (",
                scoring::BAN_FOR.as_secs()
            )),
            "{text}"
        );
        assert_eq!(book.ban_text("someone", t0), "the peer is banned (someone)");
    }

    #[test]
    fn ip_of_finds_v4_and_v6() {
        assert_eq!(
            ip_of(&addr("/ip4/10.1.2.3/tcp/1")),
            Some("10.1.2.3".parse().expect("ip"))
        );
        assert_eq!(
            ip_of(&addr("/ip6/::1/tcp/1")),
            Some("::1".parse().expect("ip"))
        );
        assert_eq!(ip_of(&addr("/dns4/example.org/tcp/1")), None);
    }
}
