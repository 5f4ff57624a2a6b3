//! The control API's access token, made the way Jupyter makes its own: a random secret
//! created at a node's first start, kept in its data directory (`api.token`, mode 0600), and
//! listed under the user's runtime directory by the address the API serves, so that the CLI
//! run by the same user finds it from `--api` alone and nobody types it. Without it a request
//! is refused even on loopback: any web page the operator opens, and any other user of the
//! box, can reach 127.0.0.1.
//!
//! The runtime listing holds one small file per serving node (`<netns>_<ip>_<port>`: the
//! node's pid and the time its process started, then the token); a node removes its own at a
//! clean stop, and entries of processes no longer alive are pruned whenever a node lists
//! itself. The start time tells a node's process from a later one that was handed the same
//! pid: without it, a dead node's entry named a live process, and its token went to whoever
//! served that address next.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use rand::RngCore;

use crate::atomic_file::{self, Durability};

/// The token's file in a node's data directory.
pub const TOKEN_FILE: &str = "api.token";

/// Overrides where nodes list their tokens for the CLI (default: `$XDG_RUNTIME_DIR/p2ptrain`,
/// else `$HOME/.p2ptrain/run`, else `p2ptrain-run-<uid>` in the temporary folder).
pub const RUNTIME_DIR_ENV: &str = "P2PTRAIN_RUNTIME_DIR";

/// Random bytes in a token (hex-encoded: 64 characters).
const TOKEN_BYTES: usize = 32;

/// The token kept in `data_dir`, created at the first start. A file that holds no usable
/// token (empty, or not one line of printable ASCII) is replaced by a new one.
pub fn load_or_create(data_dir: &Path) -> std::io::Result<String> {
    if let Some(token) = read(data_dir) {
        return Ok(token);
    }
    let path = data_dir.join(TOKEN_FILE);
    if path.exists() {
        tracing::warn!("{} holds no usable token: making a new one", path.display());
    }
    let token = new_token();
    keep(data_dir, &token)?;
    Ok(token)
}

/// Keeps `token` in `data_dir` (a token given with `--api-token` too), so that whatever reads
/// the file (a scrape config, a script, `local`) has the one the node asks for.
pub fn keep(data_dir: &Path, token: &str) -> std::io::Result<()> {
    if read(data_dir).as_deref() == Some(token) {
        return Ok(());
    }
    let path = data_dir.join(TOKEN_FILE);
    atomic_file::write(&path, token.as_bytes(), Some(0o600), Durability::Flushed)
}

/// The token a node keeps in `data_dir`, if it holds a usable one.
pub fn read(data_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(data_dir.join(TOKEN_FILE)).ok()?;
    let token = text.trim();
    is_usable(token).then(|| token.to_string())
}

/// A token is sent in a header: one run of printable ASCII without spaces.
pub fn is_usable(token: &str) -> bool {
    !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic())
}

