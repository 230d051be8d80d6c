//! The test workloads' behaviour and the format of the logs they write.
//!
//! A workload process fills a heap buffer from a seed, then every [`TICK`] appends one line
//! `"<n> <sum> <acc>\n"` to its log: `n` counts up from 1, `sum` is the checksum of the buffer
//! as read *now*, and `acc` is a running value kept only in memory (`acc_n = step(acc_{n-1}, n)`).
//! After a checkpoint/restore the log must continue seamlessly: `n` goes on from where it
//! stopped (the counter came back from the image, not from zero), `sum` still equals the
//! checksum of the seeded buffer (memory contents survived) and the `acc` chain is unbroken.
//!
//! The first line of every log is a header: `"pid <pid> seed <seed> sum <sum>"`.

use std::fs::{File, OpenOptions};
use std::hint::black_box;
use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

/// Interval between two log lines.
pub const TICK: Duration = Duration::from_millis(50);

/// Size of the seeded heap buffer of every workload process.
pub const BUFFER_BYTES: usize = 4 << 20;

/// Deterministic buffer contents for `seed` (splitmix64 stream).
pub fn fill_buffer(seed: u64, bytes: usize) -> Vec<u64> {
    let mut x = seed;
    (0..bytes / 8)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
        .collect()
}

/// Order-sensitive 64-bit checksum of a buffer.
pub fn checksum(buf: &[u64]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325, |h, &w| {
        (h ^ w).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(5)
    })
}

/// The in-memory running value: `acc_n = step(acc_{n-1}, n)`, `acc_0 = seed`.
pub fn step(acc: u64, n: u64) -> u64 {
    acc.wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(n | 1)
}

/// Runs the counter loop forever, appending to `log_path`.
///
/// `buf` is the process's seeded buffer (it may have been filled before a `fork`, so that
/// parent and children share it copy-on-write).
pub fn run_counter(log_path: &Path, seed: u64, buf: &[u64]) -> io::Result<()> {
    let mut log = open_log(log_path)?;
    let expected = checksum(buf);
    write_line(
        &mut log,
        &format!(
            "pid {} seed {seed} sum {expected:016x}\n",
            std::process::id()
        ),
    )?;
    let mut acc = seed;
    for n in 1u64.. {
        acc = step(acc, n);
        // black_box: re-read the whole buffer every tick; do not let the compiler hoist it.
        let sum = checksum(black_box(buf));
        write_line(&mut log, &format!("{n} {sum:016x} {acc:016x}\n"))?;
        std::thread::sleep(TICK);
    }
    Ok(())
}

fn open_log(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// One `write(2)` per line, so that a line is either entirely in the file or not at all.
fn write_line(log: &mut File, line: &str) -> io::Result<()> {
    let n = log.write(line.as_bytes())?;
    if n != line.len() {
        return Err(io::Error::other(format!(
            "short write: {n} of {}",
            line.len()
        )));
    }
    Ok(())
}

/// Parses `--name value` style arguments: returns the value following `name`.
pub fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}
