//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod backend;
pub mod fixtures;
pub mod nats;
pub mod torture;
pub mod upgrade;

use std::path::PathBuf;

/// A small deterministic generator (SplitMix64), so failures replay from their seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let out = harness::trace::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Appends `grow` tokens of conversation `conversation`'s own to its prompt `prompt` (the
/// property tests' turns: distinct per conversation and position).
pub fn next_turn(prompt: &mut Vec<u32>, conversation: usize, grow: usize) {
    let start = prompt.len() as u32;
    prompt.extend((0..grow as u32).map(|i| (conversation as u32 + 1) * 100_000 + start + i));
}

/// A workload of conversations: each turn extends the last one's prompt.
pub struct Conversations {
    pub prompts: Vec<Vec<u32>>,
    pub models: Vec<&'static str>,
}

impl Conversations {
    pub fn new(count: usize) -> Self {
        Conversations { prompts: vec![Vec::new(); count], models: vec!["m1", "m2"] }
    }

    /// The next turn of a random conversation: (model, prompt).
    pub fn turn(&mut self, rng: &mut Rng) -> (&'static str, Vec<u32>) {
        let c = rng.below(self.prompts.len() as u64) as usize;
        let grow = 20 + rng.below(300) as usize;
        let base = (c as u32 + 1) * 1_000_000;
        let prompt = &mut self.prompts[c];
        if prompt.is_empty() {
            prompt.extend(0..128); // a shared system prompt of two blocks
        }
        let start = prompt.len() as u32;
        prompt.extend((0..grow as u32).map(|i| base + start + i));
        (self.models[c % self.models.len()], prompt.clone())
    }
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary directory")
}

pub fn db_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("warm.redb")
}

/// The built binary.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_superfluid-warm"))
}

/// The binary's output for `args` (it must succeed), one JSON value a line, as an array.
pub fn cli_json(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(bin()).args(args).output().expect("run the binary");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    serde_json::Value::Array(text.lines().map(|l| serde_json::from_str(l).expect("JSON")).collect())
}

/// The torture writer (`tests/helpers/torture_writer.rs`), which `cargo test` builds as an
/// example beside the test binaries: `target/<profile>/examples`.
pub fn torture_writer() -> PathBuf {
    example("torture-writer")
}

/// An example target that `cargo test` builds beside the test binaries.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps");
    let path = profile.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(path.is_file(), "{} is missing: run the tests with `cargo test`, which builds it", path.display());
    path
}

/// A child process killed when dropped (a failed test leaves none behind).
pub struct Reaped(pub std::process::Child);

impl Reaped {
    /// Waits (at most `within`) for the child to end on its own: its exit status and stderr.
    pub fn ends_within(&mut self, within: std::time::Duration, what: &str) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = self.0.try_wait().expect("try_wait") {
                break status;
            }
            assert!(started.elapsed() < within, "the child is still running {within:?} after {what}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut stderr = String::new();
        if let Some(mut pipe) = self.0.stderr.take() {
            pipe.read_to_string(&mut stderr).expect("stderr");
        }
        (status, stderr)
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
