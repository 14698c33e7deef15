//! What the CLI, the tests and the benches run around the index: the faithful 0.1.7 design (the
//! model the index is compared with), request traces and the replay. Built with the `tools`
//! feature (on with `cli`); hidden from the docs and outside semver: not for production use.
//! Uses the library's public API, and the 0.1.7 formats from `keys` and `store`.

pub mod baseline;
#[cfg(all(feature = "engines", feature = "nats"))]
pub mod engine_heads;
#[cfg(feature = "engines")]
pub mod engine_replay;
#[cfg(feature = "engines")]
pub mod engine_sim;
#[cfg(feature = "nats")]
pub mod heads;
#[cfg(feature = "cli")]
pub mod prometheus;
pub mod replay;
pub mod trace;
