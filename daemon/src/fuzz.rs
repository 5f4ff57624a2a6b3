//! Fuzz targets for every decoder that reads bytes from a peer or from disk: heartbeats,
//! update frames, bulk requests and responses as the bulk channel's codec reads them (ring
//! hops, state manifests and chunks, parameters), checkpoints a store or a donor offers, and
//! network key files. Structure-aware: each target starts from real messages made by our own
//! encoders and mutates them (bits flipped, bytes overwritten, cut, inserted, spans doubled),
//! so the decoders see hostile bytes deep inside well-formed frames, not only noise at the
//! first byte. Every input must be answered, never panic; what a decoder accepts must encode
//! back to what it read (so nothing a peer sent is taken as something else), and each target
//! must see inputs accepted and refused both (so the mutations reach past the first check
//! and the decoder does refuse). (The update codec's own targets are in
//! `p2ptrain_models::codec`.)
//!
//! A normal test run tries [`CASES`] inputs per target; `P2PTRAIN_FUZZ_SECS=600 cargo test
//! --release -p p2ptrain-daemon fuzz::` keeps each going that long and prints how many it
//! tried.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::io::Cursor;
use libp2p::request_response::Codec as _;
use libp2p::StreamProtocol;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_bytes::ByteBuf;

use crate::checkpoint::{self, HostTensor, Snapshot, StateInfo};
use crate::network::{BulkCodec, BulkLimits};
use crate::wire::{self, BulkRequest, BulkResponse, Heartbeat, RingMessage, StateManifest};

/// Inputs per target in a normal test run.
const CASES: u64 = 20_000;

/// Runs `target` on mutations of `seeds` for [`CASES`] inputs, or for `P2PTRAIN_FUZZ_SECS`
/// seconds when set; returns how many inputs it tried.
fn fuzz(name: &str, seeds: &[Vec<u8>], mut target: impl FnMut(&[u8])) -> u64 {
    let secs: u64 = std::env::var("P2PTRAIN_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(name.bytes().map(u64::from).sum());
    let mut tried = 0u64;
    for seed in seeds {
        target(seed);
        tried += 1;
    }
    loop {
        let done = if secs == 0 {
            tried >= CASES
        } else {
            started.elapsed() >= Duration::from_secs(secs)
        };
        if done {
            break;
        }
        let mut bytes = seeds[rng.random_range(0..seeds.len())].clone();
        for _ in 0..rng.random_range(1..=4) {
            mutate(&mut rng, &mut bytes);
        }
        target(&bytes);
        tried += 1;
    }
    let line = format!(
        "fuzz {name}: {tried} inputs in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    eprintln!("{line}");
    p2ptrain_models::fuzz_report::append(&line);
    tried
}

/// What a target's decoder answered over a run: inputs it accepted and refused. A target whose
/// mutations were all refused tested only the first check; one that refused none tested no
/// check at all.
#[derive(Debug, Default)]
struct Tally {
    accepted: u64,
    refused: u64,
}

impl Tally {
    /// Counts one answer.
    fn count<T, E>(&mut self, answer: &Result<T, E>) {
        match answer {
            Ok(_) => self.accepted += 1,
            Err(_) => self.refused += 1,
        }
    }

    /// Both kinds of answer were seen for mutated inputs (beyond the `seeds`, which every
    /// decoder accepts).
    fn assert_both(&self, target: &str, seeds: usize) {
        let line = format!(
            "fuzz {target}: {} accepted, {} refused",
            self.accepted, self.refused
        );
        eprintln!("{line}");
        p2ptrain_models::fuzz_report::append(&line);
        assert!(
            self.accepted > seeds as u64 && self.refused > 0,
            "{target}: {self:?} ({seeds} seeds): the mutations must reach both answers"
        );
    }
}

/// One mutation: a bit flipped, a byte overwritten (often with a boundary value), the bytes
/// cut, a byte inserted, or a span doubled (a length field that now lies).
fn mutate(rng: &mut StdRng, bytes: &mut Vec<u8>) {
    if bytes.is_empty() {
        bytes.push(rng.random());
        return;
    }
    let at = rng.random_range(0..bytes.len());
    match rng.random_range(0..5) {
        0 => bytes[at] ^= 1 << rng.random_range(0..8),
        1 => bytes[at] = [0x00, 0x7f, 0x80, 0xff, rng.random()][rng.random_range(0..5)],
        2 => bytes.truncate(at),
        3 => bytes.insert(at, rng.random()),
        _ => {
            let end = (at + rng.random_range(1..64)).min(bytes.len());
            let span = bytes[at..end].to_vec();
            bytes.splice(at..at, span);
        }
    }
}

fn protocol() -> StreamProtocol {
    StreamProtocol::new("/p2ptrain/bulk/fuzz")
}

/// The codec every bulk message a peer sends is read with, at the wire's maxima.
fn bulk_codec() -> BulkCodec {
    BulkCodec::new(BulkLimits::default())
}

/// The codec an answer is read with: one that asked for parameters, so it reads any answer
/// up to the wire's maxima (a codec reads an answer only as far as its request allows).
fn asking_codec() -> BulkCodec {
    let mut codec = bulk_codec();
    let mut sink = Cursor::new(Vec::new());
    futures::executor::block_on(codec.write_request(&protocol(), &mut sink, BulkRequest::Params))
        .expect("a request");
    codec
}

fn encode_request(request: BulkRequest) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    futures::executor::block_on(bulk_codec().write_request(&protocol(), &mut out, request))
        .expect("encode a request");
    out.into_inner()
}

fn encode_response(response: BulkResponse) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    futures::executor::block_on(bulk_codec().write_response(&protocol(), &mut out, response))
        .expect("encode a response");
    out.into_inner()
}

