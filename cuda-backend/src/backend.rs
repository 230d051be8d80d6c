//! [`CudaBackend`]: NVIDIA's answers to CRIU's hooks for one CRIU run. It serves NVIDIA device
//! files that hold no CUDA state, and dispatches the GPU hooks to the run of its stage ([`Run`]):
//! a [`DumpRun`], a [`RestoreRun`], or nothing, with the reason.

use crate::dump::DumpRun;
use crate::restore::{RestoreInit, RestoreRun};
use gpusnap_config::{Config, Mode};
use gpusnap_host::criu::{self, Reopened, Stage};
use gpusnap_host::pid::HostPid;
use gpusnap_host::{Answer, Backend};
use std::os::fd::BorrowedFd;

/// What the NVIDIA backend does with the GPU processes of this run.
pub enum Run {
    /// Nothing: the reason (for the log and tests).
    Disabled(String),
    Dump(Box<DumpRun>),
    Restore(Box<RestoreRun>),
}

/// The restore cannot go on: the image or this host cannot take it (the reason is logged).
#[derive(Debug)]
pub struct Refused;

pub struct CudaBackend {
    stage: Stage,
    /// Device files are recorded and re-opened unless gpusnap is off.
    device_files: bool,
    /// `durable = true`: a device-file record is fsynced with its directory before the hook
    /// answers.
    durable: bool,
    /// CRIU's image directory in CRIU's own process, fetched once at `init` (the runs hold it
    /// too). Hooks that run in a restored task fetch that task's own ([`criu::image_dir`]).
    image_dir: Option<BorrowedFd<'static>>,
    run: Run,
    /// A dump with `mode = off`: a process with CUDA state fails the dump rather than being
    /// saved without its GPU state ([`refuse_unsaved_gpu_state`]).
    off_guard: bool,
    /// A restore: where each recorded per-GPU device node is opened, made at `init` (the
    /// restored tasks, forked from CRIU's process after it, have it too).
    device_nodes: crate::devfile::NodePlan,
}

impl CudaBackend {
    /// The NVIDIA side of a CRIU run of `stage`; `Err` when a restore must be refused.
    pub fn init(
        stage: Stage,
        cfg: Config,
        image_dir: Option<BorrowedFd<'static>>,
    ) -> Result<CudaBackend, Refused> {
        let device_files = cfg.mode != Mode::Off;
        let off_guard = cfg.mode == Mode::Off && stage == Stage::Dump;
        let durable = cfg.durable;
        let device_map = cfg.device_map.clone();
        let mut device_nodes = crate::devfile::NodePlan::default();
        let run = match stage {
            Stage::PreDump => {
                log::info!("pre-dump: GPU state is not pre-dumped (the final dump takes it)");
                Run::Disabled("pre-dump".into())
            }
            Stage::Dump => init_dump(cfg, image_dir),
            Stage::Restore => match RestoreRun::init(cfg, image_dir) {
                RestoreInit::Run(mut r) => {
                    device_nodes = r.take_device_nodes();
                    Run::Restore(r)
                }
                RestoreInit::NothingToDo(why) => {
                    // No GPU process, but device files held without CUDA state may be (an NVML
                    // user's `/dev/nvidia<N>`): they follow the GPUs of this host too.
                    if device_files && let Some(dir) = image_dir {
                        match crate::devfile::plan_at_init(dir, &device_map, &[], false) {
                            Ok(n) => device_nodes = n,
                            Err(e) => {
                                let refusal = crate::restore::NodeRefusal(
                                    e.into_iter().map(Into::into).collect(),
                                );
                                log::error!(
                                    "restore refused: {refusal} (checked against /proc/driver/nvidia before CRIU restored any process); nothing was restored"
                                );
                                return Err(Refused);
                            }
                        }
                    }
                    Run::Disabled(why)
                }
                RestoreInit::Refused => return Err(Refused),
            },
        };
        Ok(CudaBackend {
            stage,
            device_files: device_files && stage != Stage::PreDump,
            durable,
            image_dir,
            run,
            off_guard,
            device_nodes,
        })
    }

    /// A backend that does nothing this run, for `why`.
    pub fn disabled(stage: Stage, why: &str) -> CudaBackend {
        CudaBackend {
            stage,
            device_files: false,
            durable: false,
            image_dir: None,
            run: Run::Disabled(why.into()),
            off_guard: false,
            device_nodes: Default::default(),
        }
    }

    pub fn run(&self) -> &Run {
        &self.run
    }
}

