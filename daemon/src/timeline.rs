//! The step timeline (`join --timeline FILE`): spans of what the node spends its time on,
//! written as a Chrome trace (the JSON array format that `chrome://tracing`, Perfetto and
//! Speedscope open), one row per part of the node, like Horovod's Timeline.
//!
//! Spans come from wherever the work happens (the trainer thread's forward/backward and
//! optimizer, the mesh actor's encode, publish and validate, the trainer's apply and full-sync
//! average, the checkpoint writer, the state download) through a process-wide recorder, as
//! `tracing` spans reach their global subscriber: a process runs one node, and the span sites
//! are spread over layers that should not each carry a handle for a debugging aid. With no
//! timeline installed a span costs one atomic load.
//!
//! Recording never blocks the thread that records: events go through a bounded channel to a
//! writer thread, and are dropped (and counted) when it is full. The file is bounded too: once
//! it would pass its byte limit the writer closes it, renames it to `FILE.1` (replacing the
//! previous one) and starts `FILE` afresh, so a long run keeps its latest spans in at most
//! twice the limit and cannot fill the disk. Each file is valid JSON once closed (at a
//! rotation or a graceful stop); if the process is killed, the current file lacks its closing
//! bracket, which the trace viewers accept.
//!
//! Timestamps are wall-clock microseconds since the Unix epoch (read once when the timeline
//! starts, then advanced by the monotonic clock), so the traces of several nodes line up in
//! one view as far as their clocks agree.
//!
//! Not `tracing-chrome`: it has no size bound, and would trace every `tracing` span of the
//! daemon rather than these.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Events waiting for the writer, at most; more are dropped.
const QUEUE_CAP: usize = 65_536;
/// The default bound on the file's size.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// The part of the node a span belongs to: one row of the timeline each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The trainer thread: steps, applying updates, averaging.
    Trainer,
    /// The mesh actor: encoding and publishing updates, validating neighbours'.
    Mesh,
    /// The checkpoint writer.
    Checkpoint,
    /// The state download of a joiner.
    Transfer,
}

impl Lane {
    fn id(self) -> u32 {
        match self {
            Lane::Trainer => 1,
            Lane::Mesh => 2,
            Lane::Checkpoint => 3,
            Lane::Transfer => 4,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Lane::Trainer => "trainer",
            Lane::Mesh => "mesh",
            Lane::Checkpoint => "checkpoint",
            Lane::Transfer => "state transfer",
        }
    }

    const ALL: [Lane; 4] = [Lane::Trainer, Lane::Mesh, Lane::Checkpoint, Lane::Transfer];
}

/// One finished span.
#[derive(Debug, Clone, Copy)]
struct Event {
    lane: Lane,
    name: &'static str,
    start_us: u64,
    dur_us: u64,
    /// The training step it belongs to, where there is one.
    step: Option<u64>,
}

/// The installed recorder.
struct Recorder {
    origin: Instant,
    /// Microseconds since the Unix epoch at `origin`.
    origin_unix_us: u64,
    tx: SyncSender<Event>,
    dropped: AtomicU64,
    writer: Mutex<Option<JoinHandle<std::io::Result<Written>>>>,
    path: PathBuf,
}

static RECORDER: OnceLock<Recorder> = OnceLock::new();

/// Why the timeline could not be started.
#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    /// The file could not be created or written.
    #[error("timeline {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// The OS's reason.
        source: std::io::Error,
    },
    /// A timeline is already being written by this process.
    #[error("a timeline is already being written to {0}")]
    AlreadyInstalled(String),
}

/// What the writer wrote, reported when the timeline is closed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    /// Events written, in all files.
    pub events: u64,
    /// Times the file reached its bound and was moved to `FILE.1`.
    pub rotations: u64,
    /// The last file's size.
    pub bytes: u64,
}

/// Where a full timeline file is moved: `FILE.1`.
pub fn rotated_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(".1");
    PathBuf::from(name)
}

