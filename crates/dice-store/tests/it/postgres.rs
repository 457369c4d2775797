//! The PostgreSQL store's claims under workers that race: a result is stored once and a sample
//! is never judged again once its result is stored. The server is each test's own
//! (`dice_test_support::postgres`).

use crate::records::correct_sample;
use dice_store::{ProblemRecord, SampleExtras, Store, WorkerId};
use dice_test_support::postgres::PostgresServer;
use std::time::{Duration, Instant};

/// Alice stores sample 0's result in a transaction that has deleted her claim but not committed
/// yet, while Bob (who saw no result a moment before) asks for the sample: his claim waits for
/// her transaction, and once it commits he is told the sample is finished instead of claiming
/// it. Before this was checked inside the claim, Bob judged the sample a second time (CI,
/// `eval_postgres`: "judged here, but another worker took it over").
#[test]
fn a_sample_stored_while_claimed_is_finished_not_claimed_again() {
    let server = PostgresServer::start();
    let url = server.url();
    let key = (1, 1, 0);
    let lease = Duration::from_secs(60);
    let mut donor = Store::open_postgres(&url, "donor").unwrap();
    donor
        .put_sample(&correct_sample(), &SampleExtras::default())
        .unwrap();
    let mut alice_store = Store::open_postgres(&url, "shared").unwrap();
    // Opened before Alice stores: opening waits for transactions on the tables.
    let mut bob_store = Store::open_postgres(&url, "shared").unwrap();
    let alice = WorkerId::new();
    let claimed = alice_store.claim(&alice, &[key], 1, lease).unwrap();
    assert_eq!(claimed.samples, [(key, None)]);

    // Alice's storing transaction, as put_claimed_sample runs it, held open.
    let mut alice_db = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let mut storing = alice_db.transaction().unwrap();
    storing
        .batch_execute(
            "DELETE FROM claims WHERE run = 'shared';
             CREATE TEMP TABLE copied AS SELECT * FROM samples WHERE run = 'donor';
             UPDATE copied SET run = 'shared';
             INSERT INTO samples SELECT * FROM copied;",
        )
        .unwrap();

    let bob_asks =
        std::thread::spawn(move || bob_store.claim(&WorkerId::new(), &[key], 1, lease).unwrap());
    let mut watcher = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let started = Instant::now();
    while watcher
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(
            !bob_asks.is_finished(),
            "Bob's claim did not wait for Alice's transaction"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "Bob never asked"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    storing.commit().unwrap();

    let bob = bob_asks.join().unwrap();
    assert!(bob.samples.is_empty(), "claimed again: {bob:?}");
    assert_eq!(bob.finished, [key]);
    assert!(alice_store.claim_holders().unwrap().is_empty());
}

/// Problems' source hashes read back from PostgreSQL as from SQLite, run by run (what
/// `dice curate export --difficulty run` matches tasks by).
#[test]
fn problem_sources_read_back_as_from_sqlite() {
    let server = PostgresServer::start();
    let problems = [(2, "b2"), (1, "a1"), (3, "c3")].map(|(problem_id, sha256)| {
        let problem = ProblemRecord {
            level: 1,
            problem_id,
            name: format!("{problem_id}_Test.py"),
            reference_error: None,
        };
        (problem, sha256.to_string())
    });
    let dir = tempfile::tempdir().unwrap();
    let mut sqlite = Store::open(&dir.path().join("dice.db")).unwrap();
    let mut postgres = Store::open_postgres(&server.url(), "sources").unwrap();
    let mut other_run = Store::open_postgres(&server.url(), "other").unwrap();
    other_run.add_problems(&problems[..1]).unwrap();
    for store in [&mut sqlite, &mut postgres] {
        store.add_problems(&problems).unwrap();
    }
    let expected = [((1, 1), "a1"), ((1, 2), "b2"), ((1, 3), "c3")]
        .map(|(key, sha256)| (key, sha256.to_string()));
    assert_eq!(sqlite.problem_sources().unwrap(), expected);
    assert_eq!(postgres.problem_sources().unwrap(), expected);
    assert_eq!(other_run.problem_sources().unwrap(), [expected[1].clone()]);
}
