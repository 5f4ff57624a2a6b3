//! A test-only switch (`debug.ring_attack`) that makes a node a hostile member of the
//! synchronous modes' rounds: what it does to every round hop it sends. Everything else about
//! the node stays honest (it heartbeats, trains and takes hops), so a test can run a rogue
//! member as a real process beside honest ones. Only builds with debug assertions (the
//! integration tests' binary) take it; a release build refuses a config that sets it.

use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::wire::RingMessage;

/// What a rogue member does to the round hops it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RingAttack {
    /// Every value it sends (its parts and its aggregate) shifted by 1e6.
    Poison,
    /// Every value it sends set to 1e30: a finite mean that would make every member diverge.
    Kill,
    /// Its parts claim a weight of 1e9 (in `fedavg`, a sample count nothing proves).
    Weight,
    /// It takes every hop and sends none: each attempt with it stalls.
    Stall,
    /// Its hops name a round a million past the one they belong to (far below where hops
    /// are offences, and half of that, past which members follow only small jumps).
    Hijack,
    /// Its hops name the next round: a jump small enough for every member to follow.
    NextRound,
    /// Its hops name the next attempt of their round.
    NextAttempt,
    /// Its hops as long as any a member reads whole: each padded with zeros to the model's
    /// largest honest hop (a whole `diloco` contribution, `wire::largest_hop_values`), the
    /// weight last.
    Oversize,
    /// Its hops name round `u64::MAX`: past any round a mesh reaches, where the round counter
    /// would wrap.
    RoundMax,
    /// Its hops name the next round to about one member in four (another quarter each round:
    /// those whose peer id's last byte plus the round is a multiple of 4) and are honest to
    /// the rest: the members it moves then carry the others on with their own hops, if
    /// members follow one another's word.
    RelayNextRound,
    /// Its hops name the step just under the bound where hops are offences (2^48 - 1): one
    /// member's word on the members' step, which a joiner or founder takes with the mean.
    Step,
    /// Its hops name a member-list digest no list has (its own list's, with bits flipped):
    /// every attempt with it sees lists that differ, and no leave-out or sit-out explains it.
    WrongDigest,
    /// Its hops name the next round to the same members every round (those whose peer id's
    /// last byte is a multiple of 4: about one in four) and are honest to the rest: the
    /// others' hops contradict it to those members alone, which are never most.
    TargetedNextRound,
}

impl RingAttack {
    /// The hop to send to `to` instead of `msg`; `None` to send nothing.
    /// `largest_hop_values`: the values of the model's largest honest hop (see
    /// [`RingAttack::Oversize`]).
    pub fn apply(
        self,
        mut msg: RingMessage,
        to: &PeerId,
        largest_hop_values: usize,
    ) -> Option<RingMessage> {
        match self {
            RingAttack::Stall => return None,
            RingAttack::Hijack => msg.round = msg.round.saturating_add(1_000_000),
            RingAttack::NextRound => msg.round = msg.round.saturating_add(1),
            RingAttack::NextAttempt => msg.attempt = msg.attempt.saturating_add(1),
            RingAttack::RoundMax => msg.round = u64::MAX,
            RingAttack::Step => msg.step = (1 << 48) - 1,
            RingAttack::WrongDigest => msg.members ^= 0x5eed_5eed_5eed_5eed,
            RingAttack::RelayNextRound => {
                let last = to.to_bytes().last().copied().unwrap_or(0);
                if (u64::from(last) + msg.round).is_multiple_of(4) {
                    msg.round = msg.round.saturating_add(1);
                }
            }
            RingAttack::TargetedNextRound => {
                if to.to_bytes().last().copied().unwrap_or(0).is_multiple_of(4) {
                    msg.round = msg.round.saturating_add(1);
                }
            }
            RingAttack::Oversize => rewrite(&mut msg, |values| {
                let weight = values.pop().unwrap_or(0.0);
                values.resize(largest_hop_values.saturating_sub(1), 0.0);
                values.push(weight);
            }),
            RingAttack::Poison => rewrite(&mut msg, |values| {
                let n = values.len().saturating_sub(1);
                values[..n].iter_mut().for_each(|v| *v += 1e6);
            }),
            RingAttack::Kill => rewrite(&mut msg, |values| {
                let n = values.len().saturating_sub(1);
                values[..n].iter_mut().for_each(|v| *v = 1e30);
            }),
            RingAttack::Weight => {
                if msg.hop == 0 {
                    rewrite(&mut msg, |values| {
                        if let Some(w) = values.last_mut() {
                            *w = 1e9;
                        }
                    })
                }
            }
        }
        Some(msg)
    }
}

