//! Cluster description types, TOML profile loader with validation, built-in presets.
