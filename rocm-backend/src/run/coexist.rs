//! Living with CRIU's own `amdgpu_plugin.so`.
//!
//! CRIU calls every loaded plugin's hook in turn until one answers other than "not mine", so
//! two plugins that both take `/dev/kfd` would each get some files, in an order gpusnap does not
//! control. The rule: **when `amdgpu_plugin.so` is loaded in the same CRIU, gpusnap leaves every
//! AMD file to it** (answers "not mine" for `/dev/kfd` and render nodes at dump, and says so
//! once in the log); gpusnap checkpoints AMD processes only when it is the only AMD plugin. An
//! image is restored by the plugin that wrote it: gpusnap restores only files it recorded itself
//! (`gpusnap-kfdfile-<id>.img`).
//!
//! "Loaded" is decided from this process's mappings (`/proc/self/maps`) at the first AMD file,
//! when CRIU has loaded every plugin of its plugin directory.

/// The file name CRIU's amdgpu plugin is installed as.
pub const AMDGPU_PLUGIN: &str = "amdgpu_plugin.so";

/// The path of a loaded `amdgpu_plugin.so`, if one is mapped in this process.
pub fn loaded_amdgpu_plugin() -> Option<String> {
    let maps =
        gpusnap_host::procfs::maps(gpusnap_host::pid::HostPid(std::process::id() as i32)).ok()?;
    find_in_maps(&maps)
}

fn find_in_maps(maps: &str) -> Option<String> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.rsplit('/').next() == Some(AMDGPU_PLUGIN))
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_plugin_by_file_name_only() {
        let maps = "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/criu/amdgpu_plugin.so\n\
                    7f02-7f03 r--p 00000000 08:01 13 /usr/lib/libc.so.6\n";
        assert_eq!(
            find_in_maps(maps).as_deref(),
            Some("/usr/lib/criu/amdgpu_plugin.so")
        );
        assert_eq!(
            find_in_maps("7f-7f r-xp 0 0:0 1 /x/not_amdgpu_plugin.so\n"),
            None
        );
        assert_eq!(find_in_maps("7f-7f rw-p 0 0:0 0\n"), None);
        assert_eq!(loaded_amdgpu_plugin(), None);
    }
}
