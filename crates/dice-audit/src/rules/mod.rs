//! The rules, grouped by what they look at.

pub(crate) mod fallback;
pub(crate) mod hazards;
pub(crate) mod kernel;
pub(crate) mod reference;
