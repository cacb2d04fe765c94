//! Cost models: compute, communication and memory of a plan on a hardware profile.
