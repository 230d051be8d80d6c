//! Which local GPU stands in for each GPU a process used at dump: the same model (vendor,
//! device id, gfx target, SIMD count) with at least the VRAM its buffer objects need. The
//! GPU with the same gpu_id is preferred; otherwise the first unused match in topology order.
//! Decided before anything is restored, so a mismatch is refused with nothing touched.

use crate::topology::Gpu;

/// What a dumped GPU was, and how much VRAM its BOs need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedGpu {
    pub gpu_id: u32,
    pub vendor_id: u32,
    pub device_id: u32,
    pub gfx_target_version: u32,
    pub simd_count: u32,
    pub name: String,
    /// Bytes of VRAM BOs on it.
    pub vram_bytes: u64,
}

impl WantedGpu {
    fn model_matches(&self, g: &Gpu) -> bool {
        g.vendor_id == self.vendor_id
            && g.device_id == self.device_id
            && g.gfx_target_version.unwrap_or(0) == self.gfx_target_version
            && g.simd_count == self.simd_count
    }

    fn describe(&self) -> String {
        format!(
            "gpu_id {} ({:04x}:{:04x} gfx target {} \"{}\", {} SIMDs, {} MiB of VRAM buffers)",
            self.gpu_id,
            self.vendor_id,
            self.device_id,
            self.gfx_target_version,
            self.name,
            self.simd_count,
            self.vram_bytes >> 20
        )
    }
}

/// Why no local GPU can take the place of a dumped one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoStandIn {
    /// No local GPU is of the wanted model; `here` is every GPU of this host.
    #[error(
        "{}: no GPU of that model here (this host has {})",
        wanted.describe(),
        describe_host(here)
    )]
    NoSuchModel { wanted: WantedGpu, here: Vec<Gpu> },
    /// Every local GPU of the model (`same_model`) has too little VRAM or stands in for an
    /// earlier one.
    #[error(
        "{}: every GPU of that model here is too small or already taken: {}",
        wanted.describe(),
        describe_sizes(same_model)
    )]
    AllTaken {
        wanted: WantedGpu,
        same_model: Vec<Gpu>,
    },
}

/// `gpu_id 1 1002:740f gfx target 90010, ...`, or `no AMD GPU`.
fn describe_host(here: &[Gpu]) -> String {
    if here.is_empty() {
        return "no AMD GPU".to_owned();
    }
    here.iter()
        .map(|g| {
            format!(
                "gpu_id {} {:04x}:{:04x} gfx target {}",
                g.gpu_id,
                g.vendor_id,
                g.device_id,
                g.gfx_target_version.unwrap_or(0)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `gpu_id 1 with 65536 MiB, ...`.
fn describe_sizes(gpus: &[Gpu]) -> String {
    gpus.iter()
        .map(|g| format!("gpu_id {} with {} MiB", g.gpu_id, g.local_mem_bytes >> 20))
        .collect::<Vec<_>>()
        .join(", ")
}

/// For each wanted GPU (same order), the local GPU that takes its place; or why none can.
pub fn match_gpus(wanted: &[WantedGpu], local: &[Gpu]) -> Result<Vec<Gpu>, NoStandIn> {
    let mut used = vec![false; local.len()];
    let mut out = Vec::with_capacity(wanted.len());
    for w in wanted {
        let fits = |g: &Gpu| w.model_matches(g) && g.local_mem_bytes >= w.vram_bytes;
        let pick = local
            .iter()
            .position(|g| g.gpu_id == w.gpu_id && fits(g))
            .filter(|&i| !used[i])
            .or_else(|| (0..local.len()).find(|&i| !used[i] && fits(&local[i])));
        let Some(i) = pick else {
            let same_model: Vec<Gpu> = local
                .iter()
                .filter(|g| w.model_matches(g))
                .cloned()
                .collect();
            return Err(if same_model.is_empty() {
                NoStandIn::NoSuchModel {
                    wanted: w.clone(),
                    here: local.to_vec(),
                }
            } else {
                NoStandIn::AllTaken {
                    wanted: w.clone(),
                    same_model,
                }
            });
        };
        used[i] = true;
        out.push(local[i].clone());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn gpu(gpu_id: u32, device_id: u32, mem_mib: u64) -> Gpu {
        Gpu {
            node: gpu_id,
            gpu_id,
            name: None,
            vendor_id: 0x1002,
            device_id,
            simd_count: 104,
            local_mem_bytes: mem_mib << 20,
            gfx_target_version: Some(90010),
            drm_render_minor: Some(128),
            properties: BTreeMap::new(),
        }
    }

    fn want(gpu_id: u32, device_id: u32, vram_mib: u64) -> WantedGpu {
        WantedGpu {
            gpu_id,
            vendor_id: 0x1002,
            device_id,
            gfx_target_version: 90010,
            simd_count: 104,
            name: "gfx90a".into(),
            vram_bytes: vram_mib << 20,
        }
    }

    #[test]
    fn same_ids_first_then_any_free_match() {
        let local = [gpu(10, 0x740f, 64), gpu(20, 0x740f, 64)];
        let m = match_gpus(&[want(20, 0x740f, 1), want(10, 0x740f, 1)], &local).unwrap();
        assert_eq!((m[0].gpu_id, m[1].gpu_id), (20, 10));
        // Other ids: translated in order, never twice.
        let m = match_gpus(&[want(7, 0x740f, 1), want(8, 0x740f, 1)], &local).unwrap();
        assert_eq!((m[0].gpu_id, m[1].gpu_id), (10, 20));
    }

    #[test]
    fn refusals_say_why() {
        let local = [gpu(10, 0x740f, 64)];
        let e = match_gpus(&[want(10, 0x744c, 1)], &local).unwrap_err();
        assert!(e.to_string().contains("no GPU of that model"), "{e}");
        let e = match_gpus(&[want(10, 0x740f, 128)], &local).unwrap_err();
        assert!(e.to_string().contains("too small or already taken"), "{e}");
        let e = match_gpus(&[want(10, 0x740f, 1), want(11, 0x740f, 1)], &local).unwrap_err();
        assert!(e.to_string().contains("gpu_id 11"), "{e}");
        let e = match_gpus(&[want(10, 0x740f, 1)], &[]).unwrap_err();
        assert!(e.to_string().contains("no AMD GPU"), "{e}");
    }
}
