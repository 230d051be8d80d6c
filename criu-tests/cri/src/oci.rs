//! OCI images written by the test: one uncompressed layer, a config, a manifest (with
//! annotations), as blobs for the [`crate::registry`] or as an OCI image layout archive for
//! `ctr images import`.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde_json::json;
use sha2::{Digest, Sha256};

pub const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";

/// `sha256:<hex>` of `data`.
pub fn digest(data: &[u8]) -> String {
    let h = Sha256::digest(data);
    let mut s = String::from("sha256:");
    for b in h {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// One image: its blobs by digest, and the manifest's digest.
#[derive(Debug, Clone)]
pub struct Image {
    pub manifest: Vec<u8>,
    pub manifest_digest: String,
    /// Config and layer blobs by digest.
    pub blobs: BTreeMap<String, Vec<u8>>,
}

/// An image of one uncompressed `layer` (a tar), `config` being the image config's `config`
/// object (`Env`, `Cmd`, ...), `annotations` the manifest's.
pub fn image(
    layer: Vec<u8>,
    config: serde_json::Value,
    annotations: &BTreeMap<String, String>,
) -> Image {
    let layer_digest = digest(&layer);
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
    }))
    .expect("serialize config");
    let config_digest = digest(&config);
    let mut manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": { "mediaType": CONFIG_TYPE, "digest": config_digest, "size": config.len() },
        "layers": [ { "mediaType": LAYER_TYPE, "digest": layer_digest, "size": layer.len() } ],
    });
    if !annotations.is_empty() {
        manifest["annotations"] = json!(annotations);
    }
    let manifest = serde_json::to_vec(&manifest).expect("serialize manifest");
    let mut blobs = BTreeMap::new();
    blobs.insert(config_digest, config);
    blobs.insert(layer_digest, layer);
    Image {
        manifest_digest: digest(&manifest),
        manifest,
        blobs,
    }
}

impl Image {
    /// Writes the image as an OCI image layout in `dir` (`oci-layout`, `index.json`,
    /// `blobs/sha256/`), its manifest named `name` (a full reference, e.g.
    /// `localhost/checkpoint:1`) for `ctr images import`.
    pub fn write_layout(&self, dir: &Path, name: &str) -> Result<(), String> {
        let blobs = dir.join("blobs/sha256");
        fs::create_dir_all(&blobs).map_err(|e| format!("{}: {e}", blobs.display()))?;
        let put = |d: &str, data: &[u8]| {
            let p = blobs.join(d.trim_start_matches("sha256:"));
            fs::write(&p, data).map_err(|e| format!("{}: {e}", p.display()))
        };
        put(&self.manifest_digest, &self.manifest)?;
        for (d, b) in &self.blobs {
            put(d, b)?;
        }
        let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
        let index = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": MANIFEST_TYPE,
                "digest": self.manifest_digest,
                "size": self.manifest.len(),
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }],
        });
        let w = |f: &str, v: &serde_json::Value| {
            let p = dir.join(f);
            fs::write(&p, serde_json::to_vec(v).expect("json"))
                .map_err(|e| format!("{}: {e}", p.display()))
        };
        w("oci-layout", &json!({ "imageLayoutVersion": "1.0.0" }))?;
        w("index.json", &index)
    }
}

/// The `gpusnap.*` annotations of a checkpoint image, from `gpusnap inspect --json` of the
/// archive: what a scheduler needs to match a node without pulling the image.
///
/// - `gpusnap.driver_stack_identity`, `gpusnap.min_gpu_memory_bytes` (KEP-6274's two values;
///   absent where the image records none), `gpusnap.gpu_memory_bytes` (per GPU UUID, JSON);
/// - `gpusnap.gpus`: the GPUs the processes had (ordinal, UUID, name, memory), JSON;
/// - `gpusnap.version`, `gpusnap.format_version`, `gpusnap.driver_version`: of the first
///   process's manifest; `gpusnap.processes`: how many processes have GPU state;
/// - `gpusnap.container`: what the container's saved spec needs of the node (device nodes,
///   driver-library mounts), JSON, without the path it was read from.
pub fn gpusnap_annotations(inspect: &serde_json::Value) -> BTreeMap<String, String> {
    use serde_json::Value;
    let mut out = BTreeMap::new();
    let mut put = |k: &str, v: &Value| {
        let s = match v {
            Value::Null => return,
            Value::String(s) => s.clone(),
            Value::Object(m) if m.is_empty() => return,
            v => v.to_string(),
        };
        out.insert(format!("gpusnap.{k}"), s);
    };
    for k in [
        "driver_stack_identity",
        "min_gpu_memory_bytes",
        "gpu_memory_bytes",
    ] {
        put(k, &inspect[k]);
    }
    let procs = inspect["processes"].as_array().cloned().unwrap_or_default();
    put("processes", &json!(procs.len()));
    let mut gpus: Vec<Value> = procs
        .iter()
        .flat_map(|p| p["gpus"].as_array().cloned().unwrap_or_default())
        .collect();
    gpus.sort_by_key(|g| g.to_string());
    gpus.dedup();
    put("gpus", &json!(gpus));
    if let Some(first) = procs.first() {
        put("version", &first["gpusnap_version"]);
        put("format_version", &first["format_version"]);
        put("driver_version", &first["driver_version"]);
    }
    let mut container = inspect["container"].clone();
    if let Some(m) = container.as_object_mut() {
        m.remove("spec");
    }
    put("container", &container);
    out
}