/// Starts writing the timeline to `path`, each file at most `max_bytes` (see the module docs
/// for the rotation). Fails if the file cannot be created.
pub fn install(path: &Path, max_bytes: u64) -> Result<(), TimelineError> {
    let file_error = |source| TimelineError::File {
        path: path.display().to_string(),
        source,
    };
    if let Some(r) = RECORDER.get() {
        return Err(TimelineError::AlreadyInstalled(
            r.path.display().to_string(),
        ));
    }
    let out = TraceFile::create(path).map_err(file_error)?;
    let (tx, rx) = sync_channel(QUEUE_CAP);
    let writer = std::thread::Builder::new()
        .name("timeline".into())
        .spawn(move || write_events(out, rx, max_bytes))
        .map_err(file_error)?;
    RECORDER
        .set(Recorder {
            origin: Instant::now(),
            origin_unix_us: unix_us_now(),
            tx,
            dropped: AtomicU64::new(0),
            writer: Mutex::new(Some(writer)),
            path: path.to_path_buf(),
        })
        .map_err(|_| TimelineError::AlreadyInstalled(path.display().to_string()))
}

/// Whether a timeline is being written.
pub fn enabled() -> bool {
    RECORDER.get().is_some()
}

/// A span that is recorded when dropped; see [`span`].
#[must_use = "a span records when it is dropped"]
pub struct Span {
    lane: Lane,
    name: &'static str,
    step: Option<u64>,
    start: Option<Instant>,
}

impl Span {
    /// Sets the training step the span belongs to.
    pub fn at_step(mut self, step: u64) -> Span {
        self.step = Some(step);
        self
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let (Some(start), Some(r)) = (self.start, RECORDER.get()) {
            r.record(self.lane, self.name, start, Instant::now(), self.step);
        }
    }
}

/// A span named `name` on `lane`, from now until the returned guard drops. Costs nothing
/// measurable without a timeline.
pub fn span(lane: Lane, name: &'static str) -> Span {
    Span {
        lane,
        name,
        step: None,
        start: enabled().then(Instant::now),
    }
}

/// Records a span that already happened, from `start` to `end`.
pub fn record(lane: Lane, name: &'static str, start: Instant, end: Instant, step: Option<u64>) {
    if let Some(r) = RECORDER.get() {
        r.record(lane, name, start, end, step);
    }
}

