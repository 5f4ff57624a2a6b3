//! Unit tests of the sync policy.

use super::*;

fn cfg() -> PolicyConfig {
    PolicyConfig {
        publish_every: 0,
        publish_early_ratio: 0.0,
        full_sync_every: 0,
        staleness_bound: None,
        peer_timeout: Duration::from_millis(100),
        stale_after: 0,
        drop_after: None,
        mixing: Mixing::Add,
        wait_for_neighbours: 0,
    }
}

fn ms(base: Instant, t: u64) -> Instant {
    base + Duration::from_millis(t)
}

fn step(p: &mut SyncPolicy<u32>, s: u64, now: Instant) -> Vec<Action<u32>> {
    p.handle(
        PolicyEvent::Stepped {
            step: s,
            pending_ratio: 0.0,
        },
        now,
    )
}

fn up(p: &mut SyncPolicy<u32>, peer: u32, now: Instant) {
    assert!(p.handle(PolicyEvent::NeighbourUp { peer }, now).is_empty());
}

fn heard(p: &mut SyncPolicy<u32>, peer: u32, s: u64, now: Instant) -> Vec<Action<u32>> {
    p.handle(PolicyEvent::Heard { peer, step: s }, now)
}

fn weight(p: &mut SyncPolicy<u32>, peer: u32, s: u64, now: Instant) -> Action<u32> {
    let out = p.handle(PolicyEvent::UpdateArrived { peer, step: s }, now);
    assert_eq!(out.len(), 1, "{out:?}");
    out[0].clone()
}

fn apply_weight(a: &Action<u32>) -> f32 {
    match a {
        Action::Apply { weight, .. } => *weight,
        other => panic!("expected Apply, got {other:?}"),
    }
}

#[test]
fn default_config_is_as_documented() {
    let c = PolicyConfig::default();
    assert_eq!(c.publish_every, 20);
    assert_eq!(c.publish_early_ratio, 0.0);
    assert_eq!(c.full_sync_every, 500);
    assert_eq!(c.staleness_bound, None);
    assert_eq!(c.peer_timeout, Duration::from_secs(6));
    assert_eq!(c.stale_after, 100);
    assert_eq!(c.drop_after, None);
}

#[test]
fn publishes_every_h_steps_and_retries_until_published() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            publish_every: 3,
            ..cfg()
        },
        0,
    );
    assert!(step(&mut p, 1, t).is_empty());
    assert!(step(&mut p, 2, t).is_empty());
    assert_eq!(step(&mut p, 3, t), vec![Action::Publish]);
    // Not confirmed: ask again.
    assert_eq!(step(&mut p, 4, t), vec![Action::Publish]);
    assert!(p.handle(PolicyEvent::Published { step: 4 }, t).is_empty());
    assert!(step(&mut p, 5, t).is_empty());
    assert!(step(&mut p, 6, t).is_empty());
    assert_eq!(step(&mut p, 7, t), vec![Action::Publish]);
    assert_eq!(p.step(), 7);
}

#[test]
fn publishes_early_when_pending_update_is_large() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            publish_every: 100,
            publish_early_ratio: 0.1,
            ..cfg()
        },
        10,
    );
    let ev = |s, r| PolicyEvent::Stepped {
        step: s,
        pending_ratio: r,
    };
    assert!(p.handle(ev(11, 0.05), t).is_empty());
    assert!(
        p.handle(ev(12, 0.1), t).is_empty(),
        "must exceed, not equal"
    );
    assert_eq!(p.handle(ev(13, 0.2), t), vec![Action::Publish]);
    assert!(p.handle(PolicyEvent::Published { step: 13 }, t).is_empty());
    assert!(p.handle(ev(14, f64::NAN), t).is_empty());
    // Ratio 0.0 switches the early rule off.
    let mut q = SyncPolicy::<u32>::new(
        PolicyConfig {
            publish_every: 100,
            ..cfg()
        },
        0,
    );
    assert!(q.handle(ev(1, 5.0), t).is_empty());
}

#[test]
fn never_publishes_with_h_zero() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            publish_every: 0,
            publish_early_ratio: 0.01,
            ..cfg()
        },
        0,
    );
    for s in 1..=1000 {
        let out = p.handle(
            PolicyEvent::Stepped {
                step: s,
                pending_ratio: 10.0,
            },
            t,
        );
        assert!(!out.contains(&Action::Publish));
    }
}

