//! Running `scripts/criu` and reading what it logged.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// How long one `criu dump` or `criu restore` may take before the test gives up.
pub const CRIU_TIMEOUT: Duration = Duration::from_secs(120);

/// The outcome of one criu invocation.
#[derive(Debug)]
pub struct CriuRun {
    /// The command line, for messages.
    pub cmdline: String,
    pub status: ExitStatus,
    /// criu's stdout and stderr, interleaved.
    pub output: String,
    pub log_path: PathBuf,
    /// The whole `-o` log (`-v4`).
    pub log: String,
}

impl CriuRun {
    /// Runs `criu <args>`; `log_path` is where the `-o` argument in `args` makes it log.
    pub fn run(criu: &Path, args: &[String], log_path: &Path) -> Result<CriuRun, String> {
        // A timed-out criu is killed and reaped when the BackgroundCriu drops.
        BackgroundCriu::spawn(criu, args, &[], log_path)?.wait(CRIU_TIMEOUT)
    }

    /// Exit status 0 and CRIU's own success line ("Dumping finished successfully" /
    /// "Restore finished successfully").
    pub fn succeeded(&self) -> bool {
        self.status.success() && self.log.contains("finished successfully")
    }

    /// Panics with the interesting part of the log unless the run succeeded.
    pub fn assert_ok(&self) {
        assert!(
            self.succeeded(),
            "criu failed ({}): {}\n{}",
            self.status,
            self.cmdline,
            self.diagnostics()
        );
    }

    /// The lines logged by gpusnap: the message (after CRIU's `(ss.uuuuuu)` timestamp and
    /// the optional `pid: ` prefix of restored tasks) starts with `gpusnap:`.
    pub fn gpusnap_lines(&self) -> Vec<&str> {
        self.log.lines().filter(|l| is_gpusnap_line(l)).collect()
    }

    /// Error lines plus the last lines of the log, stdout/stderr, and gpusnap's lines.
    pub fn diagnostics(&self) -> String {
        let errors: Vec<&str> = self
            .log
            .lines()
            .filter(|l| l.contains("Error") || l.contains("Warn"))
            .take(30)
            .collect();
        let lines: Vec<&str> = self.log.lines().collect();
        let tail = &lines[lines.len().saturating_sub(25)..];
        let mut hints = String::new();
        if self
            .log
            .contains("Generating dynamic descriptor for plugin")
        {
            // The plugin directory holds only gpusnap.so, a copy of the harness's plugin, and
            // gpusnap's plugin always exports the descriptor (plugin/src/lib.rs).
            hints.push_str(
                "hint: CRIU found no CR_PLUGIN_DESC in plugins/gpusnap.so: it is not gpusnap's plugin (check $GPUSNAP_TEST_PLUGIN_SO) or no longer exports the symbol (nm -D)\n",
            );
        }
        if self.log.contains("Corrupted plugin") {
            hints.push_str("hint: CRIU rejected a plugin descriptor (version or max_hooks too high for this CRIU)\n");
        }
        format!(
            "{hints}--- log {} ---\nerrors/warnings:\n  {}\ngpusnap lines:\n  {}\nlast lines:\n  {}\n--- criu stdout/stderr ---\n{}",
            self.log_path.display(),
            errors.join("\n  "),
            self.gpusnap_lines().join("\n  "),
            tail.join("\n  "),
            self.output.trim_end(),
        )
    }
}

/// A `criu` started in the background: waited for with [`BackgroundCriu::wait`], or killed part-way
/// with [`BackgroundCriu::kill`]. Dropping it SIGKILLs and reaps criu if it still runs.
#[derive(Debug)]
pub struct BackgroundCriu {
    pub cmdline: String,
    child: Option<Child>,
    log_path: PathBuf,
    out_path: PathBuf,
}

