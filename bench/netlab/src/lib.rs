//! A small network lab: hosts in network namespaces the lab creates, each with one veth
//! into a bridge inside a hub namespace of its own. Nothing touches the machine's own
//! interfaces or addresses; the only addresses used are 10.77.0.0/24 inside the lab. Every
//! namespace (and with it every veth and bridge) is deleted when the `Lab` drops.
//!
//! Partitions move hosts' hub-side ports onto a second, unconnected bridge; healing moves them
//! back. Link limits are `tc` queueing disciplines on each host's interface: `tbf` for rate,
//! plus `netem` delay and loss where the kernel has netem (many CI kernels have not).
//!
//! A host can be put behind a NAT ([`Lab::behind_nat`]): its namespace becomes a home router
//! (keeping the lab address as its public side, masquerading with `iptables`) and a new
//! namespace behind it, on 10.78.<i>.0/24, reaches the lab only through it. Lab hosts have no
//! route to those private networks, so nothing can dial in: as behind a real home router.
//!
//! The fault tests use it for partitions and NATs; `p2ptrain bench scaling --link` for slow links.
//! Building a lab needs root and `ip` (and `tc`, `iptables` for what uses them). A process
//! killed before the lab drops leaves its namespaces (`p2pt<pid>x<n>...`) behind;
//! `ip netns list` shows them and `ip netns del NAME` removes them. A process stopping on a
//! signal, whose labs will never drop, calls [`remove_labs_of`] with its own pid first.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

static LABS: AtomicUsize = AtomicUsize::new(0);
/// Held while namespaces are being made, so [`remove_labs_of`] never sweeps a lab half built
/// (and then misses the namespaces made after its sweep).
static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn making() -> std::sync::MutexGuard<'static, ()> {
    MAKING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a NAT router does with a connection from outside that matches none of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Firewall {
    /// Drops it silently, like most home routers' firewalls: TCP hole punching can work.
    Drop,
    /// Answers with a reset, also to a SYN that crosses one of its own host's on the way out:
    /// no hole punch can work. (Without a rule, Linux resets only a SYN that matches no
    /// connection; two SYNs that cross in flight match each other's and a punch succeeds, which
    /// on the lab's near-zero latency happened only now and then.)
    Reset,
}

/// A lab of `n` hosts; see the module docs.
pub struct Lab {
    hub: String,
    hosts: Vec<String>,
    /// Namespaces behind NATs, deleted with the lab.
    private: Vec<String>,
}

/// Why a lab, or a change to it, could not be made here.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// Network namespaces need root.
    #[error("network namespaces need root")]
    NotRoot,
    /// A tool could not be started (not installed).
    #[error("cannot run {program}: {source}")]
    Missing {
        /// The tool.
        program: String,
        /// Why it did not start.
        source: std::io::Error,
    },
    /// A tool ran and refused.
    #[error("{command}: {stderr}")]
    Refused {
        /// The command line.
        command: String,
        /// What it said.
        stderr: String,
    },
    /// `iptables` is absent, so no NAT can be built.
    #[error("no iptables for the NAT ({0}); `apt-get install iptables` provides it")]
    NoIptables(Box<LabError>),
}

