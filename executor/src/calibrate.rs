//! Calibration micro-benchmarks (filled in below).
