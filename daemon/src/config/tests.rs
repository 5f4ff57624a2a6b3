//! Unit tests of loading, checking and overriding the configuration.

use super::*;

#[test]
fn default_config_is_valid() {
    let c = Config::load(None).expect("default");
    assert_eq!(
        c.model,
        ModelConfig::Mlp {
            widths: vec![64, 128, 10]
        }
    );
    assert_eq!(c.run_id().len(), 16);
}

#[test]
fn relaying_is_on_and_upnp_off_unless_the_config_says_otherwise() {
    let c = Config::load(None).expect("default");
    assert!(c.network.relay_server);
    assert!(!c.network.upnp);
    let text = format!("{DEFAULT_CONFIG_TOML}\n[network]\nrelay_server = false\nupnp = true\n");
    let c = Config::parse(&text, "x.toml", None).expect("parse");
    assert!(!c.network.relay_server);
    assert!(c.network.upnp);
    let bad = format!("{DEFAULT_CONFIG_TOML}\n[network]\nupnp = \"yes\"\n");
    let e = Config::parse(&bad, "x.toml", None)
        .expect_err("must fail")
        .to_string();
    assert!(e.contains("line") && e.contains("boolean"), "{e}");
}

#[test]
fn unknown_key_names_key_and_line() {
    let text = DEFAULT_CONFIG_TOML.replace("[train]", "[train]\nbatchsize = 3");
    let e = Config::parse(&text, "x.toml", None)
        .expect_err("must fail")
        .to_string();
    assert!(e.starts_with("x.toml: line"), "{e}");
    assert!(e.contains("batchsize"), "{e}");
    assert!(!e.contains('\n'));
}

#[test]
fn run_id_covers_model_and_seed_but_not_local_settings() {
    let base = Config::load(None).expect("default");
    let other_seed = Config::parse(
        &DEFAULT_CONFIG_TOML.replace("init_seed = 42", "init_seed = 43"),
        "x",
        None,
    )
    .expect("c");
    let other_threads = Config::parse(
        &DEFAULT_CONFIG_TOML.replace("threads = 1", "threads = 2"),
        "x",
        None,
    )
    .expect("c");
    assert_ne!(base.run_id(), other_seed.run_id());
    assert_eq!(base.run_id(), other_threads.run_id());
}

/// The mode is no part of the run id (a checkpoint stays valid when a run changes mode), but
/// the handshake's sync terms name it and every setting its members must share.
#[test]
fn sync_terms_name_the_mode_and_its_shared_settings_but_not_the_run_id() {
    type Change<'a> = &'a dyn Fn(&mut SyncConfig);
    let with = |change: Change| {
        let mut c = Config::load(None).expect("default");
        change(&mut c.sync);
        c
    };
    let gossip = with(&|_| {});
    let allreduce = with(&|s| s.mode = SyncMode::Allreduce);
    assert_eq!(gossip.run_id(), allreduce.run_id());
    assert_ne!(gossip.sync.shared_terms(), allreduce.sync.shared_terms());
    let terms = |mode: SyncMode, change: Change| {
        with(&|s| {
            s.mode = mode;
            change(s);
        })
        .sync
        .shared_terms()
    };
    let base = |mode| terms(mode, &|_| {});
    let changed: [(SyncMode, Change); 8] = [
        (SyncMode::Gossip, &|s| s.mix = crate::policy::Mixing::Mean),
        (SyncMode::Allreduce, &|s| s.every += 1),
        (SyncMode::Ddp, &|s| s.resync_every += 1),
        (SyncMode::Diloco, &|s| s.inner_steps += 1),
        (SyncMode::Diloco, &|s| s.outer_lr /= 2.0),
        (SyncMode::Diloco, &|s| s.outer_momentum /= 2.0),
        (SyncMode::Diloco, &|s| {
            s.outer_values = crate::wire::ValueEncoding::Int8
        }),
        (SyncMode::Fedavg, &|s| s.local_epochs += 1),
    ];
    for (mode, change) in changed {
        assert_ne!(base(mode), terms(mode, change), "{mode:?}");
    }
    // A node's own pace in gossip is its own business.
    assert_eq!(
        base(SyncMode::Gossip),
        terms(SyncMode::Gossip, &|s| s.publish_every += 1)
    );
}

#[test]
fn widths_must_fit_data() {
    let c = Config::parse(
        &DEFAULT_CONFIG_TOML.replace("[64, 128, 10]", "[784, 128, 10]"),
        "x",
        None,
    )
    .expect("c");
    let split = c.load_data().expect("data");
    let e = c.model_spec(&split).expect_err("must fail").to_string();
    assert!(
        e.contains("model.widths") && e.contains("64 features"),
        "{e}"
    );
}

#[test]
fn shard_is_parsed_checked_and_local() {
    let with = |v: &str| {
        Config::parse(
            &DEFAULT_CONFIG_TOML.replace("threads = 1", &format!("threads = 1\nshard = \"{v}\"")),
            "x",
            None,
        )
    };
    let c = with("1/3").expect("valid");
    assert_eq!(c.train.shard, Some((1, 3)));
    assert_eq!(c.run_id(), Config::load(None).expect("default").run_id());
    for bad in ["3/3", "1/0", "x/2", "2", "-1/2"] {
        let e = with(bad).expect_err(bad).to_string();
        assert!(e.contains("train.shard"), "{bad}: {e}");
    }
}

