//! `gpusnap`: the command-line tool next to the CRIU plugin.
//!
//! - `inspect DIR [--json]`: what a checkpoint image holds, per process;
//! - `verify DIR`: full integrity check of every gpusnap image in DIR;
//! - `check`: is this host ready for GPU checkpoints (CRIU, plugin, driver, agent, ptrace)?
//! - `recover PID [--images DIR]`: bring a process back after a dump that was cut short;
//! - `precopy PID --images DIR [--parent PATH]`: copy a running process's device data ahead of
//!   its dump, so the dump copies only what changed;
//! - `wait DIR [--timeout S]`: wait until an asynchronous `criu dump -R`'s images are complete.
//!
//! One module each: `inspect`, `verify`, `check` (with its `amd`, `cdi` and `containers`
//! parts), `recover`, `precopy`, `wait`; `util` holds the exit codes and the shared helpers; `archive`
//! unpacks a checkpoint archive given to `inspect` or `verify`, as untrusted input.
//!
//! Image bytes are parsed only by the `gpusnap-image` crate; this binary formats what it returns.
//! `gpusnap SUB --help` and `gpusnap help SUB` describe a subcommand. Exit codes ([`util::EXITS`],
//! `docs/cli.md`): 0 ok, 1 a problem found (damage, a failed check, a failed recover), 2 usage
//! error, 3 nothing found to act on (no gpusnap image in DIR, no such DIR), 4 an environment or
//! driver problem kept the command from its work (configuration, driver, permissions), 5 `wait`
//! timed out with an image still pending. `check` reports such problems as findings: a `fail`
//! line, exit 1, never 4.

mod archive;
mod check;
mod inspect;
mod precopy;
mod recover;
mod util;
mod verify;
mod wait;

use std::process::ExitCode;

use util::EXIT_USAGE;

/// One subcommand: its name, argument synopsis, one-line description, what `--help` adds, and
/// entry point.
struct Command {
    name: &'static str,
    args: &'static str,
    about: &'static str,
    help: &'static str,
    run: fn(&[String]) -> ExitCode,
}

/// The subcommands. To add one, write `src/<name>.rs` with `pub fn run(args: &[String]) ->
/// ExitCode`, declare the module above and point its entry here.
const COMMANDS: &[Command] = &[
    Command {
        name: "inspect",
        args: "DIR [--json]",
        about: "show the gpusnap images in a CRIU image directory",
        help: "For each process: its GPUs, allocations, data files, chunks and codecs, and what a\n\
               restore needs. --json prints one JSON document instead.\n\
               Exit: 0 shown, 1 an image is damaged, 2 usage, 3 nothing to inspect (no gpusnap\n\
               image in DIR, or no such DIR), 4 DIR unreadable.",
        run: inspect::run,
    },
    Command {
        name: "verify",
        args: "DIR [--threads N]",
        about: "check every chunk of every gpusnap image in DIR (exit 1 on damage)",
        help: "Reads every chunk of every gpusnap image in DIR (and of the parent images it\n\
               references) and checks it against its checksum. --threads N readers (default:\n\
               one per CPU, at most 16).\n\
               Exit: 0 every image intact, 1 damage or an unfinished dump found, 2 usage,\n\
               3 nothing to verify (no gpusnap image in DIR, or no such DIR), 4 DIR unreadable.",
        run: verify::run,
    },
    Command {
        name: "check",
        args: "",
        about: "diagnose this host: configuration, CRIU, plugin, drivers, agent, ptrace, Podman",
        help: "One line per finding, `ok|warn|fail  what  — what to do`. The configuration file\n\
               (/etc/criu/gpusnap.conf or $GPUSNAP_CONFIG) and the GPUSNAP_* environment are\n\
               checked as the plugin reads them, every problem on its own line.\n\
               Exit: 0 no failure, 1 a check failed (a configuration or driver problem too:\n\
               check reports it, it is not stopped by it), 2 usage.",
        run: check::run,
    },
    Command {
        name: "recover",
        args: "PID [--images DIR]",
        about: "after a dump cut short: unlock the process and reload its GPU data",
        help: "For a process a dump left held (CRIU killed mid-dump): NVIDIA, unlock it and reload\n\
               its released device memory from --images DIR (the interrupted dump's directory);\n\
               AMD, start its paused GPU queues (its memory never left).\n\
               Exit: 0 recovered or nothing to recover, 1 not recovered (the message says why\n\
               and what to do), 2 usage, 4 configuration or driver problem.",
        run: recover::run,
    },
    Command {
        name: "precopy",
        args: "PID --images DIR [--parent PATH] [--json]",
        about: "copy a running process's GPU data ahead of its dump (it keeps running)",
        help: "One pre-copy round into DIR (one round at a time per directory): a later\n\
               `criu dump --prev-images-dir DIR` copies only what changed. --parent PATH\n\
               compares against an earlier round; --json prints the report as JSON.\n\
               Exit: 0 saved, 1 the round failed (the process runs on; DIR keeps nothing of it),\n\
               2 usage, 4 configuration or driver problem.",
        run: precopy::run,
    },
    Command {
        name: "wait",
        args: "DIR [--timeout SECONDS]",
        about: "wait until the images of an asynchronous `criu dump -R` are complete",
        help: "With async_leave_running, `criu dump -R` returns before the GPU data is in DIR; a\n\
               process gpusnap leaves behind writes it, and DIR holds gpusnap-<pid>-PENDING.txt\n\
               until then (every tool refuses DIR meanwhile). Waits for every process's image.\n\
               Exit: 0 complete, 1 failed (NOT-A-CHECKPOINT, its cause printed, or a PENDING\n\
               marker whose writer is gone), 2 usage, 3 no gpusnap image in DIR (or no such\n\
               DIR), 4 DIR unreadable, 5 still pending at --timeout (default: no limit).",
        run: wait::run,
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
    s.push_str(
        "\n`gpusnap SUB --help` or `gpusnap help SUB` says more about SUB.\n\nExit status:\n",
    );
    for (code, what) in util::EXITS {
        s.push_str(&format!("  {code}  {what}\n"));
    }
    s
}

/// `gpusnap SUB --help`.
fn command_help(c: &Command) -> String {
    format!(
        "gpusnap {} {}\n  {}\n\n{}\n",
        c.name, c.args, c.about, c.help
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        eprint!("{}", usage());
        return ExitCode::from(EXIT_USAGE);
    };
    match cmd.as_str() {
        "help" if args.len() > 1 => {
            return match COMMANDS.iter().find(|c| c.name == args[1]) {
                Some(c) => {
                    print!("{}", command_help(c));
                    ExitCode::SUCCESS
                }
                None => {
                    eprintln!("gpusnap help: unknown command {:?}\n", args[1]);
                    eprint!("{}", usage());
                    ExitCode::from(EXIT_USAGE)
                }
            };
        }
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
        Some(c) if args[1..].iter().any(|a| a == "--help" || a == "-h") => {
            print!("{}", command_help(c));
            ExitCode::SUCCESS
        }
        Some(c) => (c.run)(&args[1..]),
        None => {
            eprintln!("gpusnap: unknown command {cmd:?}\n");
            eprint!("{}", usage());
            ExitCode::from(EXIT_USAGE)
        }
    }
}