#[test]
fn weights_updates_by_neighbourhood_and_staleness() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            stale_after: 10,
            drop_after: Some(20),
            ..cfg()
        },
        0,
    );
    // Empty neighbour set: 1 / (max(0, 1) + 1).
    assert_eq!(apply_weight(&weight(&mut p, 9, 0, t)), 0.5);
    for n in 1..=3 {
        up(&mut p, n, t);
    }
    step(&mut p, 50, t);
    assert_eq!(apply_weight(&weight(&mut p, 1, 50, t)), 0.25);
    assert_eq!(apply_weight(&weight(&mut p, 1, 60, t)), 0.25, "in order");
    assert_eq!(apply_weight(&weight(&mut p, 1, 50, t)), 0.125, "τ = 10");
    let w = apply_weight(&weight(&mut p, 1, 40, t));
    assert!((w - 0.25 / 3.0).abs() < 1e-7, "τ = 20 kept: {w}");
    assert_eq!(
        weight(&mut p, 1, 39, t),
        Action::Drop {
            peer: 1,
            staleness: 21
        }
    );
    // A slower (or faster) sender is not stale: only its own newer news makes it so.
    step(&mut p, 1000, t);
    assert_eq!(
        apply_weight(&weight(&mut p, 1, 61, t)),
        0.25,
        "slower sender"
    );
    // Timed-out neighbours do not count: only 1 (just heard) is live.
    let later = ms(t, 150);
    assert_eq!(p.live_neighbours(later), Vec::<u32>::new());
    assert_eq!(apply_weight(&weight(&mut p, 1, 70, later)), 0.5);
    assert_eq!(p.live_neighbours(later), vec![1]);
    // stale_after 0: no discount.
    let mut q = SyncPolicy::<u32>::new(cfg(), 1000);
    assert_eq!(apply_weight(&weight(&mut q, 1, 0, t)), 0.5);
}

#[test]
fn full_sync_rotates_least_recent_one_at_a_time() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            full_sync_every: 5,
            ..cfg()
        },
        0,
    );
    // No live neighbour: due but nothing to sync with.
    for s in 1..=5 {
        assert!(step(&mut p, s, t).is_empty());
    }
    for n in [3, 1, 2] {
        up(&mut p, n, t);
    }
    assert_eq!(step(&mut p, 6, t), vec![Action::FullSync { peer: 1 }]);
    assert_eq!(p.sync_in_flight(), Some(&1));
    for s in 7..=12 {
        assert!(step(&mut p, s, t).is_empty(), "one in flight");
    }
    // A report about another peer is ignored.
    p.handle(PolicyEvent::SyncFinished { peer: 2, ok: true }, t);
    assert!(step(&mut p, 13, t).is_empty());
    p.handle(PolicyEvent::SyncFinished { peer: 1, ok: true }, t);
    assert_eq!(p.sync_in_flight(), None);
    // 2 and 3 were never synced with: due after a quarter interval (one step), not five.
    assert_eq!(step(&mut p, 14, t), vec![Action::FullSync { peer: 2 }]);
    // Failure: retry on the next step with the next peer.
    p.handle(PolicyEvent::SyncFinished { peer: 2, ok: false }, t);
    assert_eq!(step(&mut p, 15, t), vec![Action::FullSync { peer: 3 }]);
    p.handle(PolicyEvent::SyncFinished { peer: 3, ok: true }, t);
    // Everyone synced once: back to the full interval.
    for s in 16..=19 {
        assert!(step(&mut p, s, t).is_empty());
    }
    // Peer 1 (least recent) has timed out; 2 and 3 are fresh, and 2 past its retry pause:
    // choose 2.
    let later = ms(t, 600);
    heard(&mut p, 2, 0, later);
    heard(&mut p, 3, 0, later);
    assert_eq!(step(&mut p, 20, later), vec![Action::FullSync { peer: 2 }]);
}

