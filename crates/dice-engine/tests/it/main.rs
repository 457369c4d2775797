//! dice-engine's integration tests, one binary: the API client's retries (`client_retry`), the
//! formula golden's generations (`golden_generate`) and the OpenAI-compatible server
//! (`serve_stream`), on the tiny checkpoint of `dice_test_support::checkpoint`.

mod client_retry;
mod golden_generate;
mod serve_stream;
