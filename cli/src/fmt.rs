//! Human-readable numbers.

/// `1234567` → `1.23 M`, with SI prefixes up to P.
pub fn si(x: f64) -> String {
    let units = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    for (scale, unit) in units {
        if x.abs() >= scale {
            return format!("{:.2} {unit}", x / scale);
        }
    }
    format!("{x:.0}")
}

/// `x` with an SI prefix glued to `unit`: `358.96 GFLOP`, `12 FLOP`.
pub fn si_unit(x: f64, unit: &str) -> String {
    let s = si(x);
    if s.ends_with(char::is_alphabetic) {
        format!("{s}{unit}")
    } else {
        format!("{s} {unit}")
    }
}

/// Bytes as KiB / MiB / GiB.
pub fn bytes(b: f64) -> String {
    let units = [
        (1u64 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    for (scale, unit) in units {
        if b >= scale as f64 {
            return format!("{:.2} {unit}", b / scale as f64);
        }
    }
    format!("{b:.0} B")
}

/// Whether a cell reads as a number (right-aligned in tables).
fn numeric(c: &str) -> bool {
    c.is_empty()
        || c == "-"
        || c.starts_with(|ch: char| ch.is_ascii_digit() || ch == '+' || (ch == '-' && c.len() > 1))
}

/// A plain text table: the first column and columns of text left-aligned, numbers right-aligned.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let n = header.len();
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(n) {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let right: Vec<bool> = (0..n)
        .map(|i| i > 0 && rows.iter().all(|r| r.get(i).is_none_or(|c| numeric(c))))
        .collect();
    let line = |cells: Vec<String>| -> String {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if right.get(i).copied().unwrap_or(false) {
                    format!("{c:>width$}", width = w[i])
                } else {
                    format!("{c:<width$}", width = w[i])
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = line(header.iter().map(|s| s.to_string()).collect());
    out.push('\n');
    out.push_str(&line(w.iter().map(|x| "-".repeat(*x)).collect()));
    out.push('\n');
    for r in rows {
        out.push_str(&line(r.clone()));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(si(174_604_259_328.0), "174.60 G");
        assert_eq!(si(12.0), "12");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0), "3.00 MiB");
        let t = table(
            &["a", "bb", "c"],
            &[vec!["x".into(), "1".into(), "yz".into()]],
        );
        assert_eq!(t, "a  bb  c\n-  --  --\nx   1  yz\n");
    }
}