#[test]
fn a_returning_neighbour_is_synced_after_a_quarter_interval() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            full_sync_every: 100,
            ..cfg()
        },
        0,
    );
    up(&mut p, 1, t);
    assert_eq!(step(&mut p, 25, t), vec![Action::FullSync { peer: 1 }]);
    p.handle(PolicyEvent::SyncFinished { peer: 1, ok: true }, t);
    for s in 26..=124 {
        assert!(step(&mut p, s, t).is_empty(), "{s}");
    }
    assert_eq!(step(&mut p, 125, t), vec![Action::FullSync { peer: 1 }]);
    p.handle(PolicyEvent::SyncFinished { peer: 1, ok: true }, t);
    // Lost (a partition) and back: its sync history is gone with it.
    p.handle(PolicyEvent::NeighbourDown { peer: 1 }, t);
    up(&mut p, 1, t);
    for s in 126..=149 {
        assert!(step(&mut p, s, t).is_empty(), "{s}");
    }
    assert_eq!(step(&mut p, 150, t), vec![Action::FullSync { peer: 1 }]);
}

/// A node that waits for two neighbours takes no step until two train (a connected one
/// still downloading its state counts not), then never waits again, though one dies.
#[test]
fn the_first_step_waits_for_neighbours_that_train_and_only_once() {
    let t = Instant::now();
    let mut p = SyncPolicy::new(
        PolicyConfig {
            wait_for_neighbours: 2,
            ..cfg()
        },
        0,
    );
    assert!(p.handle(PolicyEvent::Tick, t).contains(&Action::Hold));
    assert_eq!(p.step_limit(t), Some(0), "no step before two neighbours");
    up(&mut p, 1, t);
    up(&mut p, 2, t);
    assert_eq!(p.step_limit(t), Some(0), "connected is not training");
    heard(&mut p, 1, 0, ms(t, 10));
    assert_eq!(p.step_limit(ms(t, 10)), Some(0), "one of two");
    assert_eq!(heard(&mut p, 2, 0, ms(t, 20)), vec![Action::Resume]);
    assert_eq!(p.step_limit(ms(t, 20)), None);
    assert!(!p.is_held());
    // Neighbour 2 dies: the node trains on.
    assert!(p
        .handle(PolicyEvent::NeighbourDown { peer: 2 }, ms(t, 30))
        .is_empty());
    assert_eq!(step(&mut p, 5, ms(t, 40)), vec![]);
    assert_eq!(p.step_limit(ms(t, 500)), None);
    // More neighbours than can ever be heard: held at its step, nothing overflows.
    let mut never = SyncPolicy::<u32>::new(
        PolicyConfig {
            wait_for_neighbours: usize::MAX,
            ..cfg()
        },
        u64::MAX,
    );
    assert_eq!(
        never.handle(PolicyEvent::NeighbourUp { peer: 1 }, t),
        vec![Action::Hold]
    );
    heard(&mut never, 1, u64::MAX, t);
    assert_eq!(never.step_limit(t), Some(u64::MAX));
    // Without the setting nothing waits.
    let mut alone = SyncPolicy::<u32>::new(cfg(), 0);
    assert!(alone.handle(PolicyEvent::Tick, t).is_empty());
    assert_eq!(alone.step_limit(t), None);
}

#[test]
fn ssp_holds_once_and_resumes_when_slowest_catches_up() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            staleness_bound: Some(5),
            ..cfg()
        },
        10,
    );
    up(&mut p, 1, t);
    up(&mut p, 2, t);
    up(&mut p, 3, t); // never heard: unknown, must not hold us.
    assert!(heard(&mut p, 1, 10, t).is_empty());
    assert!(heard(&mut p, 2, 12, t).is_empty());
    assert_eq!(p.lead_over_slowest(t), Some(0));
    for s in 11..=14 {
        assert!(step(&mut p, s, t).is_empty());
        assert!(!p.is_held());
    }
    assert_eq!(step(&mut p, 15, t), vec![Action::Hold]);
    assert!(p.is_held());
    assert_eq!(p.lead_over_slowest(t), Some(5));
    assert!(p.handle(PolicyEvent::Tick, t).is_empty(), "Hold only once");
    assert!(heard(&mut p, 2, 30, t).is_empty(), "2 was not the slowest");
    assert!(heard(&mut p, 1, 9, t).is_empty(), "reordered old news");
    assert_eq!(heard(&mut p, 1, 11, t), vec![Action::Resume]);
    assert!(!p.is_held());
    assert!(heard(&mut p, 1, 12, t).is_empty(), "Resume only once");
}

