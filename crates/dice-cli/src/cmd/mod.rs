pub mod eval;
pub mod generate;
pub mod problems;
pub mod prompt;
pub mod report;
pub mod serve;
pub mod tokenize;