#[test]
fn heartbeats() {
    let seeds: Vec<Vec<u8>> = [
        Heartbeat::default(),
        Heartbeat {
            step: 123_456,
            loss: Some(0.25),
            samples_per_sec: 1e4,
            accuracy: Some(0.9),
            ms_per_sample: Some(0.02),
            leaving: true,
            in_rounds: true,
            round: Some(77),
            needs_state: true,
            starting: true,
            seq: 1 << 52,
            accused: Some(libp2p::PeerId::random().to_string()),
            accusations: 3,
        },
    ]
    .iter()
    .map(wire::encode_heartbeat)
    .collect();
    assert!(seeds.iter().all(|s| wire::decode_heartbeat(s).is_ok()));
    let mut tally = Tally::default();
    fuzz("heartbeats", &seeds, |b| {
        let read = wire::decode_heartbeat(b);
        tally.count(&read);
        if let Ok(hb) = read {
            let again = wire::decode_heartbeat(&wire::encode_heartbeat(&hb));
            assert_eq!(again.as_ref().ok(), Some(&hb), "{b:?}");
        }
    });
    tally.assert_both("heartbeats", seeds.len());
}

#[test]
fn update_frames() {
    let seeds = vec![
        wire::encode_update_frame(&wire::UpdateFrame::Inline(&[1, 2, 3, 4, 5, 6, 7, 8])),
        wire::encode_update_frame(&wire::UpdateFrame::Announce {
            hash: [7; 32],
            size: 1 << 20,
            step: 99,
        }),
    ];
    let mut tally = Tally::default();
    fuzz("update_frames", &seeds, |b| {
        let read = wire::decode_update_frame(b);
        tally.count(&read);
        if let Ok(frame) = read {
            // The format is canonical: what was read is exactly what encodes to the input.
            assert_eq!(wire::encode_update_frame(&frame), b, "{frame:?}");
        }
    });
    tally.assert_both("update_frames", seeds.len());
}

fn manifest() -> StateManifest {
    StateManifest {
        hash: ByteBuf::from(vec![1u8; 32]),
        step: 5_000,
        total: 600_000,
        chunk_size: 262_144,
        chunk_hashes: vec![ByteBuf::from(vec![2u8; 32]); 3],
        load: 1,
        cached: vec![ByteBuf::from(vec![3u8; 32])],
    }
}

/// Fuzzes a bulk message reader on mutations of `seeds`: what it accepts must encode back
/// (`encode`) to a message it reads as the same, and it must see inputs both accepted and
/// refused (see [`Tally`]).
fn fuzz_bulk_round_trips<T: Clone + std::fmt::Debug>(
    name: &str,
    seeds: &[Vec<u8>],
    read: impl Fn(&[u8]) -> std::io::Result<T>,
    encode: impl Fn(T) -> Vec<u8>,
) {
    assert!(seeds.iter().all(|s| read(s).is_ok()), "the seeds read back");
    let mut tally = Tally::default();
    fuzz(name, seeds, |b| {
        let answer = read(b);
        tally.count(&answer);
        if let Ok(message) = answer {
            let again = read(&encode(message.clone())).ok();
            assert_eq!(format!("{again:?}"), format!("{:?}", Some(message)));
        }
    });
    tally.assert_both(name, seeds.len());
}

