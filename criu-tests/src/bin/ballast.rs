//! Test workload: the `counter` process plus a large block of memory ("ballast") filled with
//! incompressible data, so that its dump needs more than a small image directory can hold.
//!
//! Usage: `ballast --log FILE --seed N --mib M`

use std::hint::black_box;
use std::path::PathBuf;
use std::process::ExitCode;

use criu_tests::workload::{BUFFER_BYTES, arg, fill_buffer, run_counter};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(log), Some(seed), Some(mib)) = (
        arg(&args, "--log"),
        arg(&args, "--seed"),
        arg(&args, "--mib"),
    ) else {
        eprintln!("usage: ballast --log FILE --seed N --mib M");
        return ExitCode::from(2);
    };
    let (Ok(seed), Ok(mib)) = (seed.parse::<u64>(), mib.parse::<usize>()) else {
        eprintln!("ballast: bad --seed {seed:?} or --mib {mib:?}");
        return ExitCode::from(2);
    };
    // Every page written with pseudo-random data: present, non-zero, incompressible.
    let ballast = black_box(fill_buffer(!seed, mib << 20));
    let buf = fill_buffer(seed, BUFFER_BYTES);
    let r = run_counter(&PathBuf::from(log), seed, &buf);
    drop(black_box(ballast));
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ballast: {e}");
            ExitCode::FAILURE
        }
    }
}
