//! Test workload: one process that appends a counter line every 50 ms (see `workload`).
//!
//! Usage: `counter --log FILE --seed N`

use std::path::PathBuf;
use std::process::ExitCode;

use criu_tests::workload::{BUFFER_BYTES, arg, fill_buffer, run_counter};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(log), Some(seed)) = (arg(&args, "--log"), arg(&args, "--seed")) else {
        eprintln!("usage: counter --log FILE --seed N");
        return ExitCode::from(2);
    };
    let Ok(seed) = seed.parse::<u64>() else {
        eprintln!("counter: bad seed {seed:?}");
        return ExitCode::from(2);
    };
    let buf = fill_buffer(seed, BUFFER_BYTES);
    match run_counter(&PathBuf::from(log), seed, &buf) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("counter: {e}");
            ExitCode::FAILURE
        }
    }
}
