//! Errors of this crate. Every message is one line that names where the problem is (file or
//! preset, and line:column for TOML syntax and type errors), the field as a dotted TOML key path,
//! and what is wrong.

use parallax_ir::Precision;
use thiserror::Error;

/// Everything that can go wrong while loading, validating or selecting a cluster.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum HwError {
    /// The TOML text does not parse, has a value of the wrong type, a missing or an unknown key.
    #[error("{origin}:{line}:{col}: {}{message}", field_prefix(.field))]
    Parse {
        /// File path or `preset NAME` the text came from.
        origin: String,
        /// 1-based line of the offending text.
        line: usize,
        /// 1-based column (in characters) of the offending text.
        col: usize,
        /// Dotted key path of the offending key, where it can be worked out.
        field: Option<String>,
        /// The parser's message, on one line.
        message: String,
    },
    /// A value parsed but is out of range or inconsistent with another value.
    #[error("{origin}: {field}: {problem}")]
    Invalid {
        /// File path or `preset NAME` the profile came from.
        origin: String,
        /// Dotted key path, e.g. `network.nic_gbit` or `device.matmul_efficiency[2]`.
        field: String,
        /// What is wrong, on one line.
        problem: String,
    },
    /// The device has no dense peak for this precision (e.g. bf16 on V100).
    #[error("{origin}: device.peak_tflops_{precision}: {device} does not support {precision} (no peak given); choose another precision")]
    UnsupportedPrecision {
        /// File path or `preset NAME` the profile came from.
        origin: String,
        /// Device name.
        device: String,
        /// The precision asked for.
        precision: Precision,
    },
    /// A preset name that is not built in.
    #[error("unknown cluster preset `{name}`; available presets: {available}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// Comma-separated list of the built-in preset names.
        available: String,
    },
    /// A profile file could not be read.
    #[error("{path}: cannot read cluster profile: {reason}")]
    Io {
        /// The path as given.
        path: String,
        /// The operating system's reason, on one line.
        reason: String,
    },
    /// A cluster spec string (`PRESET:gpus=N`, `PATH.toml[:gpus=N]`) is malformed or asks for a
    /// GPU count the cluster cannot provide.
    #[error("cluster `{spec}`: {problem}")]
    Spec {
        /// The spec as given.
        spec: String,
        /// What is wrong, on one line.
        problem: String,
    },
    /// A profile could not be written as TOML.
    #[error("{origin}: cannot write profile as TOML: {reason}")]
    Serialize {
        /// Name of the profile.
        origin: String,
        /// The serializer's message, on one line.
        reason: String,
    },
}

fn field_prefix(field: &Option<String>) -> String {
    match field {
        Some(f) => format!("{f}: "),
        None => String::new(),
    }
}

/// Collapses a possibly multi-line message to one line: lines are joined with `; `, runs of
/// whitespace become one space.
pub(crate) fn one_line(s: &str) -> String {
    s.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Messages of the data-model kind (as opposed to TOML syntax errors), where a key path is
/// meaningful.
const DATA_MODEL_MESSAGES: &[&str] = &[
    "unknown field",
    "missing field",
    "invalid type",
    "invalid value",
    "unknown variant",
    "invalid length",
    "duplicate",
];

/// Turns a `toml::de::Error` into a one-line [`HwError::Parse`]: line:col from the span, the
/// dotted key path where it can be worked out from the text, and `message()` without the
/// multi-line snippet that `Display` would print.
pub(crate) fn from_toml_error(err: &toml::de::Error, text: &str, origin: &str) -> HwError {
    let message = one_line(err.message());
    let start = err.span().map(|s| s.start).unwrap_or(0).min(text.len());
    let (line, col) = line_col(text, start);
    let field = match err.span() {
        Some(_) if DATA_MODEL_MESSAGES.iter().any(|m| message.contains(m)) => {
            key_path_at(text, start, &message)
        }
        _ => None,
    };
    HwError::Parse {
        origin: origin.to_string(),
        line,
        col,
        field,
        message,
    }
}

/// 1-based line and column (in characters) of a byte offset.
pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let col = before[line_start..].chars().count() + 1;
    (line, col)
}

/// Best-effort dotted key path of the key at `offset`: the `[table]` header in effect there plus
/// the key named in the message (`unknown field `x``, `missing field `x``) or written before
/// `=` on that line.
fn key_path_at(text: &str, offset: usize, message: &str) -> Option<String> {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let line_start = text[..offset].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let line_end = text[offset..]
        .find('\n')
        .map(|i| offset + i)
        .unwrap_or(text.len());
    let this_line = text[line_start..line_end].trim();

    // The table in effect: the span's own line if it is a header, else the last header above.
    fn header_of(l: &str) -> Option<String> {
        let l = l.trim();
        if l.starts_with('[') {
            let inner = l.trim_start_matches('[');
            let end = inner.find(']')?;
            Some(inner[..end].trim().to_string())
        } else {
            None
        }
    }
    let named = |prefix: &str| -> Option<String> {
        let rest = &message[message.find(prefix)? + prefix.len()..];
        Some(rest[..rest.find('`')?].to_string())
    };

    // The span is on a table header: an unknown table is the header itself, a missing key
    // belongs to that table.
    if let Some(h) = header_of(this_line) {
        return Some(match named("missing field `") {
            Some(k) => format!("{h}.{k}"),
            None => h,
        });
    }

    let table = text[..line_start].lines().rev().find_map(header_of);
    let key = named("unknown field `")
        .or_else(|| named("missing field `"))
        .or_else(|| {
            let eq = this_line.find('=')?;
            let k = this_line[..eq].trim().trim_matches('"');
            (!k.is_empty()).then(|| k.to_string())
        });
    match (table, key) {
        (Some(t), Some(k)) => Some(format!("{t}.{k}")),
        (None, Some(k)) => Some(k),
        (Some(t), None) => Some(t),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_from_one() {
        let t = "a = 1\nbb = 2\n";
        assert_eq!(line_col(t, 0), (1, 1));
        assert_eq!(line_col(t, 6), (2, 1));
        assert_eq!(line_col(t, 8), (2, 3));
    }

    #[test]
    fn key_path_uses_header_and_key() {
        let t = "[device]\nname = \"x\"\n\n[network]\nnic_gbt = 3\n";
        let off = t.find("nic_gbt").unwrap();
        assert_eq!(
            key_path_at(t, off, "unknown field `nic_gbt`, expected ..."),
            Some("network.nic_gbt".to_string())
        );
        let off = t.find("name").unwrap();
        assert_eq!(
            key_path_at(t, off, "invalid type"),
            Some("device.name".to_string())
        );
    }

    #[test]
    fn one_line_collapses_newlines() {
        assert_eq!(one_line("a\n  b\tc\n"), "a; b c");
    }

    #[test]
    fn unknown_table_is_named_once() {
        let t = "[device]\nname = 1\n[extra]\nx = 1\n";
        let off = t.find("[extra]").unwrap() + 1;
        assert_eq!(
            key_path_at(t, off, "unknown field `extra`, expected one of"),
            Some("extra".to_string())
        );
        let off = t.find("[device]").unwrap() + 1;
        assert_eq!(
            key_path_at(t, off, "missing field `hbm_gib`"),
            Some("device.hbm_gib".to_string())
        );
    }
}