#[test]
fn ssp_hold_released_by_neighbour_down() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            staleness_bound: Some(3),
            ..cfg()
        },
        0,
    );
    up(&mut p, 1, t);
    up(&mut p, 2, t);
    heard(&mut p, 1, 0, t);
    heard(&mut p, 2, 2, t);
    step(&mut p, 1, t);
    step(&mut p, 2, t);
    assert_eq!(step(&mut p, 3, t), vec![Action::Hold]);
    assert_eq!(
        p.handle(PolicyEvent::NeighbourDown { peer: 1 }, t),
        vec![Action::Resume]
    );
    assert_eq!(p.lead_over_slowest(t), Some(1));
    // A new slow neighbour holds us as soon as its step is known.
    up(&mut p, 4, t);
    assert!(!p.is_held());
    assert_eq!(heard(&mut p, 4, 0, t), vec![Action::Hold]);
}

#[test]
fn ssp_hold_released_by_timeout() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            staleness_bound: Some(2),
            ..cfg()
        },
        0,
    );
    up(&mut p, 1, t);
    up(&mut p, 2, t);
    heard(&mut p, 1, 0, t);
    heard(&mut p, 2, 1, t);
    step(&mut p, 1, t);
    assert_eq!(step(&mut p, 2, t), vec![Action::Hold]);
    // 2 keeps talking and stepping, 1 falls silent.
    assert!(heard(&mut p, 2, 2, ms(t, 60)).is_empty());
    assert!(p.handle(PolicyEvent::Tick, ms(t, 100)).is_empty());
    assert_eq!(
        p.handle(PolicyEvent::Tick, ms(t, 101)),
        vec![Action::Resume]
    );
    assert_eq!(p.live_neighbours(ms(t, 101)), vec![2]);
    assert!(step(&mut p, 3, ms(t, 101)).is_empty());
    // 1 comes back, a step further but still slow: hold again.
    assert_eq!(heard(&mut p, 1, 1, ms(t, 102)), vec![Action::Hold]);
    // Everyone silent: nobody known and live, so no hold.
    assert_eq!(
        p.handle(PolicyEvent::Tick, ms(t, 500)),
        vec![Action::Resume]
    );
    assert_eq!(p.lead_over_slowest(ms(t, 500)), None);
}

#[test]
fn a_neighbour_claiming_the_same_step_forever_stops_holding_after_the_timeout() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            staleness_bound: Some(2),
            ..cfg()
        },
        0,
    );
    up(&mut p, 1, t);
    up(&mut p, 2, t);
    heard(&mut p, 1, 0, t);
    heard(&mut p, 2, 0, t);
    step(&mut p, 1, t);
    assert_eq!(step(&mut p, 2, t), vec![Action::Hold]);
    // 1 keeps heart-beating step 0 (alive, but no progress); 2 advances with us.
    let mut now = t;
    for i in 1..=10u64 {
        now = ms(t, i * 11);
        heard(&mut p, 1, 0, now);
        heard(&mut p, 2, 2, now);
    }
    assert!(p.live_neighbours(now).contains(&1), "still heard from");
    assert!(!p.is_held(), "a claim that never advances holds nobody");
    assert_eq!(p.lead_over_slowest(now), Some(0));
    // Once it advances it counts again.
    assert!(step(&mut p, 3, now).is_empty());
    assert_eq!(heard(&mut p, 1, 1, ms(t, 111)), vec![Action::Hold]);
}

#[test]
fn an_update_header_beyond_a_heartbeat_raises_the_known_step_never_lowers_it() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            staleness_bound: Some(5),
            ..cfg()
        },
        10,
    );
    up(&mut p, 1, t);
    // A heartbeat says 0, its update says 40: the update proves the progress.
    heard(&mut p, 1, 0, t);
    assert!(p.is_held());
    p.handle(PolicyEvent::UpdateArrived { peer: 1, step: 40 }, t);
    assert_eq!(p.known_step(&1), Some(40));
    assert!(!p.is_held());
    // A later heartbeat claiming less does not pull it back.
    heard(&mut p, 1, 3, ms(t, 5));
    assert_eq!(p.known_step(&1), Some(40));
    assert!(!p.is_held());
}

#[test]
fn ssp_bound_zero_acts_as_one() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            staleness_bound: Some(0),
            ..cfg()
        },
        5,
    );
    up(&mut p, 1, t);
    assert!(heard(&mut p, 1, 5, t).is_empty(), "equal steps: may step");
    assert_eq!(step(&mut p, 6, t), vec![Action::Hold]);
    assert_eq!(heard(&mut p, 1, 6, t), vec![Action::Resume]);
}