fn new_token() -> String {
    let mut bytes = [0u8; TOKEN_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// Where nodes list their tokens, if this user has such a place.
fn runtime_dir() -> Option<PathBuf> {
    let from_env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = from_env(RUNTIME_DIR_ENV) {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = from_env("XDG_RUNTIME_DIR") {
        return Some(PathBuf::from(dir).join("p2ptrain"));
    }
    if let Some(home) = from_env("HOME") {
        return Some(PathBuf::from(home).join(".p2ptrain").join("run"));
    }
    // No home (a service account, a bare CI box): the temporary folder, one per user.
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let uid = std::fs::metadata("/proc/self").ok()?.uid();
        Some(std::env::temp_dir().join(format!("p2ptrain-run-{uid}")))
    }
    #[cfg(not(unix))]
    None
}

/// The listing's file for an API address: this boot of this machine (a home directory may be
/// shared between boxes), this process's network namespace (two of a test lab's hosts may
/// serve the same loopback address and port), the address.
fn entry_name(addr: SocketAddr) -> String {
    format!("{}{}_{}", entry_prefix(), addr.ip(), addr.port())
}

/// `<boot id>_<network namespace>_`, where the OS has them (Linux), else empty.
fn entry_prefix() -> String {
    let boot: String = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    let namespace: String = std::fs::read_link("/proc/self/ns/net")
        .map(|link| {
            link.to_string_lossy()
                .chars()
                .filter(char::is_ascii_digit)
                .collect()
        })
        .unwrap_or_default();
    if boot.is_empty() && namespace.is_empty() {
        String::new()
    } else {
        format!("{boot}_{namespace}_")
    }
}

/// A node's entry in the runtime listing; removed when dropped (a clean stop).
#[derive(Debug)]
pub struct Listed {
    path: PathBuf,
}

impl Drop for Listed {
    /// Removes the entry unless a newer node on the same address has written its own.
    fn drop(&mut self) {
        if entry_pid(&self.path) == Some(std::process::id()) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The pid an entry names.
fn entry_pid(path: &Path) -> Option<u32> {
    entry_process(path).map(|(pid, _)| pid)
}

/// The process an entry names: its pid, and the time it started where the entry says (an
/// entry of an older node names its pid alone).
fn entry_process(path: &Path) -> Option<(u32, Option<u64>)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut first = text.lines().next()?.split_whitespace();
    let pid = first.next()?.parse().ok()?;
    let started = match first.next() {
        Some(t) => Some(t.parse().ok()?),
        None => None,
    };
    Some((pid, started))
}

/// When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat`'s 22nd field);
/// `None` where the OS does not say.
fn process_start(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(Path::new("/proc").join(pid).join("stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces or parentheses: the
    // fields after it start at the last ')', with the state (field 3).
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Lists `token` under the address the API serves, for the CLI. A box without a runtime or
/// home directory, or one that cannot be written, only costs the user typing the token (the
/// reason is logged).
pub fn list(addr: SocketAddr, token: &str) -> Option<Listed> {
    list_in(&runtime_dir()?, addr, token)
}

fn list_in(dir: &Path, addr: SocketAddr, token: &str) -> Option<Listed> {
    let listed = (|| -> std::io::Result<Listed> {
        private_dir(dir)?;
        prune(dir);
        let path = dir.join(entry_name(addr));
        let started = process_start("self").map_or(String::new(), |t| format!(" {t}"));
        let text = format!("{}{started}\n{token}\n", std::process::id());
        atomic_file::write(&path, text.as_bytes(), Some(0o600), Durability::Cached)?;
        Ok(Listed { path })
    })();
    listed
        .map_err(|e| {
            tracing::warn!(
                "cannot list the API token under {} for the CLI ({e}); pass it with --api-token",
                dir.display()
            )
        })
        .ok()
}

/// Makes `dir` (mode 0700) or checks the one there: a real folder, not a link, of this user
/// and no one else's (in a shared temporary folder another user could have made it first).
fn private_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let meta = std::fs::symlink_metadata(dir)?;
        let own_uid = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
        let mine = own_uid.is_none_or(|uid| meta.uid() == uid);
        if !meta.is_dir() || !mine {
            return Err(std::io::Error::other(
                "not a folder of this user's (a link, or another user's)",
            ));
        }
        if meta.permissions().mode() & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
        Ok(())
    }
    #[cfg(not(unix))]
    std::fs::create_dir_all(dir)
}

/// Removes the entries of this boot's processes that are gone (a node killed without a clean
/// stop); another box's or boot's entries are left to their own.
fn prune(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = entry_prefix();
    let boot = prefix.split('_').next().unwrap_or("");
    for e in entries.flatten() {
        let ours = e.file_name().to_string_lossy().starts_with(boot);
        if ours && entry_process(&e.path()).is_some_and(|(pid, started)| !alive(pid, started)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether the process an entry names is alive, where the OS says so (`/proc`; else assumed
/// alive): its pid is in use, and where the entry says when it started, by a process that
/// started then (not a later one that was handed the pid).
fn alive(pid: u32, started: Option<u64>) -> bool {
    let proc = Path::new("/proc");
    if !proc.is_dir() {
        return true;
    }
    let pid = pid.to_string();
    if !proc.join(&pid).exists() {
        return false;
    }
    match started {
        Some(t) => process_start(&pid).is_none_or(|now| now == t),
        None => true,
    }
}

/// The token a node serving at `api` (`host:port` or an `http://` URL) listed for this user,
/// if any.
pub fn lookup(api: &str) -> Option<String> {
    lookup_in(&runtime_dir()?, api)
}

fn lookup_in(dir: &Path, api: &str) -> Option<String> {
    let host_port = api
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .split('/')
        .next()?;
    let addrs = host_port.to_socket_addrs().ok()?;
    // A node bound to every address (0.0.0.0 or ::) is listed under that one, which serves
    // an address of this box's only: given another box's, the CLI would hand this node's
    // token to whoever serves that port there.
    let candidates = addrs.flat_map(|addr| {
        let any = match addr {
            SocketAddr::V4(_) => SocketAddr::from(([0, 0, 0, 0], addr.port())),
            SocketAddr::V6(_) => SocketAddr::from(([0u16; 8], addr.port())),
        };
        if is_this_box(addr.ip()) {
            vec![addr, any]
        } else {
            vec![addr]
        }
    });
    candidates.into_iter().find_map(|addr| {
        let path = dir.join(entry_name(addr));
        // An entry of a node that is gone is no one's: whoever serves that address now may
        // be someone else, and must not be handed the old token.
        if !entry_process(&path).is_some_and(|(pid, started)| alive(pid, started)) {
            return None;
        }
        let text = std::fs::read_to_string(&path).ok()?;
        let token = text.lines().nth(1)?.trim();
        is_usable(token).then(|| token.to_string())
    })
}

/// Whether `ip` is one of this box's addresses: loopback, or one a socket can be bound to
/// here (the kernel refuses an address no interface has).
fn is_this_box(ip: IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The token is made once and read back after (a restart keeps it, so the CLI's listing
    /// and a Prometheus scrape config stay valid), it is private to the user, and a file that
    /// holds no usable token is replaced.
    #[test]
    fn a_token_is_made_once_private_and_replaced_when_unusable() {
        let tmp = tempfile::tempdir().expect("tmp");
        let first = load_or_create(tmp.path()).expect("create");
        assert_eq!(first.len(), 2 * TOKEN_BYTES);
        assert!(is_usable(&first));
        assert_eq!(load_or_create(tmp.path()).expect("read"), first);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(tmp.path().join(TOKEN_FILE))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(tmp.path().join(TOKEN_FILE), "two words\n").expect("write");
        let second = load_or_create(tmp.path()).expect("replace");
        assert_ne!(second, first);
        assert!(is_usable(&second));
        assert_ne!(
            load_or_create(tempfile::tempdir().expect("tmp").path()).ok(),
            Some(second)
        );
    }

    /// What a node lists is what the CLI finds from the address alone, in any of the forms a
    /// user writes it; the entry goes at a clean stop, and an entry of a dead process is
    /// pruned by the next node that lists itself.
    #[test]
    fn the_cli_finds_a_listed_token_by_address_until_the_node_stops() {
        let runtime = tempfile::tempdir().expect("tmp");
        let dir = runtime.path().join("p2ptrain");
        let addr: SocketAddr = "127.0.0.1:45123".parse().expect("addr");
        let listed = list_in(&dir, addr, "abc123").expect("listed");
        for form in [
            "127.0.0.1:45123",
            "http://127.0.0.1:45123",
            "http://127.0.0.1:45123/",
        ] {
            assert_eq!(lookup_in(&dir, form).as_deref(), Some("abc123"), "{form}");
        }
        assert_eq!(lookup_in(&dir, "127.0.0.1:45124"), None);
        drop(listed);
        assert_eq!(lookup_in(&dir, "127.0.0.1:45123"), None);
        // A dead process's entry (pid beyond any the kernel hands out) is pruned.
        let stale = dir.join(entry_name("127.0.0.1:45125".parse().expect("addr")));
        std::fs::write(&stale, "4294967295\nold\n").expect("write");
        // A gone node's token is handed to no one, then pruned by the next node listed.
        assert_eq!(lookup_in(&dir, "127.0.0.1:45125"), None);
        // A dead node's entry whose pid the kernel has since handed to another process (here
        // this test's own pid, with another start time) is no one's either.
        let reused = dir.join(entry_name("127.0.0.1:45128".parse().expect("addr")));
        let started = process_start("self").expect("this process's start time");
        std::fs::write(
            &reused,
            format!("{} {}\nolder\n", std::process::id(), started + 1),
        )
        .expect("write");
        assert_eq!(lookup_in(&dir, "127.0.0.1:45128"), None);
        let _other = list_in(&dir, "127.0.0.1:45126".parse().expect("addr"), "def");
        assert!(!stale.exists() || !Path::new("/proc").is_dir());
        assert!(!reused.exists(), "pruned");
        // An entry an older node wrote (its pid alone) still finds its live node.
        let older = dir.join(entry_name("127.0.0.1:45129".parse().expect("addr")));
        std::fs::write(&older, format!("{}\nolden\n", std::process::id())).expect("write");
        assert_eq!(lookup_in(&dir, "127.0.0.1:45129").as_deref(), Some("olden"));
        // A node bound to every address is found by its loopback address, and by no address
        // of another box (here one of TEST-NET-1, no interface's): whoever serves that is not
        // this node. (It was: any host given that port was handed the node's token.)
        let _any = list_in(&dir, "0.0.0.0:45127".parse().expect("addr"), "ghi");
        assert_eq!(lookup_in(&dir, "127.0.0.1:45127").as_deref(), Some("ghi"));
        assert_eq!(lookup_in(&dir, "192.0.2.7:45127"), None);
        assert_eq!(lookup_in(&dir, "http://192.0.2.7:45127/"), None);
        // The listing's folder is the user's alone, and a link in its place is refused.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&dir).expect("dir").permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
            let link = runtime.path().join("link");
            std::os::unix::fs::symlink(runtime.path(), &link).expect("symlink");
            assert!(list_in(&link, "127.0.0.1:45128".parse().expect("addr"), "x").is_none());
        }
    }
}
