//! `gpusnap-keeper --fd N [--libcuda PATH]`: started by the gpusnap plugin during a dump, never
//! by hand. It holds a checkpointed job's device memory (imported from descriptors the job
//! exported) and drains it to the plugin's writers while CRIU dumps the job's host side.
//! Everything it does is the agent's code (`gpusnap_agent::keeper`); this is only its process.

const USAGE: &str = "usage: gpusnap-keeper --fd N [--libcuda PATH]\n\
    (the gpusnap plugin starts it during a dump with the connection on descriptor N; it is not run by hand)";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (fd, libcuda) = match args.as_slice() {
        [flag, n] if flag == "--fd" => (n.parse::<i32>().ok(), None),
        [flag, n, lib_flag, lib] if flag == "--fd" && lib_flag == "--libcuda" => {
            (n.parse::<i32>().ok(), Some(lib.as_str()))
        }
        _ => (None, None),
    };
    let Some(fd) = fd else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    std::process::exit(gpusnap_agent::keeper::main_with_fd(fd, libcuda));
}
