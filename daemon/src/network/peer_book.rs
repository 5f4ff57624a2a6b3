//! The peers a node remembers beyond its open connections: members it has seen (to redial
//! with backoff when they are lost, and to forget when they stay away), bans (with the score,
//! reason and end that status shows), and the offences the mesh reported (the evidence a ban
//! names). It owns no sockets and reads no clock: the event loop passes `now` in and acts on
//! what comes back (dial these, unblock those), so all of it is tested here without a swarm.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};

use crate::scoring;

/// Addresses kept per peer found by mDNS (a LAN host may announce several; a hostile one many).
const DISCOVERED_ADDRS_MAX: usize = 8;
/// First wait before redialling a member that was lost (crashed, hung, or cut off by a
/// partition); it doubles per failed attempt up to [`REDIAL_MAX`].
pub const REDIAL_MIN: Duration = Duration::from_secs(1);
/// See [`REDIAL_MIN`]: a lost member is retried at least this often, so a healed partition
/// joins up again within seconds (a dial on a LAN costs one packet).
pub const REDIAL_MAX: Duration = Duration::from_secs(8);
/// A lost member not reached again for this long is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(30 * 60);

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
    /// syncs), or that the score fell through gossip misbehaviour alone.
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
}

/// Known peers, bans and offences; see the module docs.
#[derive(Debug, Default)]
pub struct PeerBook {
    known: HashMap<PeerId, KnownPeer>,
    banned: HashMap<PeerId, Ban>,
    offences: HashMap<PeerId, Offences>,
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
    pub fn seen(&mut self, peer: PeerId, addrs: Vec<Multiaddr>, now: Instant) {
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
    /// LAN apart for minutes. At most [`DISCOVERED_ADDRS_MAX`] addresses are kept per peer.
    pub fn discovered(&mut self, peer: PeerId, addr: Multiaddr, now: Instant) {
        let known = self.known.entry(peer).or_insert_with(|| KnownPeer {
            addrs: Vec::new(),
            last_seen: now,
            next_dial: now + REDIAL_MIN,
            backoff: REDIAL_MIN,
        });
        if !known.addrs.contains(&addr) && known.addrs.len() < DISCOVERED_ADDRS_MAX {
            known.addrs.push(addr);
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

    /// Records an offence of `peer`, for the reason a later ban gives.
    pub fn note_offence(&mut self, peer: PeerId, why: String) {
        let o = self.offences.entry(peer).or_default();
        o.count += 1;
        o.last = why;
    }

    /// Records that gossipsub was told to reject a message `peer` forwarded, unless an
    /// offence of its is recorded already (the mesh names most rejections itself, just before).
    pub fn note_rejected(&mut self, peer: PeerId) {
        if !self.offended(&peer) {
            self.note_offence(peer, "a gossip message the node rejected".into());
        }
    }

    /// Whether an offence of `peer` was recorded since its last ban ended: only then does a
    /// score below the graylist threshold ban it. gossipsub's behaviour penalty (P7: broken
    /// IWANT promises, grafts during a prune backoff) also lowers scores, and an honest box
    /// starved of CPU earns it by answering late; gossipsub ignores such a peer while its
    /// score is below the threshold (seconds, as the penalty decays), and the node keeps it.
    pub fn offended(&self, peer: &PeerId) -> bool {
        self.offences.get(peer).is_some_and(|o| o.count > 0)
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
        assert_eq!(due[0].1.len(), DISCOVERED_ADDRS_MAX);
        // Once connected it is a member like any other: no more dials.
        assert!(book
            .redial_due(t0 + REDIAL_MAX * 2, |_| true, |_| false)
            .is_empty());
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
        book.note_offence(p, "rejected update (bad shape)".into());
        book.note_offence(p, "rejected update (replayed)".into());
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
    fn only_a_peer_with_an_offence_is_offended_and_a_rejection_is_one() {
        let mut book = PeerBook::default();
        let (named, rejected, idle) = (PeerId::random(), PeerId::random(), PeerId::random());
        book.note_offence(named, "rejected update (replayed)".into());
        book.note_rejected(named);
        book.note_rejected(rejected);
        assert!(book.offended(&named) && book.offended(&rejected));
        assert!(!book.offended(&idle));
        // The mesh's own word is kept: a rejection it already named adds nothing.
        assert_eq!(
            book.offences_of(&named),
            Some((1, "rejected update (replayed)"))
        );
        assert_eq!(
            book.offences_of(&rejected),
            Some((1, "a gossip message the node rejected"))
        );
        let reason = book.ban(idle, -80.0, Instant::now(), 0, None);
        assert!(
            reason.starts_with("gossip score -80.0 fell below") && reason.contains("no offence"),
            "{reason}"
        );
    }

    #[test]
    fn a_ban_expires_and_forgives_its_offences() {
        let mut book = PeerBook::default();
        let t0 = Instant::now();
        let p = PeerId::random();
        book.note_offence(p, "first".into());
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