fn init_dump(cfg: Config, dir: Option<BorrowedFd<'static>>) -> Run {
    if cfg.mode == Mode::Off {
        log::info!("disabled by configuration (mode = off)");
        return Run::Disabled("mode = off".into());
    }
    if let Some(why) = crate::context::driver_absent_reason() {
        log::info!(
            "no usable NVIDIA driver on this host ({why}); NVIDIA GPU checkpointing disabled"
        );
        return Run::Disabled(why);
    }
    // Driver calls must run while CRIU holds the other threads with ptrace, not a frozen cgroup.
    if !criu::set_compel_interrupt_only_mode() {
        log::warn!(
            "this CRIU cannot seize in interrupt-only mode; frozen containers may hang the lock"
        );
    }
    if let Some(d) = dir {
        crate::parent::start_checks(d, cfg.incremental, cfg.effective_reader_threads());
    }
    Run::Dump(Box::new(DumpRun::new(cfg, dir)))
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "nvidia"
    }

    /// NVIDIA device files held without CUDA state.
    fn dump_ext_file(&mut self, fd: BorrowedFd<'_>, id: u32) -> Answer {
        if self.stage != Stage::Dump || !self.device_files {
            return Answer::NotMine;
        }
        let Some(dir) = self.image_dir else {
            return Answer::NotMine;
        };
        match crate::devfile::dump(dir, fd, id, self.durable) {
            Ok(true) => Answer::Done,
            Ok(false) => Answer::NotMine,
            Err(e) => {
                log::error!("file {id}: recording an NVIDIA device file failed: {e}");
                Answer::Failed
            }
        }
    }

    fn restore_ext_file(&mut self, dir: BorrowedFd<'_>, id: u32) -> Option<Reopened> {
        if self.stage != Stage::Restore || !self.device_files {
            return None;
        }
        match crate::devfile::restore(dir, id, &self.device_nodes) {
            Ok(Some(fd)) => Some(Reopened::Fd(fd)),
            Ok(None) => None,
            Err(e) => {
                log::error!("file {id}: {e}");
                Some(Reopened::Failed)
            }
        }
    }

    fn pause_devices(&mut self, pid: HostPid) -> Answer {
        match &mut self.run {
            Run::Dump(d) => Answer::of(d.pause_devices(pid)),
            Run::Disabled(_) if self.off_guard => refuse_unsaved_gpu_state(pid),
            _ => Answer::NotMine,
        }
    }

    fn checkpoint_devices(&mut self, pid: HostPid) -> Answer {
        match &mut self.run {
            Run::Dump(d) => {
                let answer = Answer::of(d.checkpoint_devices(pid));
                seal_agent_door(pid);
                answer
            }
            _ => Answer::NotMine,
        }
    }

    fn resume_devices_late(&mut self, pid: HostPid) -> Answer {
        match &mut self.run {
            Run::Restore(r) => Answer::of(r.resume_devices_late(pid)),
            _ => Answer::NotMine,
        }
    }

    /// Always lets other plugins' POST_FORKING run too (the plugin answers "not mine").
    fn post_forking(&mut self) {
        if let Run::Restore(r) = &mut self.run {
            r.post_forking();
        }
    }

    fn exit(&mut self, ret: i32) {
        match &mut self.run {
            Run::Dump(d) => {
                d.exit(ret);
                crate::parent::finish_checks();
            }
            Run::Restore(r) => r.exit(),
            Run::Disabled(_) => {}
        }
    }
}

/// PAUSE_DEVICES of a dump with `mode = off`: never a CPU-only checkpoint of a GPU job. A
/// process with CUDA state fails the dump, naming the cause, unless CRIU's own CUDA plugin is
/// loaded in this CRIU (it is then offered the hook next and checkpoints the GPU state: a
/// refusal here would stop CRIU from asking it). Without an NVIDIA driver on this host no
/// process can have CUDA state, and nothing is loaded to ask.
fn refuse_unsaved_gpu_state(pid: HostPid) -> Answer {
    if let Some(path) = criu_cuda_plugin_loaded() {
        log::info!("pid {pid}: gpusnap is off (mode = off); GPU state is left to {path}");
        return Answer::NotMine;
    }
    if crate::context::driver_absent_reason().is_some() {
        return Answer::NotMine;
    }
    let Ok(api) = crate::driver::api() else {
        return Answer::NotMine;
    };
    if api.restore_thread_id(pid).is_err() {
        return Answer::NotMine;
    }
    gpusnap_host::logger::tell_user(&format!(
        "pid {pid} has CUDA state, but gpusnap is disabled (mode = off) and no other CRIU plugin \
         saves GPU state: the dump is refused rather than writing a checkpoint without the \
         process's GPU memory, which could never be restored. Set mode = auto (or unset \
         GPUSNAP_MODE=off), or stop the process's GPU work before the dump"
    ));
    Answer::Failed
}

/// The path of CRIU's own CUDA plugin (`cuda_plugin.so`) if it is loaded in this process (CRIU
/// loads every plugin of its plugin directory before the first hook); as the AMD side finds
/// `amdgpu_plugin.so`.
fn criu_cuda_plugin_loaded() -> Option<String> {
    cuda_plugin_in_maps(&std::fs::read_to_string("/proc/self/maps").ok()?)
}

fn cuda_plugin_in_maps(maps: &str) -> Option<String> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.rsplit('/').next() == Some("cuda_plugin.so"))
        .map(str::to_owned)
}

/// After CHECKPOINT_DEVICES of `pid` (CRIU calls it for every process of the tree, and the
/// first call has stopped again every agent thread it let run): `pid`'s agent door, if it has
/// one, is sealed until CRIU has dumped its descriptors (`gpusnap_proto::seal_door`), so that no
/// other client's knock is in flight there, where CRIU cannot dump it. The agent opens a new
/// door once its thread runs again.
fn seal_agent_door(pid: HostPid) {
    match gpusnap_proto::seal_door(pid) {
        Ok(Some(n)) if n > 0 => log::info!(
            "pid {pid}: the agent's door sealed for the dump; {n} knocks of other clients taken out of it"
        ),
        Ok(_) => {}
        Err(e) => log::warn!("pid {pid}: cannot seal the agent's door for the dump: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::cuda_plugin_in_maps;

    #[test]
    fn criu_cuda_plugin_is_found_in_maps() {
        let maps = "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/criu/cuda_plugin.so\n\
                    7f02-7f03 r-xp 00000000 08:01 43 /usr/lib/criu/gpusnap.so\n";
        assert_eq!(
            cuda_plugin_in_maps(maps).as_deref(),
            Some("/usr/lib/criu/cuda_plugin.so")
        );
        assert_eq!(
            cuda_plugin_in_maps("7f02-7f03 r-xp 00000000 08:01 43 /x/not_cuda_plugin.so\n"),
            None
        );
    }
}
