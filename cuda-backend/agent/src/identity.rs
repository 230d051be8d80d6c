//! This process's identity as an exporter of device memory: 128 random bits, made at the first
//! need and kept for the life of the process (CRIU restores it with the process's memory, so a
//! restored exporter is the same exporter). A forked child gets its own.
//!
//! Importers record it with the exporter's pid, and the plugin matches every import to an
//! export of that pid *and* that key: should the exporter exit and its pid be used again by
//! another process of the agent's, its exports carry another key, and a dump refuses the import
//! instead of mapping that process's memory in its place. The legacy IPC service uses it as its
//! key too ([`crate::ipc`]): knowing it lets one open the exporter's handles, as the handle's own
//! bytes do.

use std::io;
use std::sync::Mutex;

/// (pid it was made in, key).
static KEY: Mutex<Option<(u32, [u8; 16])>> = Mutex::new(None);

/// This process's key, made now if this process has none yet.
pub fn key() -> io::Result<[u8; 16]> {
    let pid = std::process::id();
    let mut k = KEY.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((p, key)) = *k
        && p == pid
    {
        return Ok(key);
    }
    let key = random_key()?;
    *k = Some((pid, key));
    Ok(key)
}

fn random_key() -> io::Result<[u8; 16]> {
    let mut key = [0u8; 16];
    let mut got = 0;
    while got < key.len() {
        // SAFETY: the buffer's remaining bytes are writable.
        let n = unsafe { libc::getrandom(key[got..].as_mut_ptr().cast(), key.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        got += n as usize;
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_per_process() {
        let a = key().expect("getrandom");
        assert_eq!(key().expect("getrandom"), a);
        assert_ne!(a, [0; 16]);
    }
}
