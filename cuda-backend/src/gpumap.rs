//! Which GPU each checkpointed GPU is restored onto.
//!
//! The image records every GPU by UUID and model. At restore, a GPU that is still there is used
//! again; one that is absent is replaced automatically by a free GPU of the same model with
//! enough free memory; `device_map` (config) forces pairs. Every target is checked (same model,
//! enough free memory) before anything is touched, and a refusal names the GPU and the shortfall.

use gpusnap_image::GpuRecord;

/// Whether `m`'s GPUs can be planned only once the driver is loaded, after CRIU's restore: a
/// `device_map` is configured, or the image holds MIG instances (CUDA names them `... MIG ...`
/// and gives them UUIDs of their own, which the kernel driver's listing of physical GPUs lacks).
pub fn planned_by_the_driver(gpus: &[GpuRecord], device_map: &[(String, String)]) -> bool {
    !device_map.is_empty() || gpus.iter().any(|g| g.name.contains("MIG"))
}

/// A GPU of this host.
#[derive(Clone, Debug)]
pub struct HostGpu {
    pub uuid: String,
    pub name: String,
    /// Free memory, when NVML can tell.
    pub free: Option<u64>,
}

/// One checkpointed GPU and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    pub old: String,
    pub new: String,
}

/// `uuid` (32 hex digits) as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, the form `nvidia-smi -L`
/// prints and a `device_map` is most often written in; as given when it is no UUID.
pub fn dashed(uuid: &str) -> String {
    uuid.parse::<crate::GpuUuid>()
        .map_or_else(|_| uuid.to_owned(), |u| u.to_nvml_string())
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Why the image's GPUs cannot be placed on this host; each names the GPU and what to do.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("device_map names GPU {old}, which is not in the image (its GPUs: {image_gpus})")]
    MapSourceAbsent { old: String, image_gpus: String },
    #[error("device_map target GPU {new} is not on this host")]
    MapTargetAbsent { new: String },
    /// Found in `init`: a `device_map` target that the kernel driver does not list, on a host
    /// without MIG instances (so it cannot be one). UUIDs as `nvidia-smi -L` writes them.
    #[error(
        "device_map target {new} is not on this host, which has no MIG instances it could name; \
         this host's GPUs: {host_gpus}. Fix device_map to name one of them"
    )]
    MapTargetUnknown { new: String, host_gpus: String },
    #[error(
        "GPU {uuid} ({name}) of the image is not on this host and no free {name} with {need_gib:.2} GiB free is left to take its place; \
         set device_map to choose one"
    )]
    NoReplacement {
        uuid: String,
        name: String,
        need_gib: f64,
    },
    #[error(
        "cannot restore GPU {uuid} ({name}) onto GPU {target} ({target_name}): the GPU model must be the same"
    )]
    OtherModel {
        uuid: String,
        name: String,
        target: String,
        target_name: String,
    },
    #[error(
        "GPU {target} ({target_name}) has {free_gib:.2} GiB free but the image needs {need_gib:.2} GiB on it: free {short_gib:.2} GiB there and restore again"
    )]
    NotEnoughFree {
        target: String,
        target_name: String,
        free_gib: f64,
        need_gib: f64,
        short_gib: f64,
    },
}

