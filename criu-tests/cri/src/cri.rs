//! A blocking CRI client: the calls the kubelet makes, each bounded in time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{self as cri, NamespaceMode};
use tonic::transport::{Channel, Endpoint, Uri};

pub use k8s_cri::v1::ContainerConfig;

/// How long one CRI call may take (the kubelet's default runtime request timeout is 2 min).
pub const CALL_LIMIT: Duration = Duration::from_secs(120);

/// A connection to one CRI endpoint.
pub struct Cri {
    rt: tokio::runtime::Runtime,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
}

impl std::fmt::Debug for Cri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cri")
    }
}

/// A pod as the test runs it: host network (no CNI), its own pid namespace per container.
#[derive(Debug, Clone)]
pub struct PodSpec {
    pub name: String,
    pub uid: String,
    pub log_directory: PathBuf,
    pub cgroup_parent: String,
}

fn namespaces() -> Option<cri::NamespaceOption> {
    Some(cri::NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    })
}

impl PodSpec {
    pub fn config(&self) -> cri::PodSandboxConfig {
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: self.name.clone(),
                uid: self.uid.clone(),
                namespace: "default".into(),
                attempt: 0,
            }),
            log_directory: self.log_directory.display().to_string(),
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: self.cgroup_parent.clone(),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: namespaces(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// A container config: `image`, `command` (empty: the image's), its CRI log at `<name>.log` in
/// the pod's log directory.
pub fn container_config(name: &str, image: &str, command: &[&str]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: command.iter().map(|s| s.to_string()).collect(),
        log_path: format!("{name}.log"),
        linux: Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: namespaces(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `config` with the CDI device `name` (`vendor.com/class=device`) in its `cdi_devices`, the
/// CRI field the kubelet fills from what a device plugin or DRA driver allocated (containerd
/// 2.1 also reads `cdi.k8s.io/*` annotations, which it calls deprecated, but drops them when
/// it restores a checkpoint).
pub fn with_cdi_device(mut config: cri::ContainerConfig, name: &str) -> cri::ContainerConfig {
    config
        .cdi_devices
        .push(cri::CdiDevice { name: name.into() });
    config
}

impl Cri {
    /// Connects to the CRI socket `sock`, waiting at most `limit` for it to answer `Version`.
    pub fn connect(sock: &Path, limit: Duration) -> Result<Cri, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio: {e}"))?;
        let t0 = Instant::now();
        loop {
            match rt.block_on(try_connect(sock.to_owned())) {
                Ok(ch) => {
                    return Ok(Cri {
                        runtime: RuntimeServiceClient::new(ch.clone()),
                        images: ImageServiceClient::new(ch),
                        rt,
                    });
                }
                Err(e) if t0.elapsed() > limit => return Err(format!("{}: {e}", sock.display())),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    fn call<T, F>(&self, what: &str, f: F) -> Result<T, String>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.rt.block_on(async {
            match tokio::time::timeout(CALL_LIMIT, f).await {
                Ok(Ok(r)) => Ok(r.into_inner()),
                Ok(Err(s)) => Err(format!("CRI {what}: {:?}: {}", s.code(), s.message())),
                Err(_) => Err(format!("CRI {what}: no answer within {CALL_LIMIT:?}")),
            }
        })
    }

    pub fn version(&mut self) -> Result<cri::VersionResponse, String> {
        let mut c = self.runtime.clone();
        self.call("Version", c.version(cri::VersionRequest::default()))
    }

    pub fn pull_image(&mut self, image: &str) -> Result<String, String> {
        let mut c = self.images.clone();
        let req = cri::PullImageRequest {
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        Ok(self.call("PullImage", c.pull_image(req))?.image_ref)
    }

    pub fn run_pod(&mut self, pod: &PodSpec) -> Result<String, String> {
        let mut c = self.runtime.clone();
        let req = cri::RunPodSandboxRequest {
            config: Some(pod.config()),
            ..Default::default()
        };
        Ok(self
            .call("RunPodSandbox", c.run_pod_sandbox(req))?
            .pod_sandbox_id)
    }

    pub fn create_container(
        &mut self,
        pod_id: &str,
        pod: &PodSpec,
        config: cri::ContainerConfig,
    ) -> Result<String, String> {
        let mut c = self.runtime.clone();
        let req = cri::CreateContainerRequest {
            pod_sandbox_id: pod_id.into(),
            config: Some(config),
            sandbox_config: Some(pod.config()),
        };
        Ok(self
            .call("CreateContainer", c.create_container(req))?
            .container_id)
    }

    pub fn start_container(&mut self, id: &str) -> Result<(), String> {
        let mut c = self.runtime.clone();
        let req = cri::StartContainerRequest {
            container_id: id.into(),
        };
        self.call("StartContainer", c.start_container(req))
            .map(drop)
    }

    /// CRI `CheckpointContainer`: the archive is written to `location`.
    pub fn checkpoint_container(&mut self, id: &str, location: &Path) -> Result<(), String> {
        let mut c = self.runtime.clone();
        let req = cri::CheckpointContainerRequest {
            container_id: id.into(),
            location: location.display().to_string(),
            timeout: CALL_LIMIT.as_secs() as i64,
        };
        self.call("CheckpointContainer", c.checkpoint_container(req))
            .map(drop)
    }

    /// The container's status and its verbose info (containerd's JSON under `info`).
    pub fn container_status(
        &mut self,
        id: &str,
    ) -> Result<(cri::ContainerStatus, serde_json::Value), String> {
        let mut c = self.runtime.clone();
        let req = cri::ContainerStatusRequest {
            container_id: id.into(),
            verbose: true,
        };
        let r = self.call("ContainerStatus", c.container_status(req))?;
        let info = r
            .info
            .get("info")
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(serde_json::Value::Null);
        Ok((r.status.unwrap_or_default(), info))
    }

    /// The host pid of the container's process (0 when it has none).
    pub fn container_pid(&mut self, id: &str) -> Result<i32, String> {
        let (_, info) = self.container_status(id)?;
        Ok(info.get("pid").and_then(|p| p.as_i64()).unwrap_or(0) as i32)
    }

    pub fn stop_container(&mut self, id: &str) -> Result<(), String> {
        let mut c = self.runtime.clone();
        let req = cri::StopContainerRequest {
            container_id: id.into(),
            timeout: 2,
        };
        self.call("StopContainer", c.stop_container(req)).map(drop)
    }

    pub fn remove_container(&mut self, id: &str) -> Result<(), String> {
        let mut c = self.runtime.clone();
        let req = cri::RemoveContainerRequest {
            container_id: id.into(),
        };
        self.call("RemoveContainer", c.remove_container(req))
            .map(drop)
    }

    pub fn stop_pod(&mut self, id: &str) -> Result<(), String> {
        let mut c = self.runtime.clone();
        let req = cri::StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.call("StopPodSandbox", c.stop_pod_sandbox(req))
            .map(drop)
    }

    pub fn remove_pod(&mut self, id: &str) -> Result<(), String> {
        let mut c = self.runtime.clone();
        let req = cri::RemovePodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.call("RemovePodSandbox", c.remove_pod_sandbox(req))
            .map(drop)
    }
}

/// A channel to the unix socket `path` whose endpoint answers CRI `Version`.
async fn try_connect(path: PathBuf) -> Result<Channel, String> {
    let ch = Endpoint::try_from("http://[::]:50051")
        .map_err(|e| e.to_string())?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .map_err(|e| e.to_string())?;
    RuntimeServiceClient::new(ch.clone())
        .version(cri::VersionRequest::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(ch)
}