impl Recorder {
    fn record(
        &self,
        lane: Lane,
        name: &'static str,
        start: Instant,
        end: Instant,
        step: Option<u64>,
    ) {
        let event = Event {
            lane,
            name,
            start_us: wall_clock_us(self.origin, self.origin_unix_us, start),
            dur_us: end.saturating_duration_since(start).as_micros() as u64,
            step,
        };
        if let Err(TrySendError::Full(_)) = self.tx.try_send(event) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Microseconds since the Unix epoch now (0 for a clock set before 1970).
fn unix_us_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// `at` in wall-clock microseconds, given the wall clock `origin_unix_us` read at `origin`:
/// monotonic within the process whatever the wall clock does meanwhile.
fn wall_clock_us(origin: Instant, origin_unix_us: u64, at: Instant) -> u64 {
    origin_unix_us.saturating_add(at.saturating_duration_since(origin).as_micros() as u64)
}

/// Closes the timeline: the writer drains what was recorded, ends the JSON and flushes. Spans
/// recorded afterwards are ignored. Returns what was written, or `None` without a timeline
/// (or when it was closed already).
pub fn close() -> Option<std::io::Result<Written>> {
    let r = RECORDER.get()?;
    // A marker the writer stops at: the sender stays alive in the static.
    let _ = r.tx.send(Event {
        lane: Lane::Trainer,
        name: CLOSE,
        start_us: 0,
        dur_us: 0,
        step: None,
    });
    let handle = r.writer.lock().ok()?.take()?;
    let written = handle.join().ok()?;
    let dropped = r.dropped.load(Ordering::Relaxed);
    if dropped > 0 {
        tracing::info!(
            dropped,
            "timeline: events dropped while the writer was behind"
        );
    }
    Some(written)
}

/// The name of the marker that ends the writer.
const CLOSE: &str = "\u{0}close";

/// The metadata that names the process and its rows.
fn header() -> String {
    let pid = std::process::id();
    let mut s = String::from("[\n");
    s.push_str(&format!(
        r#"{{"name":"process_name","ph":"M","pid":{pid},"tid":0,"args":{{"name":"p2ptrain node"}}}}"#
    ));
    for lane in Lane::ALL {
        s.push_str(&format!(
            ",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{},\"args\":{{\"name\":\"{}\"}}}}",
            lane.id(),
            lane.name()
        ));
    }
    s
}

/// One complete event (`"ph":"X"`) as a line of the array, with its leading comma.
fn line(pid: u32, e: &Event) -> String {
    let step = e
        .step
        .map(|s| format!(",\"args\":{{\"step\":{s}}}"))
        .unwrap_or_default();
    format!(
        ",\n{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{}{step}}}",
        e.name,
        e.lane.name(),
        e.start_us,
        e.dur_us,
        e.lane.id()
    )
}

/// The end of the JSON array.
const END: &str = "\n]\n";

/// The file being written: its path, a buffered writer and the bytes in it so far.
struct TraceFile {
    path: PathBuf,
    out: BufWriter<File>,
    bytes: u64,
}

impl TraceFile {
    /// Creates `path` (truncating it) and writes the header.
    fn create(path: &Path) -> std::io::Result<TraceFile> {
        let mut out = BufWriter::new(File::create(path)?);
        let header = header();
        out.write_all(header.as_bytes())?;
        Ok(TraceFile {
            path: path.to_path_buf(),
            out,
            bytes: header.len() as u64,
        })
    }

    /// Ends the JSON and flushes; the file's final size.
    fn close(&mut self) -> std::io::Result<u64> {
        self.out.write_all(END.as_bytes())?;
        self.out.flush()?;
        Ok(self.bytes + END.len() as u64)
    }

    /// Closes this file, moves it to `FILE.1` and starts a fresh `FILE`.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.close()?;
        std::fs::rename(&self.path, rotated_path(&self.path))?;
        *self = TraceFile::create(&self.path)?;
        Ok(())
    }
}

/// The writer thread: appends events until the marker (or every sender is gone), rotating
/// the file before an event would take it past `max_bytes`, then closes the array.
fn write_events(
    mut out: TraceFile,
    rx: Receiver<Event>,
    max_bytes: u64,
) -> std::io::Result<Written> {
    let pid = std::process::id();
    let mut written = Written::default();
    while let Ok(e) = rx.recv() {
        if e.name == CLOSE {
            break;
        }
        let l = line(pid, &e);
        if out.bytes + (l.len() + END.len()) as u64 > max_bytes {
            out.rotate()?;
            written.rotations += 1;
        }
        out.out.write_all(l.as_bytes())?;
        out.bytes += l.len() as u64;
        written.events += 1;
    }
    written.bytes = out.close()?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spans of a trace file, which must be valid JSON within `max` bytes.
    fn spans(path: &Path, max: u64) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(path).expect("read");
        assert!(text.len() as u64 <= max, "{} bytes", text.len());
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).expect("valid json");
        events.into_iter().filter(|e| e["ph"] == "X").collect()
    }

    #[test]
    fn timestamps_are_wall_clock_microseconds_advanced_by_the_monotonic_clock() {
        let origin = Instant::now();
        let unix = unix_us_now();
        let later = origin + std::time::Duration::from_millis(1500);
        assert_eq!(wall_clock_us(origin, unix, later), unix + 1_500_000);
        // Before the origin (a span begun before the timeline was installed): the origin.
        assert_eq!(wall_clock_us(later, unix, origin), unix);
        // Within a second of the system's clock, and after 2020.
        let drift = unix_us_now().abs_diff(wall_clock_us(origin, unix, Instant::now()));
        assert!(drift < 1_000_000, "{drift} µs off the system clock");
        assert!(unix > 1_577_836_800_000_000, "{unix}");
    }

    #[test]
    fn the_writer_rotates_valid_json_files_within_their_bound() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("t.json");
        let out = TraceFile::create(&path).expect("file");
        let (tx, rx) = sync_channel(16);
        let max = 2_000;
        let writer = std::thread::spawn(move || write_events(out, rx, max));
        for i in 0..100u64 {
            let e = Event {
                lane: Lane::Mesh,
                name: "encode",
                start_us: i * 10,
                dur_us: 5,
                step: Some(i),
            };
            tx.send(e).expect("send");
        }
        drop(tx);
        let written = writer.join().expect("join").expect("write");
        assert_eq!(written.events, 100);
        assert!(written.rotations > 0, "{written:?}");
        let (older, newer) = (spans(&rotated_path(&path), max), spans(&path, max));
        assert_eq!(std::fs::metadata(&path).expect("file").len(), written.bytes);
        // The newest spans are kept, in order, with nothing lost at the rotation.
        let last = newer.last().expect("spans");
        assert_eq!(last["args"]["step"], 99);
        let first_newer = newer[0]["args"]["step"].as_u64().expect("step");
        let last_older = older.last().expect("spans")["args"]["step"]
            .as_u64()
            .expect("step");
        assert_eq!(last_older + 1, first_newer);
        assert_eq!(newer[0]["name"], "encode");
        assert_eq!(newer[0]["tid"], Lane::Mesh.id());
    }
}
