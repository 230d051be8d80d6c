//! A read-only OCI distribution registry on 127.0.0.1 (plain HTTP: containerd allows it for
//! `localhost`), enough for containerd's pulls: `/v2/`, manifests by tag or digest, blobs by
//! digest, `GET` and `HEAD`. One thread; every answer closes its connection.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::oci::{Image, MANIFEST_TYPE};

#[derive(Default)]
struct Store {
    /// `<repository>:<tag>` → manifest digest.
    tags: BTreeMap<String, String>,
    /// Digest → (media type, content): manifests and blobs.
    content: BTreeMap<String, (&'static str, Arc<Vec<u8>>)>,
}

/// The registry; stops when dropped.
pub struct Registry {
    pub port: u16,
    store: Arc<Mutex<Store>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Registry(127.0.0.1:{})", self.port)
    }
}

impl Registry {
    pub fn start() -> Result<Registry, String> {
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("registry bind: {e}"))?;
        l.set_nonblocking(true)
            .map_err(|e| format!("registry: {e}"))?;
        let port = l.local_addr().map_err(|e| e.to_string())?.port();
        let store = Arc::new(Mutex::new(Store::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (store.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((conn, _)) => {
                        let s = s.clone();
                        std::thread::spawn(move || {
                            let _ = serve(conn, &s);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Ok(Registry {
            port,
            store,
            stop,
            thread: Some(thread),
        })
    }

    /// `localhost:<port>`: the host part of the image names.
    pub fn host(&self) -> String {
        format!("localhost:{}", self.port)
    }

    /// Serves `image` as `<host>/<repository>:<tag>`; returns that name.
    pub fn put(&self, repository: &str, tag: &str, image: &Image) -> String {
        let mut s = self.store.lock().unwrap_or_else(|e| e.into_inner());
        s.tags
            .insert(format!("{repository}:{tag}"), image.manifest_digest.clone());
        s.content.insert(
            image.manifest_digest.clone(),
            (MANIFEST_TYPE, Arc::new(image.manifest.clone())),
        );
        for (d, b) in &image.blobs {
            s.content
                .insert(d.clone(), ("application/octet-stream", Arc::new(b.clone())));
        }
        format!("{}/{repository}:{tag}", self.host())
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(conn: TcpStream, store: &Mutex<Store>) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut r = BufReader::new(conn.try_clone()?);
    // containerd tries HTTPS first: a TLS handshake (first byte 0x16) gets a plain HTTP answer,
    // which Go reports as "server gave HTTP response to HTTPS client", and containerd then
    // falls back to HTTP for a localhost registry.
    if r.fill_buf()?.first() == Some(&0x16) {
        let mut w = conn;
        w.write_all(b"HTTP/1.0 400 Bad Request\r\nConnection: close\r\n\r\nplain HTTP only\n")?;
        return w.flush();
    }
    let mut raw = Vec::new();
    r.read_until(b'\n', &mut raw)?;
    let line = String::from_utf8_lossy(&raw).into_owned();
    // The headers: nothing in them matters here (no body is ever sent to this registry).
    loop {
        let mut h = Vec::new();
        if r.read_until(b'\n', &mut h)? == 0 || h == b"\r\n" || h == b"\n" {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let found = lookup(path, store);
    let mut w = conn;
    let (status, ctype, body, digest) = match found {
        Some((t, b, d)) => ("200 OK", t, b, Some(d)),
        None if path == "/v2/" || path == "/v2" => {
            ("200 OK", "application/json", Arc::new(b"{}".to_vec()), None)
        }
        None => (
            "404 Not Found",
            "application/json",
            Arc::new(br#"{"errors":[{"code":"NOT_FOUND","message":"not found"}]}"#.to_vec()),
            None,
        ),
    };
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\
         Docker-Distribution-API-Version: registry/2.0\r\nConnection: close\r\n",
        body.len()
    );
    if let Some(d) = digest {
        head.push_str(&format!("Docker-Content-Digest: {d}\r\n"));
    }
    head.push_str("\r\n");
    w.write_all(head.as_bytes())?;
    if method != "HEAD" {
        w.write_all(&body)?;
    }
    w.flush()
}

/// `/v2/<name>/manifests/<ref>` or `/v2/<name>/blobs/<digest>`.
fn lookup(path: &str, store: &Mutex<Store>) -> Option<(&'static str, Arc<Vec<u8>>, String)> {
    let rest = path.strip_prefix("/v2/")?;
    let s = store.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((name, reference)) = rest.rsplit_once("/manifests/") {
        let digest = if reference.starts_with("sha256:") {
            reference.to_owned()
        } else {
            s.tags.get(&format!("{name}:{reference}"))?.clone()
        };
        let (t, b) = s.content.get(&digest)?;
        return (*t == MANIFEST_TYPE).then(|| (*t, b.clone(), digest));
    }
    let (_, digest) = rest.rsplit_once("/blobs/")?;
    let (t, b) = s.content.get(digest)?;
    Some((*t, b.clone(), digest.to_owned()))
}