/// Runs `ip`/`tc`/`iptables` with arguments; the error carries its stderr if it fails.
fn run(program: &str, args: &[&str]) -> Result<(), LabError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| LabError::Missing {
            program: program.into(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(LabError::Refused {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

impl Lab {
    /// Builds the lab, or says why it cannot be built here (not root, no `ip`, namespaces
    /// refused), so the caller can skip with that reason.
    pub fn new(n: usize) -> Result<Lab, LabError> {
        let uid = Command::new("id")
            .arg("-u")
            .output()
            .map_err(|source| LabError::Missing {
                program: "id".into(),
                source,
            })?;
        if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
            return Err(LabError::NotRoot);
        }
        let _making = making();
        let tag = format!(
            "p2pt{}x{}",
            std::process::id(),
            LABS.fetch_add(1, Ordering::SeqCst)
        );
        let mut lab = Lab {
            hub: format!("{tag}hub"),
            hosts: Vec::new(),
            private: Vec::new(),
        };
        run("ip", &["netns", "add", &lab.hub])?;
        for br in ["br0", "br1"] {
            run("ip", &["-n", &lab.hub, "link", "add", br, "type", "bridge"])?;
            run("ip", &["-n", &lab.hub, "link", "set", br, "up"])?;
        }
        for i in 0..n {
            let ns = format!("{tag}h{i}");
            run("ip", &["netns", "add", &ns])?;
            lab.hosts.push(ns.clone());
            let port = format!("p{i}");
            run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            run(
                "ip",
                &[
                    "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                    "netns", &lab.hub,
                ],
            )?;
            let cidr = format!("{}/24", lab.addr(i));
            run("ip", &["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
            run(
                "ip",
                &["-n", &lab.hub, "link", "set", &port, "master", "br0"],
            )?;
            run("ip", &["-n", &lab.hub, "link", "set", &port, "up"])?;
        }
        Ok(lab)
    }

    /// Makes host `i` a NAT router and returns the namespace of a new host behind it (at
    /// [`Lab::private_addr`]), or why that cannot be done here (no `iptables`, or its nat
    /// table refused), so the caller can skip with that reason.
    pub fn behind_nat(&mut self, i: usize, firewall: Firewall) -> Result<String, LabError> {
        let _making = making();
        let router = self.hosts[i].clone();
        run("iptables", &["--version"]).map_err(|e| LabError::NoIptables(Box::new(e)))?;
        let ns = format!("{router}nat");
        run("ip", &["netns", "add", &ns])?;
        self.private.push(ns.clone());
        run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
        run(
            "ip",
            &[
                "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", "lan0",
                "netns", &router,
            ],
        )?;
        let gateway = format!("10.78.{i}.1");
        run(
            "ip",
            &[
                "-n",
                &router,
                "addr",
                "add",
                &format!("{gateway}/24"),
                "dev",
                "lan0",
            ],
        )?;
        run("ip", &["-n", &router, "link", "set", "lan0", "up"])?;
        let cidr = format!("{}/24", self.private_addr(i));
        run("ip", &["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
        run("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
        run(
            "ip",
            &["-n", &ns, "route", "add", "default", "via", &gateway],
        )?;
        run(
            "ip",
            &[
                "netns",
                "exec",
                &router,
                "sh",
                "-c",
                "echo 1 > /proc/sys/net/ipv4/ip_forward",
            ],
        )?;
        let subnet = format!("10.78.{i}.0/24");
        run(
            "ip",
            &[
                "netns",
                "exec",
                &router,
                "iptables",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                &subnet,
                "-o",
                "eth0",
                "-j",
                "MASQUERADE",
            ],
        )?;
        match firewall {
            Firewall::Drop => run(
                "ip",
                &[
                    "netns", "exec", &router, "iptables", "-A", "INPUT", "-i", "eth0", "-p", "tcp",
                    "--syn", "-j", "DROP",
                ],
            )?,
            // A SYN from outside addressed to the router itself is reset by the kernel; one
            // that conntrack would forward to the host (a crossing SYN of a hole punch) is
            // reset here. Replies to the host's own connections carry ACK, so pass.
            Firewall::Reset => run(
                "ip",
                &[
                    "netns",
                    "exec",
                    &router,
                    "iptables",
                    "-A",
                    "FORWARD",
                    "-i",
                    "eth0",
                    "-p",
                    "tcp",
                    "--syn",
                    "-j",
                    "REJECT",
                    "--reject-with",
                    "tcp-reset",
                ],
            )?,
        }
        Ok(ns)
    }

    /// The address of the host behind host `i`'s NAT.
    pub fn private_addr(&self, i: usize) -> String {
        format!("10.78.{i}.2")
    }

    /// Host `i`'s namespace.
    pub fn ns(&self, i: usize) -> &str {
        &self.hosts[i]
    }

    /// A command that runs `program` on host `i`. `ip netns exec` execs it, so the child's
    /// pid is the program's own and killing the child kills the program.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[i]]).arg(program);
        c
    }

    /// Hosts in the lab.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether the lab has no hosts.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// A listen multiaddr on host `i` with an OS-chosen port.
    pub fn listen(&self, i: usize) -> String {
        format!("/ip4/{}/tcp/0", self.addr(i))
    }

    /// Cuts `side` off from the other hosts (they can still reach each other).
    pub fn partition(&self, side: &[usize]) -> Result<(), LabError> {
        self.attach(side.iter().copied(), "br1")
    }

    /// Joins every host to one bridge again.
    pub fn heal(&self) -> Result<(), LabError> {
        self.attach(0..self.hosts.len(), "br0")
    }

    /// Moves the hub-side ports of `hosts` onto `bridge`.
    fn attach(&self, hosts: impl Iterator<Item = usize>, bridge: &str) -> Result<(), LabError> {
        for i in hosts {
            let port = format!("p{i}");
            run(
                "ip",
                &["-n", &self.hub, "link", "set", &port, "master", bridge],
            )?;
        }
        Ok(())
    }

    /// Whether this kernel has `netem` (delay and loss); checked on a scratch interface.
    pub fn netem_available(&self) -> bool {
        run(
            "ip",
            &[
                "netns", "exec", &self.hub, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                "delay", "1ms",
            ],
        )
        .is_ok()
    }

    /// Limits every host's outgoing link: `rate` with `tbf`, and where netem exists, also
    /// `delay` and `loss_pct` (netem's own rate limit then replaces tbf). Returns a
    /// description of what was applied.
    pub fn shape(&self, rate: &str, delay: &str, loss_pct: &str) -> Result<String, LabError> {
        let netem = self.netem_available();
        for ns in &self.hosts {
            let mut args = vec!["netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0"];
            args.push("root");
            if netem {
                args.extend(["netem", "delay", delay, "loss", loss_pct, "rate", rate]);
            } else {
                args.extend(["tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]);
            }
            run("ip", &args)?;
        }
        Ok(if netem {
            format!("netem rate {rate} delay {delay} loss {loss_pct}")
        } else {
            format!("tbf rate {rate} (no netem in this kernel: no delay or loss added)")
        })
    }
}

/// The namespaces that the labs of process `pid` made and that exist now; an error where
/// `ip netns list` cannot run or fails.
pub fn labs_of(pid: u32) -> std::io::Result<Vec<String>> {
    let prefix = format!("p2pt{pid}x");
    let listed = Command::new("ip").args(["netns", "list"]).output()?;
    if !listed.status.success() {
        return Err(std::io::Error::other(format!(
            "ip netns list: {}",
            String::from_utf8_lossy(&listed.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&prefix))
        .map(String::from)
        .collect())
}

/// Deletes every namespace the labs of process `pid` made, killing what runs in them first
/// (a namespace lives on while a process is in it): for a process stopping on a signal, whose
/// labs will not drop. No lab can be built or extended in this process afterwards (the lock
/// that building takes stays held), so none appears between the sweep and the exit. Best
/// effort; returns the namespaces deleted.
pub fn remove_labs_of(pid: u32) -> Vec<String> {
    std::mem::forget(making());
    let names = labs_of(pid).unwrap_or_default();
    for ns in &names {
        if let Ok(o) = Command::new("ip").args(["netns", "pids", ns]).output() {
            for p in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", p]).output();
            }
        }
        let _ = run("ip", &["netns", "del", ns]);
    }
    names
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self
            .private
            .iter()
            .chain(&self.hosts)
            .chain(std::iter::once(&self.hub))
        {
            let _ = run("ip", &["netns", "del", ns]);
        }
    }
}