#[test]
fn bulk_requests() {
    let hop = RingMessage {
        round: 12,
        attempt: 1,
        members: 0xdead_beef,
        hop: 2,
        values: ByteBuf::from(0.5f32.to_le_bytes().repeat(16)),
        step: 4_000,
        encoding: crate::wire::ValueEncoding::F32,
        piece: crate::wire::Piece::WHOLE,
    };
    let seeds: Vec<Vec<u8>> = [
        BulkRequest::StateManifest,
        BulkRequest::StateChunk {
            state: ByteBuf::from(vec![9u8; 32]),
            index: 2,
        },
        BulkRequest::Params,
        BulkRequest::Update {
            hash: ByteBuf::from(vec![4u8; 32]),
        },
        BulkRequest::Ring(hop),
    ]
    .into_iter()
    .map(encode_request)
    .collect();
    let read = |b: &[u8]| {
        let mut io = Cursor::new(b.to_vec());
        futures::executor::block_on(bulk_codec().read_request(&protocol(), &mut io))
    };
    fuzz_bulk_round_trips("bulk_requests", &seeds, read, encode_request);
}

#[test]
fn bulk_responses() {
    let seeds: Vec<Vec<u8>> = [
        BulkResponse::StateManifest(manifest()),
        BulkResponse::StateChunk(ByteBuf::from(vec![5u8; 300])),
        BulkResponse::Params {
            step: 10,
            layout: "layout".into(),
            values: ByteBuf::from(vec![6u8; 200]),
        },
        BulkResponse::Update(ByteBuf::from(vec![7u8; 100])),
        BulkResponse::RingTaken,
        BulkResponse::Refused("busy".into()),
    ]
    .into_iter()
    .map(encode_response)
    .collect();
    let read = |b: &[u8]| {
        let mut io = Cursor::new(b.to_vec());
        futures::executor::block_on(asking_codec().read_response(&protocol(), &mut io))
    };
    fuzz_bulk_round_trips("bulk_responses", &seeds, read, encode_response);
}

#[test]
fn checkpoints() {
    let mut tensors = BTreeMap::new();
    tensors.insert(
        "fc0.weight".to_string(),
        HostTensor {
            shape: vec![3, 2],
            values: vec![1.0, -2.0, 3.5, 0.0, 0.25, 8.0],
        },
    );
    tensors.insert(
        "optim.momentum.fc0.weight".to_string(),
        HostTensor {
            shape: vec![3, 2],
            values: vec![0.1; 6],
        },
    );
    let snapshot = Snapshot {
        info: StateInfo {
            run_id: "r".into(),
            config_hash: "c".into(),
            layout_hash: "l".into(),
            model: "mlp-2-3".into(),
            optimizer: "sgd".into(),
            step: 10,
            samples_seen: 320,
            optimizer_steps: 10,
        },
        tensors,
    };
    let (bytes, meta) = checkpoint::encode(&snapshot, 3, 99).expect("encode");
    let mut altered_but_read = 0u64;
    fuzz("checkpoints", &[bytes], |b| {
        if let Ok((read, read_tensors)) = checkpoint::decode(b, &meta.file) {
            // Only what the checksum does not cover may differ: the creation time, shown to
            // operators and never used (a longer run found one altered so).
            if read.info != meta.info || read.id != meta.id || read_tensors != snapshot.tensors {
                altered_but_read += 1;
            }
        }
    });
    assert_eq!(altered_but_read, 0, "altered states read as good");
}

#[test]
fn network_key_files() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("swarm.key");
    let seeds = vec![crate::node::new_psk_file().into_bytes()];
    std::fs::write(&path, &seeds[0]).expect("write the key file");
    assert!(crate::node::read_psk(&path).is_ok(), "the seed reads");
    let mut tally = Tally::default();
    fuzz("network_key_files", &seeds, |b| {
        std::fs::write(&path, b).expect("write the key file");
        let read = crate::node::read_psk(&path);
        tally.count(&read);
        if let Ok(key) = read {
            // The key written out as a key file reads back as the same key (its fingerprint
            // names it in logs).
            std::fs::write(&path, key.to_string()).expect("write the key back");
            let again = crate::node::read_psk(&path).map(|k| k.fingerprint().to_string());
            assert_eq!(again.ok(), Some(key.fingerprint().to_string()), "{b:?}");
        }
    });
    tally.assert_both("network_key_files", seeds.len());
}