/// Decodes a hop's values (the weight last), rewrites them, encodes them back as they came
/// (the rounds' unit tests' rogues use it too).
pub(crate) fn rewrite(msg: &mut RingMessage, f: impl FnOnce(&mut Vec<f32>)) {
    let mut values = msg.encoding.decode(&msg.values).unwrap_or_default();
    f(&mut values);
    let last = values.pop().unwrap_or(0.0);
    msg.values = ByteBuf::from(msg.encoding.encode(&values, last));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hop(hop: u32, values: &[f32]) -> RingMessage {
        RingMessage {
            round: 3,
            attempt: 0,
            members: 7,
            hop,
            values: ByteBuf::from(
                values
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
            ),
            step: 10,
            encoding: crate::wire::ValueEncoding::F32,
            piece: crate::wire::Piece::WHOLE,
        }
    }

    fn values(msg: &RingMessage) -> Vec<f32> {
        msg.values
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[test]
    fn each_attack_does_what_it_says_to_a_hop() {
        let to = PeerId::random();
        let honest = hop(0, &[1.0, 2.0, 1.0]);
        let poisoned = RingAttack::Poison
            .apply(honest.clone(), &to, 9)
            .expect("sent");
        assert_eq!(values(&poisoned), vec![1e6 + 1.0, 1e6 + 2.0, 1.0]);
        let killed = RingAttack::Kill
            .apply(honest.clone(), &to, 9)
            .expect("sent");
        assert_eq!(values(&killed), vec![1e30, 1e30, 1.0]);
        let heavy = RingAttack::Weight
            .apply(honest.clone(), &to, 9)
            .expect("sent");
        assert_eq!(values(&heavy), vec![1.0, 2.0, 1e9]);
        let aggregate = RingAttack::Weight
            .apply(hop(1, &[1.0, 3.0]), &to, 9)
            .expect("sent");
        assert_eq!(values(&aggregate), vec![1.0, 3.0]);
        assert!(RingAttack::Stall.apply(honest.clone(), &to, 9).is_none());
        let hijack = RingAttack::Hijack
            .apply(honest.clone(), &to, 9)
            .expect("sent");
        assert_eq!(hijack.round, 1_000_003);
        let at_the_end = RingAttack::RoundMax
            .apply(honest.clone(), &to, 9)
            .expect("sent");
        assert_eq!(at_the_end.round, u64::MAX);
        let far_on = RingAttack::Step
            .apply(honest.clone(), &to, 9)
            .expect("sent");
        assert_eq!(far_on.step, (1 << 48) - 1);
        let listed_apart = RingAttack::WrongDigest
            .apply(honest.clone(), &to, 9)
            .expect("sent");
        assert!(listed_apart.members != honest.members);
        assert_eq!(values(&listed_apart), values(&honest));
        let relayed_to = |last: u8| {
            // A peer id whose last byte is `last` (identity multihash of 36 bytes).
            let mut bytes = PeerId::random().to_bytes();
            if let Some(b) = bytes.last_mut() {
                *b = last;
            }
            PeerId::from_bytes(&bytes).expect("a peer id")
        };
        let relay = RingAttack::RelayNextRound;
        let moved = relay
            .apply(honest.clone(), &relayed_to(9), 9)
            .expect("sent");
        assert_eq!(moved.round, 4, "(9 + 3) % 4 == 0");
        let kept = relay
            .apply(honest.clone(), &relayed_to(10), 9)
            .expect("sent");
        assert_eq!(kept.round, 3);
        let targeted = RingAttack::TargetedNextRound;
        for (last, round) in [(8, 4), (9, 3), (12, 4)] {
            let sent = targeted
                .apply(honest.clone(), &relayed_to(last), 9)
                .expect("sent");
            assert_eq!(sent.round, round, "to a peer id ending in {last}");
        }
        let long = RingAttack::Oversize.apply(honest, &to, 9).expect("sent");
        assert_eq!(
            values(&long),
            vec![1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        );
    }
}
