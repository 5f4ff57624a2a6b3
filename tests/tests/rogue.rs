//! A rogue peer of the same run, living in the test process: a real libp2p node (the daemon's
//! own network module) that joins through an honest node and publishes whatever the test
//! hands it on its own update topic. It refuses every bulk request, so it never serves a
//! state or a sync.

use std::path::Path;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::PeerId;
use p2ptrain_daemon::mesh::update_topic;
use p2ptrain_daemon::network::{self, BulkResponse, Client, Event, NetConfig};
use p2ptrain_models::codec::{self, Codec, UpdateHeader};
use p2ptrain_models::Layout;

/// See the module docs.
pub struct Rogue {
    /// Its runtime; the network task runs on it between calls.
    pub rt: tokio::runtime::Runtime,
    client: Client,
    /// Its peer id.
    pub id: PeerId,
    /// Its update topic.
    pub topic: String,
    /// The run it claims to belong to.
    pub run_id: String,
    /// The model's parameter layout.
    pub layout: Layout,
    /// Scalar parameters of the model.
    pub numel: usize,
}

impl Rogue {
    /// Joins the mesh of `config` through `bootstrap`.
    pub fn join(config: &Path, bootstrap: &str) -> Rogue {
        let config = p2ptrain_daemon::Config::load(Some(config)).expect("config");
        let run_id = config.run_id();
        let prepared = p2ptrain_daemon::node::prepare(config).expect("prepare");
        let model = p2ptrain_models::Model::new(&prepared.spec, 1, &candle_core::Device::Cpu)
            .expect("model");
        let layout = model.params().layout();
        let numel = model.params().numel();
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let key = Keypair::generate_ed25519();
        let id = key.public().to_peer_id();
        let net_cfg = NetConfig {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().expect("addr")],
            bootstrap: vec![bootstrap.parse().expect("addr")],
            run_id: run_id.clone(),
            mdns: false,
            psk: None,
            allow: None,
            relay_server: false,
            upnp: false,
        };
        let client = rt.block_on(async {
            let (client, mut events, event_loop) =
                network::new(key, &net_cfg).expect("rogue network");
            tokio::spawn(event_loop.run());
            let responder = client.clone();
            tokio::spawn(async move {
                while let Some(ev) = events.recv().await {
                    if let Event::Request { channel, .. } = ev {
                        let _ = responder
                            .respond(channel, BulkResponse::Refused("rogue".into()))
                            .await;
                    }
                }
            });
            client
        });
        Rogue {
            rt,
            client,
            topic: update_topic(&run_id, &id),
            id,
            run_id,
            layout,
            numel,
        }
    }

    /// A header for a dense update of `numel` values at `step`, of run `run`, from this rogue.
    pub fn header(&self, step: u64, run: &str, numel: usize) -> UpdateHeader {
        UpdateHeader {
            run_id: codec::id_bytes(run),
            layout: codec::id_bytes(&self.layout.hash()),
            sender: codec::sender_bytes(&self.id.to_bytes()),
            base_step: step.saturating_sub(1),
            step,
            codec: Codec::Dense,
            numel: numel as u32,
        }
    }

    /// A well-formed inline update message (as the mesh frames it) of `values` at `step`.
    pub fn update(&self, step: u64, values: &[f32]) -> Vec<u8> {
        inline(self.encode(self.header(step, &self.run_id, self.numel), values))
    }

    /// A well-formed inline top-k update (one value per tensor kept): about a hundred bytes,
    /// so a flood of them is limited by the receiver, not by the wire.
    pub fn tiny_update(&self, step: u64, values: &[f32]) -> Vec<u8> {
        let mut header = self.header(step, &self.run_id, self.numel);
        header.codec = Codec::TopK(codec::ValueFormat::F16);
        inline(
            codec::encode(&header, &self.layout, values, 1e-9)
                .expect("encode")
                .bytes,
        )
    }

    /// Encodes `values` under `header` with the model's layout.
    pub fn encode(&self, header: UpdateHeader, values: &[f32]) -> Vec<u8> {
        codec::encode(&header, &self.layout, values, 1.0)
            .expect("encode")
            .bytes
    }

    /// Publishes once the honest node has subscribed to the rogue's topic (it does when it
    /// makes the rogue a neighbour), retrying for up to a minute.
    pub fn publish_when_heard(&self, msg: Vec<u8>) {
        self.rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while self
                .client
                .publish(self.topic.clone(), msg.clone())
                .await
                .is_err()
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the honest node never subscribed to the rogue"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
    }

    /// Publishes each message, `gap` apart; Err if some could not be (no subscriber left, as
    /// once the rogue is banned).
    pub fn publish_all(&self, msgs: &[Vec<u8>], gap: Duration) -> Result<(), String> {
        self.rt.block_on(async {
            let mut result = Ok(());
            for msg in msgs {
                tokio::time::sleep(gap).await;
                if let Err(e) = self.client.publish(self.topic.clone(), msg.clone()).await {
                    result = Err(e);
                }
            }
            result
        })
    }
}

/// Frames encoded update bytes as an inline update message.
pub fn inline(bytes: Vec<u8>) -> Vec<u8> {
    [vec![b'U'], bytes].concat()
}
