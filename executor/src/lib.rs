//! Runs a plan: tensor ops, collectives and pipeline schedules.
