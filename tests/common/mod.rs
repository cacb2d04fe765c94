//! What the CLI test files share: running the binary and reading its JSON.
// Each test file is its own crate and uses only some of these.
#![allow(dead_code)]

use serde_json::Value;
use std::process::{Command, Output};

/// `parallax` run with `args`.
pub fn parallax(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parallax"))
        .args(args)
        .output()
        .unwrap()
}

/// The JSON document a successful run printed (its stderr shown if it failed).
pub fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `parallax` run with `args`, its JSON document.
pub fn parallax_json(args: &[&str]) -> Value {
    json_of(&parallax(args))
}