#[test]
fn partition_needs_a_shard_is_checked_and_local() {
    let with = |shard: Option<&str>, data: &str| {
        let mut text =
            DEFAULT_CONFIG_TOML.replace("split_seed = 1", &format!("split_seed = 1\n{data}"));
        if let Some(k_n) = shard {
            text = text.replace("threads = 1", &format!("threads = 1\nshard = \"{k_n}\""));
        }
        Config::parse(&text, "x", None).and_then(|c| c.check_shard().map(|()| c))
    };
    let c = with(Some("1/3"), "partition = \"by_label\"").expect("valid");
    assert_eq!(c.data.partition, PartitionKind::ByLabel);
    assert_eq!(
        c.data.cut(3, 10),
        data::Partition::ByLabel {
            classes_per_part: 4
        }
    );
    assert_eq!(c.run_id(), Config::load(None).expect("default").run_id());
    let c = with(Some("0/4"), "partition = \"dirichlet\"\nalpha = 0.1").expect("valid");
    assert_eq!(c.data.cut(4, 10), data::Partition::Dirichlet { alpha: 0.1 });
    let c = with(
        Some("0/2"),
        "partition = \"by_label\"\nclasses_per_node = 2",
    )
    .expect("valid");
    assert_eq!(
        c.data.cut(2, 10),
        data::Partition::ByLabel {
            classes_per_part: 2
        }
    );
    for (shard, bad, says) in [
        (None, "partition = \"by_label\"", "train.shard"),
        (
            Some("0/2"),
            "partition = \"by_class\"",
            "expected one of `iid`, `by_label`",
        ),
        (
            Some("0/2"),
            "partition = \"dirichlet\"\nalpha = 0.0",
            "data.alpha",
        ),
        (
            Some("0/2"),
            "partition = \"dirichlet\"\nalpha = nan",
            "data.alpha",
        ),
        (Some("0/2"), "classes_per_node = 0", "classes_per_node"),
    ] {
        let e = with(shard, bad).expect_err(bad).to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

#[test]
fn max_sync_distance_defaults_and_must_lie_between_0_and_1() {
    let with = |v: &str| {
        Config::parse(
            &format!("{DEFAULT_CONFIG_TOML}\n[sync]\nmax_sync_distance = {v}\n"),
            "x",
            None,
        )
    };
    let c = Config::load(None).expect("default");
    assert_eq!(
        c.sync.max_sync_distance,
        crate::sync_guard::DEFAULT_MAX_SYNC_DISTANCE
    );
    assert_eq!(with("0.3").expect("valid").sync.max_sync_distance, 0.3);
    for bad in ["0", "-0.5", "1", "1.5", "nan", "inf"] {
        let e = with(bad).expect_err(bad).to_string();
        assert!(e.contains("sync.max_sync_distance"), "{bad}: {e}");
    }
}

#[test]
fn defaults_come_from_the_section_defaults() {
    let c = Config::load(None).expect("default");
    assert_eq!(c.api, ApiConfig::default());
    assert_eq!(c.api.listen.to_string(), "127.0.0.1:7070");
    assert_eq!(c.network, NetworkConfig::default());
    assert_eq!(c.network.listen[0].to_string(), "/ip4/0.0.0.0/tcp/7471");
    assert_eq!(c.sync, SyncConfig::default());
    assert_eq!(c.debug, DebugConfig::default());
    assert_eq!(c.train.device, DeviceSpec::Cpu);
}

/// A peer id for bootstrap addresses in these tests.
const PEER: &str = "12D3KooWFTqWLHjMu2hJ9xy1wK6oSw5XrYFcFpVGMggvQvJrkf3C";

#[test]
fn typed_values_are_parsed_at_load_and_errors_name_the_key() {
    let with =
        |section: &str| Config::parse(&format!("{DEFAULT_CONFIG_TOML}\n{section}\n"), "x", None);
    let c = with(&format!(
        "[network]\nbootstrap = [\"/ip4/10.0.0.1/tcp/4001/p2p/{PEER}\"]"
    ))
    .expect("valid");
    assert_eq!(
        c.network.bootstrap[0].to_string(),
        format!("/ip4/10.0.0.1/tcp/4001/p2p/{PEER}")
    );
    // An address that names no peer: the node would dial it but never know it found the
    // mesh it meant to join, so it is refused, pointing at the join line that has the id.
    let e = with("[network]\nbootstrap = [\"/ip4/10.0.0.1/tcp/4001\"]")
        .expect_err("no peer id")
        .to_string();
    assert!(
        e.contains("network.bootstrap") && e.contains("/p2p/") && e.contains("names no peer"),
        "{e}"
    );
    for (bad, key) in [
        ("[network]\nlisten = [\"nope\"]", "network.listen"),
        ("[network]\nbootstrap = [\"nope\"]", "network.bootstrap"),
        ("[network]\nallow = [\"nope\"]", "network.allow"),
        ("[sync]\ncodec = \"nope\"", "sync.codec"),
    ] {
        let e = with(bad).expect_err(bad).to_string();
        assert!(e.contains(key) && e.contains("line"), "{bad}: {e}");
    }
    let e = Config::parse(
        &DEFAULT_CONFIG_TOML.replace("device = \"cpu\"", "device = \"tpu\""),
        "x",
        None,
    )
    .expect_err("tpu")
    .to_string();
    assert!(e.contains("train.device") && e.contains("tpu"), "{e}");
}

/// `--sync-mode` cannot leave a config the file alone would be refused as: the sync section's
/// checks run again for the mode the flag picks. Overlap as long as a round is
/// nothing under `gossip` (it ignores both keys), a refused `diloco` once the flag picks it.
#[test]
fn a_sync_mode_given_on_the_command_line_is_checked_with_the_files_sync_settings() {
    let text = format!(
        "{DEFAULT_CONFIG_TOML}\n[sync]\nmode = \"gossip\"\ninner_steps = 4\noverlap_steps = 4\n"
    );
    let c = Config::parse(&text, "x", None).expect("gossip ignores overlap_steps");
    let mut diloco = c.clone();
    let e = diloco
        .apply(&Overrides {
            sync_mode: Some("diloco".into()),
            ..Overrides::default()
        })
        .expect_err("diloco with overlap_steps = inner_steps")
        .to_string();
    assert!(
        e.contains("--sync-mode") && e.contains("sync.overlap_steps"),
        "{e}"
    );
    let mut ddp = c.clone();
    ddp.apply(&Overrides {
        sync_mode: Some("ddp".into()),
        ..Overrides::default()
    })
    .expect("ddp ignores overlap_steps");
}

#[test]
fn overrides_replace_or_extend_as_documented() {
    let text = format!(
        "{DEFAULT_CONFIG_TOML}\n[network]\nbootstrap = [\"/ip4/10.0.0.1/tcp/1/p2p/{PEER}\"]\nlisten = [\"/ip4/0.0.0.0/tcp/5\"]\n"
    );
    let mut c = Config::parse(&text, "x", None).expect("valid");
    c.apply(&Overrides {
        device: Some("cuda".into()),
        threads: Some(3),
        max_steps: Some(7),
        api: Some("127.0.0.1:0".parse().expect("addr")),
        listen: vec!["/ip4/127.0.0.1/tcp/0".into()],
        bootstrap: vec![format!("/ip4/10.0.0.2/tcp/2/p2p/{PEER}")],
        mdns: true,
        psk: Some("k".into()),
        sync_mode: Some("fedavg".into()),
        min_members: Some(3),
        shard: Some("2/5".into()),
        target: Some(0.97),
    })
    .expect("apply");
    assert_eq!(c.sync.mode, SyncMode::Fedavg);
    assert_eq!(c.sync.min_members, 3);
    assert_eq!(c.train.shard, Some((2, 5)));
    assert_eq!(c.train.target, Some(0.97));
    // Federated averaging's round is one epoch over the node's own data, weighted by it.
    let rc = c.sync.rounds(100, 32).expect("rounds");
    assert_eq!((rc.steps, rc.weight), (4, 100.0));
    let bad = c.apply(&Overrides {
        sync_mode: Some("ring".into()),
        ..Overrides::default()
    });
    assert!(
        bad.is_err_and(|e| e
            .to_string()
            .contains("--sync-mode: unknown sync mode \"ring\"")),
        "a bad mode must name the flag and the choices"
    );
    assert_eq!(c.train.device, DeviceSpec::Cuda(0));
    assert_eq!((c.train.threads, c.train.max_steps), (3, 7));
    assert_eq!(c.api.listen.port(), 0);
    let addrs = |v: &[Multiaddr]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    assert_eq!(addrs(&c.network.listen), ["/ip4/127.0.0.1/tcp/0"]);
    assert_eq!(
        addrs(&c.network.bootstrap),
        [
            format!("/ip4/10.0.0.1/tcp/1/p2p/{PEER}"),
            format!("/ip4/10.0.0.2/tcp/2/p2p/{PEER}")
        ]
    );
    assert!(c.network.mdns);
    assert_eq!(c.network.psk.as_deref(), Some(Path::new("k")));

    // No flags: nothing changes.
    let before = c.clone();
    c.apply(&Overrides::default()).expect("apply");
    assert_eq!(c, before);

    for (o, needle) in [
        (
            Overrides {
                device: Some("tpu".into()),
                ..Overrides::default()
            },
            "--device: unknown device \"tpu\"",
        ),
        (
            Overrides {
                threads: Some(0),
                ..Overrides::default()
            },
            "--threads",
        ),
        (
            Overrides {
                min_members: Some(0),
                ..Overrides::default()
            },
            "--min-members",
        ),
        (
            Overrides {
                bootstrap: vec!["nope".into()],
                ..Overrides::default()
            },
            "--bootstrap: \"nope\" is not a multiaddr",
        ),
        (
            Overrides {
                bootstrap: vec!["/ip4/10.0.0.2/tcp/2".into()],
                ..Overrides::default()
            },
            "--bootstrap: \"/ip4/10.0.0.2/tcp/2\" names no peer",
        ),
        (
            Overrides {
                // A relay's circuit with no peer behind it: it names the relay only.
                bootstrap: vec![format!("/ip4/10.0.0.2/tcp/2/p2p/{PEER}/p2p-circuit")],
                ..Overrides::default()
            },
            "/p2p-circuit\" names no peer",
        ),
        (
            Overrides {
                shard: Some("3/3".into()),
                ..Overrides::default()
            },
            "--shard: train.shard must be \"k/n\" with 0 <= k < n",
        ),
    ] {
        let e = c.apply(&o).expect_err(needle).to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn evaluation_on_a_clock_takes_seconds_and_refuses_what_is_not() {
    let at = |secs: &str| {
        let text =
            DEFAULT_CONFIG_TOML.replace("[train]", &format!("[train]\neval_every_secs = {secs}"));
        Config::parse(&text, "x.toml", None)
    };
    assert_eq!(at("2.5").expect("2.5 s").train.eval_every_secs, 2.5);
    assert_eq!(at("0").expect("off").train.eval_every_secs, 0.0);
    for bad in ["-1", "1e30", "nan", "inf"] {
        let e = at(bad).expect_err(bad).to_string();
        assert!(e.contains("train.eval_every_secs"), "{bad}: {e}");
    }
}

#[test]
fn the_text_configs_load_and_a_gpt_needs_text_and_text_a_gpt() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    for name in ["text-gpt.toml", "text-gpt-gpu.toml", "text-gpt2s-gpu.toml"] {
        let c = Config::load(Some(&root.join(name))).expect(name);
        assert!(matches!(c.model, ModelConfig::Gpt(_)), "{name}");
        assert!(matches!(c.schedule, Schedule::Cosine { .. }), "{name}");
        assert_eq!(c.data.source, DataSource::Text);
    }
    let text = std::fs::read_to_string(root.join("text-gpt.toml")).expect("read");
    let c = Config::parse(&text, "t.toml", None).expect("parse");
    let data = c.load_data().expect("the bundled Hamlet");
    assert_eq!(
        c.model_spec(&data).expect("spec").name(),
        "gpt-c64-l4-w128-h4"
    );
    let cases = [
        (
            text.replace("source = \"text\"", "source = \"digits\""),
            "is not text",
        ),
        (
            DEFAULT_CONFIG_TOML.replace("source = \"digits\"", "source = \"text\""),
            "needs model.kind = \"gpt\"",
        ),
        (text.replace("heads = 4", "heads = 3"), "multiple"),
        (
            text.replace("schedule = \"cosine\"", "schedule = \"constant\""),
            "needs optimizer.schedule = \"cosine\"",
        ),
        (
            text.replace("total_steps = 10000", "total_steps = 50"),
            "must exceed warmup_steps",
        ),
        (
            text.replace("[model]", "[model]\nwidths = [1, 2]"),
            "not gpt settings",
        ),
    ];
    for (bad, want) in cases {
        let e = Config::parse(&bad, "t.toml", None)
            .expect_err(want)
            .to_string();
        assert!(e.contains(want), "{e} (wanted {want})");
    }
}

#[test]
fn a_constant_schedule_leaves_the_run_id_as_it_was_and_a_cosine_one_changes_it() {
    let plain = Config::load(None).expect("default");
    let explicit = DEFAULT_CONFIG_TOML.replace("[data]", "schedule = \"constant\"\n\n[data]");
    let explicit = Config::parse(&explicit, "x.toml", None).expect("parse");
    assert_eq!(plain.run_id(), explicit.run_id());
    let cosine = DEFAULT_CONFIG_TOML.replace(
        "[data]",
        "schedule = \"cosine\"\ntotal_steps = 3000\n\n[data]",
    );
    let cosine = Config::parse(&cosine, "x.toml", None).expect("parse");
    assert_ne!(plain.run_id(), cosine.run_id());
}

#[test]
fn ddp_rounds_sum_gradients_every_step_with_a_parameter_round_every_resync_every() {
    let text = format!("{DEFAULT_CONFIG_TOML}\n[sync]\nmode = \"ddp\"\nresync_every = 4\n");
    let c = Config::parse(&text, "x.toml", None).expect("parse");
    assert_eq!(c.sync.mode, SyncMode::Ddp);
    let rc = c.sync.rounds(100, 32).expect("rounds");
    assert_eq!((rc.steps, rc.gradients), (1, Some(4)));
    let kinds: Vec<bool> = (0..6).map(|r| rc.sums_gradients(r)).collect();
    assert_eq!(kinds, [false, true, true, true, false, true]);
    // No gossip in a synchronous mode.
    assert_eq!(c.sync.policy().publish_every, 0);
    // The other synchronous modes sum parameters only.
    let allreduce = format!("{DEFAULT_CONFIG_TOML}\n[sync]\nmode = \"allreduce\"\n");
    let rc = Config::parse(&allreduce, "x.toml", None)
        .expect("parse")
        .sync
        .rounds(100, 32)
        .expect("rounds");
    assert!(!(0..6).any(|r| rc.sums_gradients(r)));
    let bad = format!("{DEFAULT_CONFIG_TOML}\n[sync]\nmode = \"ddp\"\nresync_every = 1\n");
    let e = Config::parse(&bad, "x.toml", None)
        .expect_err("must fail")
        .to_string();
    assert!(e.contains("sync.resync_every"), "{e}");
}

/// The stall timeout reaches the rounds, and one that would abort honest attempts (under a
/// second) or never (not a number) is refused at load.
#[test]
fn the_stall_timeout_is_a_setting_of_whole_seconds_or_more() {
    let with = |v: &str| {
        Config::parse(
            &format!(
                "{DEFAULT_CONFIG_TOML}\n[sync]\nmode = \"allreduce\"\nstall_timeout_secs = {v}\n"
            ),
            "x.toml",
            None,
        )
    };
    let rc = with("2.5")
        .expect("valid")
        .sync
        .rounds(100, 32)
        .expect("rounds");
    assert_eq!(rc.stall_timeout, std::time::Duration::from_millis(2500));
    let default = Config::load(None).expect("default").sync;
    assert_eq!(
        default.stall_timeout_secs,
        crate::mesh_core::rounds::STALL_TIMEOUT.as_secs_f64()
    );
    for bad in ["0.5", "0", "-3", "nan", "inf", "1e9"] {
        let e = with(bad).expect_err(bad).to_string();
        assert!(e.contains("sync.stall_timeout_secs"), "{bad}: {e}");
    }
}

/// The join's wait and deadline and the requests' timeout are settings in range; a deadline
/// of 0 is none; a degree whose subscriptions gossipsub would not take is refused.
#[test]
fn join_and_request_times_are_settings_and_the_degree_is_bounded() {
    let with = |section: &str| {
        Config::parse(
            &format!("{DEFAULT_CONFIG_TOML}\n{section}\n"),
            "x.toml",
            None,
        )
    };
    let c = with("[network]\njoin_wait_secs = 2\njoin_deadline_secs = 0\nrequest_timeout_secs = 5")
        .expect("valid");
    assert_eq!(c.network.join_wait_secs, 2.0);
    assert_eq!(c.network.join_deadline(), None);
    assert_eq!(c.network.request_timeout_secs, 5.0);
    let default = Config::load(None).expect("default").network;
    assert_eq!(
        default.join_deadline(),
        Some(std::time::Duration::from_secs(1800))
    );
    for (bad, key) in [
        ("[network]\njoin_wait_secs = -1", "network.join_wait_secs"),
        (
            "[network]\njoin_deadline_secs = nan",
            "network.join_deadline_secs",
        ),
        (
            "[network]\nrequest_timeout_secs = 0.5",
            "network.request_timeout_secs",
        ),
        (
            "[network]\nrequest_timeout_secs = 1e9",
            "network.request_timeout_secs",
        ),
        ("[sync]\ndegree = 99", "sync.degree"),
    ] {
        let e = with(bad).expect_err(bad).to_string();
        assert!(e.contains(key), "{bad}: {e}");
    }
    assert!(with("[sync]\ndegree = 98").is_ok());
}

#[test]
fn a_target_is_bits_per_byte_for_a_gpt_an_accuracy_otherwise_and_never_out_of_reach() {
    let with = |text: &str, target: &str| {
        Config::parse(
            &text.replace("[train]", &format!("[train]\ntarget = {target}")),
            "x.toml",
            None,
        )
    };
    let gpt = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/text-gpt.toml"),
    )
    .expect("read");
    assert_eq!(with(&gpt, "2.8").expect("bpb").train.target, Some(2.8));
    assert_eq!(
        with(DEFAULT_CONFIG_TOML, "0.97").expect("acc").train.target,
        Some(0.97)
    );
    let e = with(DEFAULT_CONFIG_TOML, "2.8")
        .expect_err("acc > 1")
        .to_string();
    assert!(e.contains("at most 1"), "{e}");
    for bad in ["0", "-1", "nan", "inf"] {
        let e = with(&gpt, bad).expect_err(bad).to_string();
        assert!(e.contains("train.target"), "{bad}: {e}");
    }
    // `--target` is checked alike, and the one rule says what reaches it.
    let mut c = Config::parse(DEFAULT_CONFIG_TOML, "x.toml", None).expect("default");
    let e = c
        .apply(&Overrides {
            target: Some(1.5),
            ..Overrides::default()
        })
        .expect_err("--target 1.5");
    assert!(e.to_string().contains("--target"), "{e}");
}

/// Host names for the control API are bare names, lower or upper case; one written with a
/// port or a scheme is refused at load, not left to never match.
#[test]
fn api_allowed_hosts_are_bare_names() {
    let with = |hosts: &str| format!("{DEFAULT_CONFIG_TOML}\n[api]\nallowed_hosts = {hosts}\n");
    let c = Config::parse(&with(r#"["labbox.lan", "Box2"]"#), "x.toml", None).expect("parse");
    assert_eq!(c.api.allowed_hosts, ["labbox.lan", "Box2"]);
    for bad in [r#"["labbox.lan:7070"]"#, r#"["http://labbox"]"#, r#"[""]"#] {
        let e = Config::parse(&with(bad), "x.toml", None)
            .expect_err("must fail")
            .to_string();
        assert!(e.contains("api.allowed_hosts"), "{bad}: {e}");
    }
}

#[test]
fn the_llama_config_loads_its_text_through_the_tokenizer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let c = Config::load(Some(&root.join("llama-tiny.toml"))).expect("llama-tiny.toml");
    assert!(c.model.is_language_model());
    let data = c.load_data().expect("Hamlet, tokenized");
    let Data::Tokens(tokens) = &data else {
        panic!("a llama's text is tokens");
    };
    // Hamlet's ~174 KB in some 75-90k tokens of this 384-id tokenizer.
    assert!(
        (50_000..120_000).contains(&(tokens.train.tokens() + tokens.test.tokens())),
        "{}",
        tokens.train.tokens()
    );
    let spec = c.model_spec(&data).expect("spec");
    assert_eq!(
        spec.name(),
        "llama-v384-c64-l2-w64-i128-h4-k2-d16-e0.00001-r10000"
    );
    let held_out = data.test();
    let (_, targets) = held_out
        .batch(&[0], &candle_core::Device::Cpu)
        .expect("batch");
    let bytes = held_out
        .target_bytes(&targets)
        .expect("bytes")
        .expect("a table");
    assert!(
        bytes >= 64,
        "64 predicted tokens stand for at least a byte each: {bytes}"
    );
}

/// The committed Hugging Face fixture folder.
fn hf_fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/fixtures/hf-llama-tiny")
}

/// A llama config with `model` as its `[model]` keys, reading Hamlet through the fixture's
/// tokenizer.
fn llama_toml(fixture: &Path, model: &str) -> String {
    format!(
        "[model]\nkind = \"llama\"\n{model}\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n\
         [data]\nsource = \"text\"\ntokenizer = \"{}\"\n",
        fixture.join("tokenizer.json").display()
    )
}

/// `model.hf_digest`, as `p2ptrain init` writes it, names the folder by its digest: the shape
/// is the keys', the run id the one `model.hf` alone gives (the folder's), and no weights are
/// read at load, so a box without the folder (one that joins) loads the config. Where the
/// folder is there, its config.json must have the keys' shape.
#[test]
fn a_llama_named_by_its_folders_digest_has_the_folders_run_id_without_the_folder() {
    let fixture = hf_fixture();
    let toml = |model: &str| llama_toml(&fixture, model);
    let parse = |model: &str| Config::parse(&toml(model), "l.toml", None);
    let hf = format!("hf = \"{}\"", fixture.display());
    let from_folder = parse(&hf).expect("from the folder");
    let ModelConfig::Llama {
        genesis: Some(digest),
        ..
    } = &from_folder.model
    else {
        panic!("a llama from a folder");
    };
    let keys = "vocab = 384\nwidth = 64\nheads = 4\nkv_heads = 2\nlayers = 2\n\
                intermediate = 128\ncontext = 256";
    let named = parse(&format!("{hf}\nhf_digest = \"{digest}\"\n{keys}")).expect("named");
    assert_eq!(named.run_id(), from_folder.run_id());
    assert_eq!(
        named.model.genesis_folder(),
        Some((fixture.as_path(), Some(digest.as_str())))
    );
    let elsewhere = parse(&format!(
        "hf = \"/nonexistent/hf-llama-tiny\"\nhf_digest = \"{digest}\"\n{keys}"
    ))
    .expect("a box without the folder");
    assert_eq!(elsewhere.run_id(), from_folder.run_id());
    // Only config.json is read: a folder without its weights loads named, not alone.
    let tmp = tempfile::tempdir().expect("tmp");
    std::fs::copy(fixture.join("config.json"), tmp.path().join("config.json")).expect("copy");
    let bare = format!("hf = \"{}\"", tmp.path().display());
    parse(&format!("{bare}\nhf_digest = \"{digest}\"\n{keys}")).expect("weights not read");
    assert!(parse(&bare).is_err(), "model.hf alone reads the weights");
    let with_keys = |k: &str| format!("{hf}\nhf_digest = \"{digest}\"\n{k}");
    for (model, needle) in [
        (
            format!("{hf}\nhf_digest = \"0123\"\n{keys}"),
            "is not 16 hex digits".to_string(),
        ),
        (
            with_keys(&keys.replace("layers = 2", "layers = 3")),
            format!("model.layers = 3 here, 2 in {}", fixture.display()),
        ),
        (
            with_keys(&keys.replace("width = 64\n", "")),
            "model.width is required for a llama (or model.hf_digest)".to_string(),
        ),
        (
            with_keys(&format!("{keys}\nrope_theta = 500000.0")),
            "model.rope_theta".to_string(),
        ),
        (
            format!("hf_digest = \"{digest}\"\n{keys}"),
            "model.hf_digest goes with model.hf".to_string(),
        ),
    ] {
        let e = parse(&model).expect_err(&needle).to_string();
        assert!(e.contains(&needle), "{needle}: {e}");
    }
    let gpt = DEFAULT_CONFIG_TOML.replace("[model]", "[model]\nhf_digest = \"0123456789abcdef\"");
    let e = Config::parse(&gpt, "x.toml", None)
        .expect_err("an mlp")
        .to_string();
    assert!(e.contains("model.hf_digest is a llama setting"), "{e}");
}

#[test]
fn a_llama_from_a_hugging_face_folder_takes_its_shape_and_its_digest_joins_the_run_id() {
    let fixture = hf_fixture();
    let toml = |model: &str| llama_toml(&fixture, model);
    let hf = format!("hf = \"{}\"", fixture.display());
    let c = Config::parse(&toml(&hf), "l.toml", None).expect("from the folder");
    let ModelConfig::Llama { spec, genesis, .. } = &c.model else {
        panic!("a llama");
    };
    assert_eq!((spec.vocab, spec.context, spec.kv_heads), (384, 256, 2));
    assert!(genesis.is_some());
    assert_eq!(c.model.genesis_folder(), Some((fixture.as_path(), None)));
    let shorter = Config::parse(&toml(&format!("{hf}\ncontext = 32")), "l.toml", None)
        .expect("a shorter context");
    assert_ne!(shorter.run_id(), c.run_id());
    let drawn = Config::parse(
        &toml("vocab = 384\nwidth = 64\nheads = 4\nkv_heads = 2\nlayers = 2\nintermediate = 128\ncontext = 256"),
        "l.toml",
        None,
    )
    .expect("drawn from the seed");
    assert_ne!(
        drawn.run_id(),
        c.run_id(),
        "the folder's weights are in the run id"
    );
    for (model, needle) in [
        (format!("{hf}\nlayers = 3"), "model.layers: with model.hf"),
        (
            format!("{hf}\ncontext = 100000"),
            "past the folder's max_position_embeddings",
        ),
        (
            "hf = \"/nonexistent/folder\"".to_string(),
            "model.hf: /nonexistent/folder/config.json",
        ),
        (
            "width = 64\nheads = 4".to_string(),
            "model.vocab is required",
        ),
        (
            "vocab = 10\nwidth = 64\nheads = 4\nkv_heads = 3".to_string(),
            "key-value heads",
        ),
    ] {
        let e = Config::parse(&toml(&model), "l.toml", None)
            .expect_err(needle)
            .to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
    // Tokens and tokenizers go with a llama only; a llama reads no labelled set.
    let gpt_with_tokenizer =
        DEFAULT_CONFIG_TOML.replace("[data]", "[data]\ntokenizer = \"t.json\"");
    let e = Config::parse(&gpt_with_tokenizer, "x.toml", None)
        .expect_err("mlp")
        .to_string();
    assert!(
        e.contains("data.tokenizer is for model.kind = \"llama\""),
        "{e}"
    );
    let llama_on_digits = "[model]\nkind = \"llama\"\nvocab = 10\nwidth = 8\nheads = 2\n\
        [optimizer]\nkind = \"sgd\"\nlr = 0.1\n[data]\nsource = \"digits\"\n";
    let e = Config::parse(llama_on_digits, "x.toml", None)
        .expect_err("digits")
        .to_string();
    assert!(e.contains("reads tokens"), "{e}");
    let llama_text_alone = "[model]\nkind = \"llama\"\nvocab = 10\nwidth = 8\nheads = 2\n\
        [optimizer]\nkind = \"sgd\"\nlr = 0.1\n[data]\nsource = \"text\"\n";
    let e = Config::parse(llama_text_alone, "x.toml", None)
        .expect_err("text")
        .to_string();
    assert!(e.contains("data.tokenizer"), "{e}");
    // A key nothing reads with this model and source is refused, not ignored.
    for (config, key) in [
        (
            DEFAULT_CONFIG_TOML.replace("[data]", "[data]\ntoken_bytes = 4"),
            "data.token_bytes",
        ),
        (
            DEFAULT_CONFIG_TOML.replace("[data]", "[data]\neval_tokens = 10"),
            "data.eval_tokens",
        ),
        (
            toml(&hf).replace("[data]", "[data]\neval_bytes = 100"),
            "data.eval_bytes",
        ),
    ] {
        let e = Config::parse(&config, "x.toml", None)
            .expect_err(key)
            .to_string();
        assert!(e.contains(key) && e.contains("not read"), "{key}: {e}");
    }
    let tokens_without_path = "[model]\nkind = \"llama\"\nvocab = 10\nwidth = 8\nheads = 2\n\
        [optimizer]\nkind = \"sgd\"\nlr = 0.1\n[data]\nsource = \"tokens\"\n";
    let e = Config::parse(tokens_without_path, "x.toml", None)
        .expect_err("path")
        .to_string();
    assert!(e.contains("data.path is required"), "{e}");
}

/// `optimizer.clip_grad_norm` and `optimizer.freeze` reach the config and the run id (both
/// change the training); a clip that is not a positive number, or a pattern that names
/// nothing, is refused with the keys named; a config without them keeps its run id and hash.
#[test]
fn gradient_clipping_and_freezing_are_read_checked_and_in_the_run_id() {
    let base = Config::load(None).expect("default");
    let with = |extra: &str| {
        Config::parse(
            &DEFAULT_CONFIG_TOML.replace("[optimizer]", &format!("[optimizer]\n{extra}")),
            "x.toml",
            None,
        )
    };
    let clipped = with("clip_grad_norm = 1.0").expect("clip");
    assert_eq!(clipped.gradients.clip_norm, Some(1.0));
    assert_ne!(clipped.run_id(), base.run_id());
    let frozen = with("freeze = [\"layers.0.*\"]").expect("freeze");
    assert_eq!(frozen.gradients.freeze, ["layers.0.*"]);
    assert_ne!(frozen.run_id(), base.run_id());
    assert_ne!(frozen.run_id(), clipped.run_id());
    let listed = with("freeze = [\"b\", \"a\", \"b\"]").expect("listed");
    let sorted = with("freeze = [\"a\", \"b\"]").expect("sorted");
    assert_eq!(listed.gradients.freeze, ["a", "b"]);
    assert_eq!(
        listed.run_id(),
        sorted.run_id(),
        "order and repeats change nothing"
    );
    let nothing = with("freeze = []").expect("empty");
    assert_eq!(nothing.run_id(), base.run_id());
    assert_eq!(nothing.config_hash(), base.config_hash());
    for bad in [
        "clip_grad_norm = 0.0",
        "clip_grad_norm = -1.0",
        "clip_grad_norm = inf",
        "freeze = [\"*\"]",
        "freeze = [\"\"]",
    ] {
        let e = with(bad).expect_err(bad).to_string();
        assert!(
            e.contains("optimizer.clip_grad_norm / optimizer.freeze"),
            "{bad}: {e}"
        );
    }
}

/// A tokenizer with more ids than the llama's vocabulary is refused when the data loads, the
/// file and both counts named (the fixture's tokenizer has 384 ids).
#[test]
fn a_tokenizer_past_the_llamas_vocabulary_is_refused() {
    let tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/fixtures/hf-llama-tiny/tokenizer.json");
    let text = format!(
        "[model]\nkind = \"llama\"\nvocab = 100\ncontext = 16\nwidth = 8\nlayers = 1\nheads = 2\n\
         intermediate = 16\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n\
         [data]\nsource = \"text\"\ntokenizer = \"{}\"\n",
        tokenizer.display()
    );
    let config = Config::parse(&text, "x.toml", None).expect("config");
    let e = config.load_data().expect_err("too many ids").to_string();
    assert!(
        e.contains("has 384 ids, past the model's vocabulary of 100"),
        "{e}"
    );
}

/// The keys `configs/reference.toml` names in its main part, by section: each `key = ...`
/// line, commented out (`# key = ...`) or not, under a `[section]`, up to its first
/// `# ---- sync mode:` block (the blocks repeat `[sync]` keys, one block per mode).
fn documented_keys() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/reference.toml");
    let text = std::fs::read_to_string(&path).expect("configs/reference.toml");
    let mut keys: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with("# ---- sync mode:") {
            break;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_string();
            continue;
        }
        let line = line.strip_prefix('#').map_or(line, str::trim_start);
        let Some((key, _)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        let is_key = !key.is_empty()
            && key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if is_key && !section.is_empty() {
            keys.entry(section.clone())
                .or_default()
                .insert(key.to_string());
        }
    }
    keys
}

/// The keys the code reads in `section`, from serde's own list: the error for an unknown key
/// names every expected field.
fn code_keys(section: &str) -> std::collections::BTreeSet<String> {
    let mut table: toml::Table = toml::from_str(DEFAULT_CONFIG_TOML).expect("default");
    table
        .entry(section)
        .or_insert_with(|| toml::Value::Table(Default::default()))
        .as_table_mut()
        .expect("a section")
        .insert("zz_probe".into(), toml::Value::Integer(1));
    let text = toml::to_string(&table).expect("toml");
    let error = Config::parse(&text, "probe.toml", None)
        .expect_err("an unknown key")
        .to_string();
    // serde says "expected `a`", "expected `a` or `b`" or "expected one of `a`, `b`, ...".
    let expected = error
        .split_once("unknown field `zz_probe`, expected")
        .map(|(_, list)| list)
        .unwrap_or_else(|| panic!("[{section}]: no list of expected keys in {error:?}"));
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

#[test]
fn the_configuration_reference_names_every_key_the_code_reads_and_no_other() {
    let documented = documented_keys();
    let sections = [
        "model",
        "optimizer",
        "data",
        "train",
        "checkpoint",
        "api",
        "network",
        "sync",
        "debug",
    ];
    let mut wrong = Vec::new();
    for section in sections {
        let code = code_keys(section);
        assert!(
            code.len() >= 2,
            "[{section}]: read {code:?} off serde's error"
        );
        let docs = documented.get(section).cloned().unwrap_or_default();
        for key in code.difference(&docs) {
            wrong.push(format!(
                "[{section}] {key}: read by the code, not in configs/reference.toml"
            ));
        }
        for key in docs.difference(&code) {
            wrong.push(format!(
                "[{section}] {key}: in configs/reference.toml, not read by the code"
            ));
        }
    }
    let unknown: Vec<&String> = documented
        .keys()
        .filter(|s| !sections.contains(&s.as_str()))
        .collect();
    assert!(unknown.is_empty(), "sections the code has not: {unknown:?}");
    assert!(
        wrong.is_empty(),
        "configs/reference.toml and the config code disagree:\n{}",
        wrong.join("\n")
    );
}

/// `sync.overlap_steps` is `diloco`'s: there it must stay under `inner_steps` (a member
/// trains on at most until its next round); the other modes take no rounds it could overlap
/// and pass it to nothing.
#[test]
fn an_overlap_as_long_as_the_round_is_refused_in_diloco_only() {
    let sync = |mode: &str, overlap: u64| {
        let text = format!(
            "{DEFAULT_CONFIG_TOML}\n[sync]\nmode = \"{mode}\"\ninner_steps = 10\noverlap_steps = {overlap}\n"
        );
        Config::parse(&text, "x.toml", None)
    };
    let e = sync("diloco", 10).expect_err("10 of 10").to_string();
    assert!(e.contains("sync.overlap_steps"), "{e}");
    let rounds = |c: Config| c.sync.rounds(640, 32).map(|r| r.overlap_steps);
    assert_eq!(rounds(sync("diloco", 9).expect("9 of 10")), Some(9));
    assert_eq!(rounds(sync("allreduce", 10).expect("allreduce")), Some(0));
}

/// A shipped config runs from a fresh clone, or its first line says what it needs: every file
/// it reads (data, a tokenizer) lies inside the checkout or is named there, and a GPU config
/// says it needs a `cuda` build.
#[test]
fn every_shipped_config_runs_from_a_fresh_clone_or_says_first_what_it_needs() {
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("checkout");
    let mut read = 0;
    for entry in std::fs::read_dir(checkout.join("configs")).expect("configs") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        read += 1;
        let name = path.display().to_string();
        let text = std::fs::read_to_string(&path).expect("read");
        let first = text.lines().next().unwrap_or_default();
        let c = Config::load(Some(&path)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let files = [&c.data.path, &c.data.dir, &c.data.tokenizer];
        for file in files.into_iter().flatten() {
            // Lexically: the file may be absent here (CI has the shared data, a user may not).
            let inside = file.components().fold(Vec::new(), |mut at, part| {
                match part {
                    std::path::Component::ParentDir => {
                        at.pop();
                    }
                    std::path::Component::CurDir => {}
                    other => at.push(other.as_os_str().to_owned()),
                }
                at
            });
            let resolved: PathBuf = inside.iter().collect();
            if !resolved.starts_with(&checkout) {
                let shown = file
                    .file_name()
                    .and_then(|f| f.to_str())
                    .unwrap_or_default();
                assert!(
                    first.starts_with("# Needs:") && first.contains(shown),
                    "{name} reads {} outside the checkout; its first line must say so (\"# Needs: ... {shown} ...\"), not {first:?}",
                    file.display()
                );
            }
        }
        if c.train.device != crate::device::DeviceSpec::Cpu {
            assert!(
                first.starts_with("# Needs:") && first.contains("cuda"),
                "{name} trains on a GPU; its first line must say it needs a `cuda` build, not {first:?}"
            );
        }
    }
    assert!(read >= 9, "read {read} configs");
}

/// `configs/` of the checkout, where the configuration reference lies.
fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

/// The text of `configs/reference.toml`.
fn reference_text() -> String {
    std::fs::read_to_string(configs_dir().join("reference.toml")).expect("configs/reference.toml")
}

/// The reference's `[sync]` blocks, one per sync mode: each mode's name (from its
/// `# ---- sync mode: NAME ----` marker) and its lines up to `# ---- end ----`, each without
/// its leading `# ` (a line of `#` alone becomes empty).
fn reference_sync_blocks(text: &str) -> Vec<(String, Vec<String>)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, Vec<String>)> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if let Some(rest) = line.strip_prefix("# ---- sync mode:") {
            assert!(open.is_none(), "a block opens inside another: {line:?}");
            let mode = rest.trim().trim_end_matches('-').trim();
            open = Some((mode.to_string(), Vec::new()));
        } else if line == "# ---- end ----" {
            let block = open.take().expect("a `# ---- end ----` without its block");
            blocks.push(block);
        } else if let Some((mode, lines)) = open.as_mut() {
            let bare = if line == "#" {
                ""
            } else {
                line.strip_prefix("# ").unwrap_or_else(|| {
                    panic!("a line of the {mode} block that is not commented out: {line:?}")
                })
            };
            lines.push(bare.to_string());
        }
    }
    assert!(open.is_none(), "a block without its `# ---- end ----`");
    blocks
}

