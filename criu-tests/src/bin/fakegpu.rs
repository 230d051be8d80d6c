//! Test workload: the `counter` process plus a thread named `fakecuda-rt`, which the stand-in
//! driver `libfakecuda.so` takes for the CUDA driver's restore thread, so that gpusnap treats
//! the process as a CUDA process (see `criu_tests::fake_driver`).
//!
//! Usage:
//! - `fakegpu --log FILE --seed N`: one such process;
//! - `fakegpu --dir DIR --seed N --children K`: a parent *without* the thread that forks K
//!   children with one each; logs `DIR/fakegpu-parent.log` and `DIR/fakegpu-child<i>.log`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use criu_tests::fake_driver::spawn_restore_thread;
use criu_tests::workload::{BUFFER_BYTES, arg, fill_buffer, run_counter};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(seed) = arg(&args, "--seed").and_then(|s| s.parse::<u64>().ok()) else {
        eprintln!("usage: fakegpu --seed N (--log FILE | --dir DIR --children K)");
        return ExitCode::from(2);
    };
    let buf = fill_buffer(seed, BUFFER_BYTES);
    if let Some(log) = arg(&args, "--log") {
        return run(&PathBuf::from(log), true, seed, &buf);
    }
    let (Some(dir), Some(Ok(children))) = (
        arg(&args, "--dir"),
        arg(&args, "--children").map(|k| k.parse::<u32>()),
    ) else {
        eprintln!("usage: fakegpu --seed N (--log FILE | --dir DIR --children K)");
        return ExitCode::from(2);
    };
    let dir = PathBuf::from(dir);
    for i in 0..children {
        // SAFETY: no thread has been started in this process yet, so the child starts with
        // consistent state; it only runs ordinary Rust code afterwards.
        match unsafe { libc::fork() } {
            -1 => {
                eprintln!("fakegpu: fork: {}", std::io::Error::last_os_error());
                return ExitCode::FAILURE;
            }
            0 => return run(&dir.join(format!("fakegpu-child{i}.log")), true, seed, &buf),
            _ => {}
        }
    }
    run(&dir.join("fakegpu-parent.log"), false, seed, &buf)
}

fn run(log: &Path, gpu: bool, seed: u64, buf: &[u64]) -> ExitCode {
    if gpu && let Err(e) = spawn_restore_thread() {
        eprintln!("fakegpu: starting the fakecuda-rt thread: {e}");
        return ExitCode::FAILURE;
    }
    match run_counter(log, seed, buf) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fakegpu {}: {e}", log.display());
            ExitCode::FAILURE
        }
    }
}
