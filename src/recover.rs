//! `gpusnap recover PID [--images DIR]`: brings a GPU process back to running after a dump that
//! was cut short (CRIU killed mid-dump). The work is the backends' (`gpusnap_rocm::run::recover`
//! for an AMD process, `gpusnap_cuda::recover` for an NVIDIA one), so the CLI and the plugin
//! undo a dump the same way.

use std::path::Path;
use std::process::ExitCode;

use crate::util::{self, EXIT_ENVIRONMENT, EXIT_PROBLEM};
use gpusnap_host::pid::HostPid;

const SYNOPSIS: &str = "PID [--images DIR]";

pub fn run(args: &[String]) -> ExitCode {
    let mut pid = None;
    let mut images = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--images" => match it.next() {
                Some(d) => images = Some(d.clone()),
                None => {
                    return util::usage_error("recover", SYNOPSIS, "--images needs a directory");
                }
            },
            s if s.starts_with('-') => {
                return util::usage_error("recover", SYNOPSIS, &format!("unknown option {s}"));
            }
            s if pid.is_none() => match s.parse::<i32>() {
                Ok(p) if p > 0 => pid = Some(HostPid(p)),
                _ => return util::usage_error("recover", SYNOPSIS, &format!("bad pid {s:?}")),
            },
            s => return util::usage_error("recover", SYNOPSIS, &format!("unexpected {s:?}")),
        }
    }
    let Some(pid) = pid else {
        return util::usage_error("recover", SYNOPSIS, "missing PID");
    };
    if !Path::new(&format!("/proc/{pid}")).exists() {
        eprintln!("gpusnap recover: no process {pid}");
        return ExitCode::from(EXIT_PROBLEM);
    }
    // An AMD GPU process (it holds a KFD file): its memory never left, only its queues may be
    // paused.
    match gpusnap_rocm::run::recover::recover(pid) {
        Ok(Some(gpusnap_rocm::run::recover::Recovered::Unpaused)) => {
            println!("pid {pid} recovered (AMD GPU queues unpaused); it runs again");
            return ExitCode::SUCCESS;
        }
        Ok(Some(gpusnap_rocm::run::recover::Recovered::Running)) => {
            println!("pid {pid}'s AMD GPU queues were not paused: nothing to recover");
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("gpusnap recover: {e}");
            return ExitCode::from(EXIT_PROBLEM);
        }
    }
    match gpusnap_cuda::recover::recover(pid, images.as_deref().map(Path::new)) {
        Ok(msg) => {
            println!("{msg}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpusnap recover: {e}");
            use gpusnap_cuda::recover::RecoverError;
            ExitCode::from(match e {
                RecoverError::Driver(_) | RecoverError::Config(_) => EXIT_ENVIRONMENT,
                _ => EXIT_PROBLEM,
            })
        }
    }
}
