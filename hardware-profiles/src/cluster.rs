//! Selecting a cluster: a profile plus a device count, from a spec string.

use crate::error::HwError;
use crate::presets::{is_preset, preset, preset_names};
use crate::profile::ClusterProfile;
use std::fmt;

/// A profile and how many of its devices a run uses.
///
/// `gpus` is either a whole number of nodes, or fewer devices than one node holds (a partial
/// node); [`Cluster::new`] rejects anything else.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// The hardware description.
    pub profile: ClusterProfile,
    /// Total devices used.
    pub gpus: u32,
}

impl Cluster {
    /// A cluster of `gpus` devices of `profile`; `gpus` must be at least 1 and fill whole nodes
    /// unless it is smaller than one node, and a multi-node cluster needs a `[network]`.
    pub fn new(profile: ClusterProfile, gpus: u32) -> Result<Cluster, HwError> {
        let spec = format!("{}:gpus={gpus}", profile.name);
        check_gpus(&profile, gpus, &spec)?;
        Ok(Cluster { profile, gpus })
    }

    /// One full node of `profile`.
    pub fn one_node(profile: ClusterProfile) -> Cluster {
        let gpus = profile.node.gpus_per_node;
        Cluster { profile, gpus }
    }

    /// Parses a cluster spec:
    ///
    /// - `PRESET:gpus=N` — a built-in preset with N devices (e.g. `dgx-a100-80gb:gpus=1024`);
    /// - `PRESET` — one full node of the preset;
    /// - `PATH.toml` or `PATH.toml:gpus=N` — a profile file (one node when N is left out).
    ///
    /// Errors: unknown preset (listing the available ones), unreadable or invalid file, a bad
    /// option, N = 0, N that does not fill whole nodes (unless smaller than one node), and more
    /// than one node of a profile without a network.
    pub fn parse(spec: &str) -> Result<Cluster, HwError> {
        let spec_err = |problem: String| HwError::Spec {
            spec: spec.to_string(),
            problem,
        };
        let trimmed = spec.trim();
        if trimmed.is_empty() {
            return Err(spec_err(
                "empty; expected PRESET, PRESET:gpus=N or PATH.toml[:gpus=N]".into(),
            ));
        }

        // Split off `:options` only when the part after the last ':' looks like key=value, so
        // paths containing ':' (e.g. `C:\x.toml`) still work.
        let (target, options) = match trimmed.rsplit_once(':') {
            Some((left, right)) if right.contains('=') => (left.trim(), Some(right.trim())),
            Some((left, right)) if !looks_like_path(trimmed) => {
                return Err(spec_err(format!(
                    "expected `gpus=N` after ':' in `{left}:{right}`"
                )))
            }
            _ => (trimmed, None),
        };

        let mut gpus: Option<u32> = None;
        if let Some(opts) = options {
            for opt in opts.split(',').map(str::trim).filter(|o| !o.is_empty()) {
                let (k, v) = opt
                    .split_once('=')
                    .ok_or_else(|| spec_err(format!("option `{opt}` is not key=value")))?;
                match k.trim() {
                    "gpus" => {
                        let v = v.trim();
                        let n: u32 = v.parse().map_err(|_| {
                            spec_err(format!("gpus must be a whole number >= 1, got `{v}`"))
                        })?;
                        if gpus.replace(n).is_some() {
                            return Err(spec_err("gpus given twice".into()));
                        }
                    }
                    other => {
                        return Err(spec_err(format!(
                            "unknown option `{other}` (the only option is gpus=N)"
                        )))
                    }
                }
            }
            if gpus.is_none() {
                return Err(spec_err("expected `gpus=N` after ':'".into()));
            }
        }

        let profile = if is_preset(target) {
            preset(target)?
        } else if looks_like_path(target) {
            ClusterProfile::load(target)?
        } else {
            return Err(HwError::UnknownPreset {
                name: target.to_string(),
                available: preset_names().join(", "),
            });
        };

        let gpus = gpus.unwrap_or(profile.node.gpus_per_node);
        check_gpus(&profile, gpus, spec)?;
        Ok(Cluster { profile, gpus })
    }

    /// Nodes used (a partial node counts as one).
    pub fn nodes(&self) -> u32 {
        self.gpus.div_ceil(self.profile.node.gpus_per_node)
    }

    /// Devices used per node: the profile's `gpus_per_node`, or fewer for a partial node.
    pub fn gpus_per_node(&self) -> u32 {
        self.gpus.min(self.profile.node.gpus_per_node)
    }

    /// Whether the run uses only part of one node.
    pub fn is_partial_node(&self) -> bool {
        self.gpus < self.profile.node.gpus_per_node
    }
}

impl fmt::Display for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:gpus={} ({} node{} x {} {})",
            self.profile.name,
            self.gpus,
            self.nodes(),
            if self.nodes() == 1 { "" } else { "s" },
            self.gpus_per_node(),
            self.profile.device.name
        )
    }
}

/// A target is a path when it names a `.toml` file or contains a path separator.
fn looks_like_path(s: &str) -> bool {
    s.ends_with(".toml") || s.contains('/') || s.contains('\\')
}

fn check_gpus(profile: &ClusterProfile, gpus: u32, spec: &str) -> Result<(), HwError> {
    let err = |problem: String| HwError::Spec {
        spec: spec.to_string(),
        problem,
    };
    let per = profile.node.gpus_per_node;
    if gpus == 0 {
        return Err(err("gpus must be at least 1, got 0".into()));
    }
    if gpus > per && gpus % per != 0 {
        return Err(err(format!(
            "gpus={gpus} does not fill whole nodes of {per} GPUs ({}); use a multiple of {per}, \
             or fewer than {per} for a partial node",
            profile.name
        )));
    }
    if gpus > per && profile.network.is_none() {
        return Err(err(format!(
            "gpus={gpus} needs {} nodes but profile {} has no [network] (single node of {per})",
            gpus / per,
            profile.name
        )));
    }
    Ok(())
}