/// `text` with its `[sync]` table (from the `[sync]` line to the next table's header, or the
/// end) replaced by `block`.
fn with_sync_table(text: &str, block: &[String]) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim() == "[sync]")
        .expect("a [sync] table");
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.trim_start().starts_with('['))
        .map_or(lines.len(), |n| start + 1 + n);
    let mut out: Vec<String> = lines[..start].iter().map(|l| l.to_string()).collect();
    out.extend(block.iter().cloned());
    out.extend(lines[end..].iter().map(|l| l.to_string()));
    out.join("\n") + "\n"
}

/// Each mode's block, put in place of the reference's `[sync]` table, is a config the code
/// accepts, in that mode: what a later per-mode sync type must still read.
#[test]
fn every_sync_mode_block_of_the_reference_parses_as_a_config_of_its_own() {
    let configs = configs_dir();
    let text = reference_text();
    let blocks = reference_sync_blocks(&text);
    let mut found: Vec<&str> = Vec::new();
    for (mode, block) in &blocks {
        assert_eq!(
            block.first().map(String::as_str),
            Some("[sync]"),
            "the {mode} block must start with its [sync] header"
        );
        let config_text = with_sync_table(&text, block);
        let c = Config::parse(&config_text, "reference.toml", Some(configs.as_path()))
            .unwrap_or_else(|e| panic!("the {mode} block of configs/reference.toml: {e}"));
        assert_eq!(
            c.sync.mode.name(),
            mode.as_str(),
            "the {mode} block's sync.mode"
        );
        found.push(mode.as_str());
    }
    found.sort_unstable();
    assert_eq!(
        found,
        ["allreduce", "ddp", "diloco", "fedavg", "gossip"],
        "configs/reference.toml must hold one [sync] block per sync mode"
    );
}

/// The reference is a config as it is: the default run (an MLP on the bundled digits, with
/// gossip), with the default config's run id.
#[test]
fn the_reference_loads_as_it_is() {
    let path = configs_dir().join("reference.toml");
    let c = Config::load(Some(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(c.sync.mode, SyncMode::Gossip);
    let default = Config::load(None).expect("default");
    assert_eq!(
        c.run_id(),
        default.run_id(),
        "configs/reference.toml trains the default run"
    );
}

/// A fixed neighbour weight contradicts mean mixing, which weighs every change by the
/// neighbourhood's size: refused naming both keys; with `add` it is taken.
#[test]
fn a_fixed_update_weight_needs_adding_mixing() {
    let text = format!("{DEFAULT_CONFIG_TOML}\n[sync]\nmix = \"mean\"\nupdate_weight = 1.0\n");
    let e = Config::parse(&text, "x", None)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("sync.update_weight") && e.contains("sync.mix"),
        "{e}"
    );
    let text = format!("{DEFAULT_CONFIG_TOML}\n[sync]\nmix = \"add\"\nupdate_weight = 1.0\n");
    Config::parse(&text, "x", None).expect("add takes a fixed weight");
}
