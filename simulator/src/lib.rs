//! Event-driven simulator of one training step.
