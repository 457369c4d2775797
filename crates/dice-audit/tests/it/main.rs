//! The audit's integration tests, one binary: its rules on small programs (`rules`), the
//! adversarial suite (`adversarial`) and DICE's honest released kernels (`infilling_honest`).

mod adversarial;
mod common;
mod infilling_honest;
mod rules;
