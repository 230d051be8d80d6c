//! `gpusnap`: the command-line tool next to the CRIU plugin.
//!
//! - `inspect DIR [--json]`: what a checkpoint image holds, per process;
//! - `verify DIR`: full integrity check of every gpusnap image in DIR;
//! - `check`: is this host ready for GPU checkpoints (CRIU, plugin, driver, agent, ptrace)?
//! - `recover PID [--images DIR]`: bring a process back after a dump that was cut short;
//! - `precopy PID --images DIR [--parent PATH]`: copy a running process's device data ahead of
//!   its dump, so the dump copies only what changed.
//!
//! Image bytes are parsed only by the `gpusnap-image` crate; this binary formats what it returns.
//! Exit codes: 0 success, 1 a problem was found (damage, failed check), 2 usage error.

mod check;
mod check_cdi;
mod check_containers;
mod inspect;
mod precopy;
mod recover;
mod util;
mod verify;

use std::process::ExitCode;

use util::EXIT_USAGE;

/// One subcommand: its name, argument synopsis, one-line description and entry point.
struct Command {
    name: &'static str,
    args: &'static str,
    about: &'static str,
    run: fn(&[String]) -> ExitCode,
}

/// The subcommands. To add one, write `src/<name>.rs` with `pub fn run(args: &[String]) ->
/// ExitCode`, declare the module above and point its entry here.
const COMMANDS: &[Command] = &[
    Command {
        name: "inspect",
        args: "DIR [--json]",
        about: "show the gpusnap images in a CRIU image directory",
        run: inspect::run,
    },
    Command {
        name: "verify",
        args: "DIR [--threads N]",
        about: "check every chunk of every gpusnap image in DIR (exit 1 on damage)",
        run: verify::run,
    },
    Command {
        name: "check",
        args: "",
        about: "diagnose this host: CRIU, plugin, NVIDIA driver, agent, ptrace, GPU memory, Podman",
        run: check::run,
    },
    Command {
        name: "recover",
        args: "PID [--images DIR]",
        about: "after a dump cut short: unlock the process and reload its GPU data",
        run: recover::run,
    },
    Command {
        name: "precopy",
        args: "PID --images DIR [--parent PATH] [--json]",
        about: "copy a running process's GPU data ahead of its dump (it keeps running)",
        run: precopy::run,
    },
];

fn usage() -> String {
    let mut s = format!(
        "gpusnap {}: fast CRIU checkpoints of GPU processes\n\nUsage:\n",
        gpusnap_image::BUILD
    );
    for c in COMMANDS {
        let synopsis = format!("{} {}", c.name, c.args);
        s.push_str(&format!(
            "  gpusnap {:<28} {}\n",
            synopsis.trim_end(),
            c.about
        ));
    }
    s.push_str("\nExit status: 0 ok, 1 problem found, 2 usage error.\n");
    s
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        eprint!("{}", usage());
        return ExitCode::from(EXIT_USAGE);
    };
    match cmd.as_str() {
        "-h" | "--help" | "help" => {
            print!("{}", usage());
            return ExitCode::SUCCESS;
        }
        "-V" | "--version" => {
            println!("gpusnap {}", gpusnap_image::BUILD);
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    match COMMANDS.iter().find(|c| c.name == cmd) {
        Some(c) => (c.run)(&args[1..]),
        None => {
            eprintln!("gpusnap: unknown command {cmd:?}\n");
            eprint!("{}", usage());
            ExitCode::from(EXIT_USAGE)
        }
    }
}