/// Mean mixing gives back `live / (live + 1)` of a published change, so what stays weighs what
/// each live neighbour's change will (`1 / (live + 1)`); adding mixing and a lone node give
/// nothing back.
#[test]
fn mean_mixing_gives_back_the_neighbours_share_of_an_own_change() {
    let t = Instant::now();
    let mean = || {
        SyncPolicy::<u32>::new(
            PolicyConfig {
                mixing: Mixing::Mean,
                ..cfg()
            },
            0,
        )
    };
    let mut p = mean();
    assert_eq!(p.own_change_weight(t), None, "alone");
    up(&mut p, 1, t);
    assert_eq!(p.own_change_weight(t), Some(-0.5));
    let neighbours = |p: &mut SyncPolicy<u32>| match weight(p, 1, 0, t) {
        Action::Apply { weight, .. } => weight,
        other => panic!("{other:?}"),
    };
    assert_eq!(neighbours(&mut p), 0.5);
    up(&mut p, 2, t);
    up(&mut p, 3, t);
    let own = p.own_change_weight(t).expect("neighbours");
    assert!((own + 0.75).abs() < 1e-6, "{own}");
    assert!(
        (1.0 + own - neighbours(&mut p)).abs() < 1e-6,
        "own weighs as a neighbour"
    );
    // A neighbour gone silent no longer counts.
    assert_eq!(
        p.own_change_weight(t + Duration::from_secs(1)),
        None,
        "every neighbour timed out"
    );
    let mut add = SyncPolicy::<u32>::new(cfg(), 0);
    up(&mut add, 1, t);
    assert_eq!(add.own_change_weight(t), None);
}

#[test]
fn odd_inputs_do_not_panic() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            publish_every: 1,
            publish_early_ratio: f64::INFINITY,
            full_sync_every: 1,
            staleness_bound: Some(u64::MAX),
            peer_timeout: Duration::ZERO,
            stale_after: 1,
            drop_after: Some(0),
            mixing: Mixing::Mean,
            wait_for_neighbours: 0,
        },
        u64::MAX,
    );
    up(&mut p, 1, t);
    heard(&mut p, 1, u64::MAX, t);
    p.handle(PolicyEvent::UpdateArrived { peer: 1, step: 0 }, t);
    p.handle(PolicyEvent::Published { step: u64::MAX }, t);
    step(&mut p, 0, t - Duration::from_millis(1));
    step(&mut p, u64::MAX, t);
    p.handle(PolicyEvent::NeighbourDown { peer: 7 }, t);
    p.handle(PolicyEvent::SyncFinished { peer: 7, ok: true }, t);
    p.handle(PolicyEvent::Tick, t);
}

/// A neighbour whose sync did not average is not asked again within the pause, while the
/// others are; a lone one waits out the pause (a joiner far behind its neighbours refused
/// their replies 173 times in a second, lowering their scores at each).
#[test]
fn a_neighbour_whose_sync_failed_waits_out_the_retry_pause() {
    let t = Instant::now();
    let mut p = SyncPolicy::<u32>::new(
        PolicyConfig {
            full_sync_every: 4,
            ..cfg()
        },
        0,
    );
    up(&mut p, 1, t);
    assert_eq!(step(&mut p, 1, t), vec![Action::FullSync { peer: 1 }]);
    p.handle(PolicyEvent::SyncFinished { peer: 1, ok: false }, t);
    let early = t + SYNC_RETRY_PAUSE - Duration::from_millis(1);
    heard(&mut p, 1, 0, early);
    for s in 2..=9 {
        assert!(step(&mut p, s, early).is_empty(), "{s}: within the pause");
    }
    // Another neighbour is asked meanwhile.
    up(&mut p, 2, early);
    assert_eq!(step(&mut p, 10, early), vec![Action::FullSync { peer: 2 }]);
    p.handle(PolicyEvent::SyncFinished { peer: 2, ok: false }, early);
    let after = t + SYNC_RETRY_PAUSE;
    heard(&mut p, 1, 0, after);
    assert_eq!(step(&mut p, 11, after), vec![Action::FullSync { peer: 1 }]);
}
