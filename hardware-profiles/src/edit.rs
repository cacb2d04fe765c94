//! Rewriting values in a profile TOML file while keeping its comments and layout (the source
//! citations next to every number), for tools that fit parameters.

use crate::error::HwError;
use toml_edit::{value, Array, DocumentMut, Item, Table};

/// Comment written after a value that had none.
pub const FITTED_COMMENT: &str = " # fitted by `parallax validate CASES --fit`: see [calibration]";

/// A value to set.
#[derive(Clone, Debug, PartialEq)]
pub enum Setting {
    Float(f64),
    Text(String),
    List(Vec<String>),
}

/// Sets each dotted key (`device.sustained_efficiency`, `calibration.provenance`) in `text`,
/// creating missing tables, and returns the new text. Values are rounded to 4 significant
/// digits so repeated fits do not churn the files. The result is validated as a profile.
pub fn set_values(
    text: &str,
    origin: &str,
    settings: &[(&str, Setting)],
) -> Result<String, HwError> {
    let mut doc: DocumentMut =
        text.parse()
            .map_err(|e: toml_edit::TomlError| HwError::Invalid {
                origin: origin.to_string(),
                field: "(file)".into(),
                problem: e.message().replace('\n', " "),
            })?;
    for (key, setting) in settings {
        let (path, last) = match key.rsplit_once('.') {
            Some((p, l)) => (p.split('.').collect::<Vec<_>>(), l),
            None => (Vec::new(), *key),
        };
        let mut table: &mut Table = doc.as_table_mut();
        for part in path {
            let entry = table
                .entry(part)
                .or_insert_with(|| Item::Table(Table::new()));
            table = entry.as_table_mut().ok_or_else(|| HwError::Invalid {
                origin: origin.to_string(),
                field: key.to_string(),
                problem: format!("'{part}' is not a table"),
            })?;
        }
        let item = match setting {
            Setting::Float(x) => value(round4(*x)),
            Setting::Text(t) => value(t.as_str()),
            Setting::List(xs) => value(xs.iter().map(String::as_str).collect::<Array>()),
        };
        // Keep the comment that follows an existing value on its line.
        let suffix = table
            .get(last)
            .and_then(Item::as_value)
            .and_then(|v| v.decor().suffix())
            .and_then(|s| s.as_str())
            .map(str::to_string);
        table.insert(last, item);
        // Every value in a preset cites its source: a new one points at [calibration].
        let sfx = suffix.unwrap_or_else(|| FITTED_COMMENT.to_string());
        if let Some(v) = table.get_mut(last).and_then(Item::as_value_mut) {
            v.decor_mut().set_suffix(sfx);
        }
    }
    let out = doc.to_string();
    crate::ClusterProfile::from_toml_str(&out, origin)?;
    Ok(out)
}

fn round4(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let digits = 3 - x.abs().log10().floor() as i32;
    let k = 10f64.powi(digits);
    (x * k).round() / k
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset_toml;

    #[test]
    fn sets_values_and_keeps_comments() {
        let text = preset_toml("dgx-a100-80gb").unwrap();
        let out = set_values(
            text,
            "preset dgx-a100-80gb",
            &[
                ("device.sustained_efficiency", Setting::Float(0.812345)),
                ("device.memory_efficiency", Setting::Float(0.8)),
                ("calibration.provenance", Setting::Text("test fit".into())),
                (
                    "calibration.fitted_fields",
                    Setting::List(vec!["device.sustained_efficiency".into()]),
                ),
                ("calibration.step_time_band", Setting::Float(0.07)),
            ],
        )
        .unwrap();
        let p = crate::ClusterProfile::from_toml_str(&out, "x").unwrap();
        assert_eq!(p.device.sustained_efficiency, Some(0.8123));
        assert_eq!(p.device.memory_efficiency, 0.8);
        assert_eq!(p.calibration.unwrap().step_time_band, Some(0.07));
        // Source comments survive, including the one after the rewritten value.
        let before = text.lines().filter(|l| l.contains('#')).count();
        let after = out.lines().filter(|l| l.contains('#')).count();
        assert_eq!(before, after);
        assert_eq!(round4(1234.5678), 1235.0);
        assert!(set_values(text, "x", &[("device.hbm_gib", Setting::Float(-1.0))]).is_err());
    }
}
