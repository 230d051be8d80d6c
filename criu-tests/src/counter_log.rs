//! Reading and checking the logs written by the workloads (format: see [`crate::workload`]).

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::workload::{BUFFER_BYTES, checksum, fill_buffer, step};

/// One parsed log line after the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tick {
    pub n: u64,
    pub sum: u64,
    pub acc: u64,
}

/// A workload log as read at one moment.
#[derive(Debug, Clone)]
pub struct CounterLog {
    pub path: PathBuf,
    pub pid: i32,
    pub seed: u64,
    /// The checksum the process computed right after filling its buffer.
    pub sum: u64,
    pub ticks: Vec<Tick>,
}

impl CounterLog {
    /// Reads the log; `Ok(None)` if it does not exist yet or has no complete header line.
    /// An incomplete last line (no trailing newline) is ignored.
    pub fn read(path: &Path) -> Result<Option<CounterLog>, String> {
        let text = match fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let complete = match text.rfind('\n') {
            Some(i) => &text[..=i],
            None => return Ok(None),
        };
        let mut lines = complete.lines();
        let header = lines.next().unwrap_or_default();
        let bad = |what: &str, line: &str| format!("{}: bad {what} line {line:?}", path.display());
        let h: Vec<&str> = header.split_whitespace().collect();
        let (pid, seed, sum) = match h.as_slice() {
            ["pid", pid, "seed", seed, "sum", sum] => (
                pid.parse().map_err(|_| bad("header", header))?,
                seed.parse().map_err(|_| bad("header", header))?,
                u64::from_str_radix(sum, 16).map_err(|_| bad("header", header))?,
            ),
            _ => return Err(bad("header", header)),
        };
        let mut ticks = Vec::new();
        for line in lines {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [n, s, a] = f.as_slice() else {
                return Err(bad("tick", line));
            };
            ticks.push(Tick {
                n: n.parse().map_err(|_| bad("tick", line))?,
                sum: u64::from_str_radix(s, 16).map_err(|_| bad("tick", line))?,
                acc: u64::from_str_radix(a, 16).map_err(|_| bad("tick", line))?,
            });
        }
        Ok(Some(CounterLog {
            path: path.to_owned(),
            pid,
            seed,
            sum,
            ticks,
        }))
    }

    /// The last counter value written (0 if none yet).
    pub fn last(&self) -> u64 {
        self.ticks.last().map_or(0, |t| t.n)
    }

    /// Checks the whole history: the header checksum is that of the seeded buffer, every tick
    /// saw the same checksum, counters are consecutive from 1 and the `acc` chain is unbroken.
    pub fn verify(&self) -> Result<(), String> {
        let expected = checksum(&fill_buffer(self.seed, BUFFER_BYTES));
        if self.sum != expected {
            return Err(format!(
                "{}: header checksum {:016x}, expected {expected:016x}",
                self.path.display(),
                self.sum
            ));
        }
        let mut acc = self.seed;
        for (i, t) in self.ticks.iter().enumerate() {
            let n = i as u64 + 1;
            acc = step(acc, n);
            let err = |what: &str| {
                Err(format!(
                    "{}: line {} ({t:?}): {what}",
                    self.path.display(),
                    i + 2
                ))
            };
            if t.n != n {
                return err(&format!("counter should be {n}"));
            }
            if t.sum != expected {
                return err(&format!(
                    "memory checksum changed, expected {expected:016x}"
                ));
            }
            if t.acc != acc {
                return err(&format!("in-memory chain broken, expected {acc:016x}"));
            }
        }
        Ok(())
    }

    /// Waits until the log at `path` has a counter value of at least `min`, then returns it.
    pub fn wait_for(path: &Path, min: u64, timeout: Duration) -> Result<CounterLog, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = CounterLog::read(path)?;
            if let Some(log) = &log
                && log.last() >= min
            {
                return Ok(log.clone());
            }
            if Instant::now() >= deadline {
                let content = fs::read_to_string(path).unwrap_or_else(|e| format!("<{e}>"));
                let tail: Vec<&str> = content.lines().rev().take(5).collect();
                return Err(format!(
                    "{}: counter did not reach {min} within {timeout:?}; last lines (newest first): {tail:?}",
                    path.display()
                ));
            }
            sleep(Duration::from_millis(20));
        }
    }
}

impl fmt::Display for CounterLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (pid {}, {} ticks, last {})",
            self.path.display(),
            self.pid,
            self.ticks.len(),
            self.last()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_log(dir: &Path, seed: u64, ticks: &[(u64, u64)], tail: &str) -> PathBuf {
        let sum = checksum(&fill_buffer(seed, BUFFER_BYTES));
        let mut s = format!("pid 7 seed {seed} sum {sum:016x}\n");
        let mut acc = seed;
        for &(n, chain_n) in ticks {
            acc = step(acc, chain_n);
            s.push_str(&format!("{n} {sum:016x} {acc:016x}\n"));
        }
        s.push_str(tail);
        let p = dir.join(format!("log-{seed}-{}", ticks.len()));
        fs::write(&p, s).unwrap();
        p
    }

    #[test]
    fn verifies_good_log_and_ignores_partial_line() {
        let dir = std::env::temp_dir();
        let p = write_log(&dir, 11, &[(1, 1), (2, 2), (3, 3)], "4 00");
        let log = CounterLog::read(&p).unwrap().unwrap();
        assert_eq!(log.last(), 3);
        log.verify().unwrap();
        fs::remove_file(p).unwrap();
    }

    #[test]
    fn detects_restart_and_broken_chain() {
        let dir = std::env::temp_dir();
        let p = write_log(&dir, 12, &[(1, 1), (2, 2), (1, 1)], "");
        assert!(CounterLog::read(&p).unwrap().unwrap().verify().is_err());
        fs::remove_file(p).unwrap();
        let p = write_log(&dir, 13, &[(1, 1), (2, 5)], "");
        assert!(CounterLog::read(&p).unwrap().unwrap().verify().is_err());
        fs::remove_file(p).unwrap();
    }
}