/// Plans the restore of `dumped` GPUs (`need[i]`: bytes gpusnap will re-create on `dumped[i]`).
/// Returns the full list of pairs when any GPU moves (the driver wants every checkpointed GPU
/// listed then), or an empty list when every GPU stays where it was.
pub fn plan(
    dumped: &[GpuRecord],
    need: &[u64],
    host: &[HostGpu],
    configured: &[(String, String)],
) -> Result<Vec<Pair>, PlanError> {
    for (old, new) in configured {
        if !dumped.iter().any(|g| &g.uuid == old) {
            return Err(PlanError::MapSourceAbsent {
                old: old.clone(),
                image_gpus: dumped
                    .iter()
                    .map(|g| g.uuid.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        if !host.iter().any(|g| &g.uuid == new) {
            return Err(PlanError::MapTargetAbsent { new: new.clone() });
        }
    }
    let mut taken: Vec<&str> = configured.iter().map(|(_, n)| n.as_str()).collect();
    let mut pairs = Vec::new();
    for (i, g) in dumped.iter().enumerate() {
        let want = need.get(i).copied().unwrap_or(0);
        let target = if let Some((_, new)) = configured.iter().find(|(o, _)| o == &g.uuid) {
            host.iter().find(|h| &h.uuid == new)
        } else if let Some(h) = host
            .iter()
            .find(|h| h.uuid == g.uuid && !taken.contains(&h.uuid.as_str()))
        {
            Some(h)
        } else {
            host.iter().find(|h| {
                h.name == g.name
                    && !taken.contains(&h.uuid.as_str())
                    && h.free.is_none_or(|f| f >= want)
            })
        };
        let Some(t) = target else {
            return Err(PlanError::NoReplacement {
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                need_gib: gib(want),
            });
        };
        if t.name != g.name {
            return Err(PlanError::OtherModel {
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                target: t.uuid.clone(),
                target_name: t.name.clone(),
            });
        }
        if let Some(free) = t.free
            && free < want
        {
            return Err(PlanError::NotEnoughFree {
                target: t.uuid.clone(),
                target_name: t.name.clone(),
                free_gib: gib(free),
                need_gib: gib(want),
                short_gib: gib(want - free),
            });
        }
        taken.push(t.uuid.as_str());
        pairs.push(Pair {
            old: g.uuid.clone(),
            new: t.uuid.clone(),
        });
    }
    if pairs.iter().all(|p| p.old == p.new) {
        pairs.clear();
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(uuid: &str, name: &str, ordinal: u32) -> GpuRecord {
        GpuRecord {
            ordinal,
            uuid: uuid.into(),
            name: name.into(),
            total_mem: 100 << 30,
        }
    }
    fn host(uuid: &str, name: &str, free_gib: u64) -> HostGpu {
        HostGpu {
            uuid: uuid.into(),
            name: name.into(),
            free: Some(free_gib << 30),
        }
    }

    #[test]
    fn same_gpus_need_no_pairs() {
        let d = [rec("a", "H200", 0), rec("b", "H200", 1)];
        let h = [host("a", "H200", 100), host("b", "H200", 100)];
        assert!(plan(&d, &[1 << 30, 1 << 30], &h, &[]).unwrap().is_empty());
    }

    #[test]
    fn absent_gpu_moves_to_a_free_one_of_the_same_model() {
        let d = [rec("a", "H200", 0)];
        let h = [host("x", "A100", 100), host("y", "H200", 100)];
        let p = plan(&d, &[8 << 30], &h, &[]).unwrap();
        assert_eq!(
            p,
            vec![Pair {
                old: "a".into(),
                new: "y".into()
            }]
        );
    }

    #[test]
    fn configured_swap_lists_every_gpu() {
        let d = [rec("a", "H200", 0), rec("b", "H200", 1)];
        let h = [host("a", "H200", 100), host("b", "H200", 100)];
        let cfg = [("a".into(), "b".into()), ("b".into(), "a".into())];
        let p = plan(&d, &[0, 0], &h, &cfg).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            p[0],
            Pair {
                old: "a".into(),
                new: "b".into()
            }
        );
        assert_eq!(
            p[1],
            Pair {
                old: "b".into(),
                new: "a".into()
            }
        );
    }

    #[test]
    fn refusals_name_the_gpu_and_the_shortfall() {
        let d = [rec("a", "H200", 0)];
        let e = plan(&d, &[50 << 30], &[host("a", "H200", 20)], &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("20.00 GiB free") && e.contains("needs 50.00 GiB"),
            "{e}"
        );
        let e = plan(&d, &[0], &[host("x", "A100", 100)], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not on this host"), "{e}");
        let cfg = [("a".into(), "x".into())];
        let e = plan(&d, &[0], &[host("x", "A100", 100)], &cfg)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model must be the same"), "{e}");
        let cfg = [("zz".into(), "x".into())];
        let e = plan(&d, &[0], &[host("x", "H200", 100)], &cfg)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not in the image"), "{e}");
    }

    #[test]
    fn one_target_is_not_given_twice() {
        let d = [rec("a", "H200", 0), rec("b", "H200", 1)];
        let e = plan(&d, &[0, 0], &[host("y", "H200", 100)], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPU b"), "{e}");
    }
}
