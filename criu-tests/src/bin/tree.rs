//! Test workload: a parent that forks two children; all three run the counter loop.
//!
//! The seeded buffer is filled before the forks, so the three processes share its pages
//! copy-on-write (CRIU has to dump and restore that sharing correctly).
//!
//! Usage: `tree --dir DIR --seed N` writes `DIR/tree-parent.log`, `DIR/tree-child0.log` and
//! `DIR/tree-child1.log`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use criu_tests::workload::{BUFFER_BYTES, arg, fill_buffer, run_counter};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(seed)) = (arg(&args, "--dir"), arg(&args, "--seed")) else {
        eprintln!("usage: tree --dir DIR --seed N");
        return ExitCode::from(2);
    };
    let Ok(seed) = seed.parse::<u64>() else {
        eprintln!("tree: bad seed {seed:?}");
        return ExitCode::from(2);
    };
    let dir = PathBuf::from(dir);
    let buf = fill_buffer(seed, BUFFER_BYTES);

    let mut role = "parent".to_owned();
    for i in 0..2 {
        // SAFETY: the process is single-threaded here (no threads were spawned), so the child
        // starts with consistent state; it only runs ordinary Rust code afterwards.
        let pid = unsafe { libc::fork() };
        match pid {
            -1 => {
                eprintln!("tree: fork: {}", std::io::Error::last_os_error());
                return ExitCode::FAILURE;
            }
            0 => {
                role = format!("child{i}");
                break;
            }
            _ => {}
        }
    }
    run(&dir, &role, seed, &buf)
}

fn run(dir: &Path, role: &str, seed: u64, buf: &[u64]) -> ExitCode {
    match run_counter(&dir.join(format!("tree-{role}.log")), seed, buf) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tree {role}: {e}");
            ExitCode::FAILURE
        }
    }
}
