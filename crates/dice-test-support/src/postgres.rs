//! A PostgreSQL server of a test's own: `initdb` and `pg_ctl` on a temporary folder, listening
//! on a free port of 127.0.0.1 (its unix socket in that folder), with an empty database `dice`
//! that user `dice` reaches without a password; stopped when dropped. The binaries are those of
//! `$DICE_PG_BIN`, else Debian's `/usr/lib/postgresql/*/bin` (the newest), else `PATH`. PostgreSQL
//! refuses to run as root: as root, the server runs as `nobody`, which owns the folder.
//!
//! PostgreSQL is part of the test suite's setup (as the Python environment is): without its
//! binaries, [`PostgresServer::start`] fails the test and says what to install, rather than
//! letting it pass without checking anything.

use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A running server; see the module.
pub struct PostgresServer {
    folder: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    /// The user the server runs as, when the test runs as root.
    run_as: Option<String>,
}

/// The user and database the tests connect as and to.
const USER: &str = "dice";
const DATABASE: &str = "dice";

impl PostgresServer {
    /// A running server with an empty database. Panics, saying what to install, when this
    /// machine has no PostgreSQL binaries.
    pub fn start() -> PostgresServer {
        let bin = binaries().unwrap_or_else(|| {
            panic!(
                "this test needs PostgreSQL's server binaries (initdb, pg_ctl, createdb), found \
                 in none of $DICE_PG_BIN, /usr/lib/postgresql/*/bin or PATH: install PostgreSQL \
                 (Debian: apt-get install postgresql) or set DICE_PG_BIN to its bin folder"
            )
        });
        let folder = tempfile::tempdir().unwrap();
        let root = std::fs::metadata("/proc/self").unwrap().uid() == 0;
        let run_as = root.then(|| "nobody".to_string());
        if root {
            let (uid, gid) = passwd_ids("nobody");
            std::os::unix::fs::chown(folder.path(), Some(uid), Some(gid)).unwrap();
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let server = PostgresServer {
            folder,
            bin,
            port,
            run_as,
        };
        let data = server.folder.path().join("data");
        server.run(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-U".as_ref(),
                USER.as_ref(),
                "--auth=trust".as_ref(),
                "--no-sync".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
            ],
        );
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            server.folder.path().display()
        );
        let log = server.folder.path().join("server.log");
        server.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-l".as_ref(),
                log.as_os_str(),
                "-w".as_ref(),
                "-o".as_ref(),
                options.as_ref(),
                "start".as_ref(),
            ],
        );
        let port = port.to_string();
        server.run(
            "createdb",
            &["-h", "127.0.0.1", "-p", &port, "-U", USER, DATABASE].map(AsRef::as_ref),
        );
        server
    }

    /// The port it listens on, at 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://dice@127.0.0.1:PORT/dice`: its database, as `--store` takes it.
    pub fn url(&self) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{DATABASE}", self.port)
    }

    /// Runs the PostgreSQL program `name` in the server's folder, as the server's user.
    fn run(&self, name: &str, args: &[&std::ffi::OsStr]) {
        let program = self.bin.join(name);
        let mut command = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        let output = command
            .args(args)
            .current_dir(self.folder.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
        assert!(
            output.status.success(),
            "{name} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let data = self.folder.path().join("data");
        self.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-m".as_ref(),
                "immediate".as_ref(),
                "stop".as_ref(),
            ],
        );
    }
}

/// The folder holding `initdb`, `pg_ctl` and `createdb`.
fn binaries() -> Option<PathBuf> {
    let has_all = |dir: &Path| {
        ["initdb", "pg_ctl", "createdb"]
            .iter()
            .all(|name| dir.join(name).is_file())
    };
    if let Some(dir) = std::env::var_os("DICE_PG_BIN") {
        return Some(PathBuf::from(dir)).filter(|d| has_all(d));
    }
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            Some((version, e.path().join("bin")))
        })
        .filter(|(_, bin)| has_all(bin))
        .collect();
    debian.sort();
    if let Some((_, bin)) = debian.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find(|d| has_all(d))
}

/// The user and group ids of `user` in /etc/passwd.
fn passwd_ids(user: &str) -> (u32, u32) {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let fields: Vec<&str> = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&user))
        .unwrap_or_else(|| panic!("no user {user} in /etc/passwd"));
    (fields[2].parse().unwrap(), fields[3].parse().unwrap())
}