impl BackgroundCriu {
    /// Starts `criu <args>` with `env` added to its environment (the harness-only variables
    /// removed); `log_path` is where the `-o` argument in `args` makes it log, and its stdout and
    /// stderr go next to it (`.stdio`).
    pub fn spawn(
        criu: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log_path: &Path,
    ) -> Result<BackgroundCriu, String> {
        let cmdline = format!("{} {}", criu.display(), args.join(" "));
        let out_path = log_path.with_extension("stdio");
        let out =
            fs::File::create(&out_path).map_err(|e| format!("{}: {e}", out_path.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(criu);
        for v in crate::harness::HARNESS_ONLY_ENV {
            cmd.env_remove(v);
        }
        let child = cmd
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run {cmdline}: {e}"))?;
        Ok(BackgroundCriu {
            cmdline,
            child: Some(child),
            log_path: log_path.to_owned(),
            out_path,
        })
    }

    /// criu's pid (`scripts/criu` execs it, so this is criu itself).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// The exit status if criu has exited (it is then reaped).
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// What criu has logged so far.
    pub fn log_so_far(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits up to `timeout` for criu to exit.
    pub fn wait(mut self, timeout: Duration) -> Result<CriuRun, String> {
        let deadline = Instant::now() + timeout;
        let status = loop {
            let c = self.child.as_mut().expect("child present until finished");
            match c.try_wait() {
                Ok(Some(st)) => break st,
                Ok(None) if Instant::now() < deadline => sleep(Duration::from_millis(10)),
                Ok(None) => return Err(format!("{}: timed out after {timeout:?}", self.cmdline)),
                Err(e) => return Err(format!("{}: wait: {e}", self.cmdline)),
            }
        };
        Ok(self.finished(status))
    }

    /// SIGKILLs criu wherever it is, reaps it and returns what it logged.
    pub fn kill(mut self) -> Result<CriuRun, String> {
        let c = self.child.as_mut().expect("child present until finished");
        c.kill()
            .map_err(|e| format!("{}: kill: {e}", self.cmdline))?;
        let status = c
            .wait()
            .map_err(|e| format!("{}: wait: {e}", self.cmdline))?;
        Ok(self.finished(status))
    }

    fn finished(&mut self, status: ExitStatus) -> CriuRun {
        self.child = None;
        CriuRun {
            cmdline: self.cmdline.clone(),
            status,
            output: fs::read_to_string(&self.out_path).unwrap_or_default(),
            log_path: self.log_path.clone(),
            log: fs::read_to_string(&self.log_path).unwrap_or_default(),
        }
    }
}

impl Drop for BackgroundCriu {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl CriuRun {
    /// As [`CriuRun::run`], with `env` added to criu's environment.
    pub fn run_with_env(
        criu: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log_path: &Path,
    ) -> Result<CriuRun, String> {
        BackgroundCriu::spawn(criu, args, env, log_path)?.wait(CRIU_TIMEOUT)
    }

    /// The gpusnap lines that contain `needle`.
    pub fn gpusnap_lines_with(&self, needle: &str) -> Vec<&str> {
        self.gpusnap_lines()
            .into_iter()
            .filter(|l| l.contains(needle))
            .collect()
    }
}

/// Strips CRIU's `(00.012345) ` timestamp and an optional `  1234: ` task prefix.
fn message(line: &str) -> &str {
    let mut m = line;
    if m.starts_with('(')
        && let Some(i) = m.find(") ")
    {
        m = &m[i + 2..];
    }
    let t = m.trim_start();
    if let Some(i) = t.find(": ")
        && i > 0
        && t[..i].bytes().all(|b| b.is_ascii_digit())
    {
        return t[i + 2..].trim_start();
    }
    t
}

/// True if a CRIU log line was written by gpusnap (its message starts with `gpusnap:`).
pub fn is_gpusnap_line(line: &str) -> bool {
    message(line).starts_with("gpusnap:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_gpusnap_lines() {
        assert!(is_gpusnap_line(
            "(00.029002) gpusnap: gpusnap 0.1.0 loaded (stage dump)"
        ));
        assert!(is_gpusnap_line("(00.029002)   4242: gpusnap: restoring"));
        assert!(is_gpusnap_line("gpusnap: message level"));
        assert!(!is_gpusnap_line(
            "(00.028983) Plugin \"gpusnap\" (version 512 hooks 12)"
        ));
        assert!(!is_gpusnap_line(
            "(00.029572) plugin: `gpusnap' hook 10 -> 0x7f"
        ));
        assert!(!is_gpusnap_line(
            "(00.001) Opened /x/gpusnap: y/plugins/gpusnap.so"
        ));
    }
}
