//! Records which build this is: `GPUSNAP_BUILD=<version>+<commit>` for rustc, where `<commit>` is
//! the short git hash of HEAD, with `-dirty` when the work tree has changes, or `unknown` when the
//! source is not a git checkout (a tarball) or git is missing.
//!
//! This is the build script of the `gpusnap-image` crate, which exports the result as
//! `gpusnap_image::BUILD`; the plugin and the CLI read it from there, so everything linked into
//! one binary reports the same build. Cargo runs a build script in its package's directory, so
//! git commands below run in `common/image/`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let version = std::env::var("CARGO_PKG_VERSION").expect("cargo sets CARGO_PKG_VERSION");
    let commit = git_commit().unwrap_or_else(|| {
        // Nothing of git to watch. Naming a file turns off cargo's default of rerunning this
        // script whenever any file of the package changes.
        println!("cargo:rerun-if-changed=Cargo.toml");
        "unknown".to_owned()
    });
    println!("cargo:rustc-env=GPUSNAP_BUILD={version}+{commit}");
}

/// The commit of HEAD, `-dirty` appended if the tree has changes; `None` if this is not a git
/// checkout of this source.
///
/// Asks cargo to rerun the script when HEAD moves: HEAD itself (another branch checked out), the
/// ref it points to (a commit; loose or in packed-refs) and the index (staged changes, so that
/// `-dirty` follows `git add` and `git commit`). An edit that is not staged is not seen until one
/// of these changes.
fn git_commit() -> Option<String> {
    // A tarball unpacked inside some other repository must not report that repository's commit:
    // trust git only if it tracks this package.
    git(&["ls-files", "--error-unmatch", "--", "Cargo.toml"])?;

    // In a `git worktree`, .git is a file: HEAD and the index are in the worktree's own git
    // directory, branches in the common one. Ask git where both are.
    let git_dir = PathBuf::from(git(&["rev-parse", "--absolute-git-dir"])?);
    let common_dir = absolute(&git(&["rev-parse", "--git-common-dir"])?);
    watch(&git_dir.join("HEAD"));
    watch(&git_dir.join("index"));
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(&common_dir.join(branch));
    }
    watch(&common_dir.join("packed-refs"));

    let hash = git(&["rev-parse", "--short", "HEAD"])?;
    // --no-optional-locks: do not refresh the index, which would trigger a rerun next build.
    let changes = git(&["--no-optional-locks", "status", "--porcelain"])?;
    Some(if changes.is_empty() {
        hash
    } else {
        format!("{hash}-dirty")
    })
}

/// Reruns the build script when `path` changes. Paths that do not exist are skipped: cargo would
/// treat them as changed on every build (a ref that is only in packed-refs has no file; once it
/// is packed, its deleted file triggers the rerun that stops watching it).
fn watch(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// `path` as git printed it, made absolute (git prints some paths relative to the directory it
/// ran in, which is this script's).
fn absolute(path: &str) -> PathBuf {
    let path = Path::new(path);
    if path.is_absolute() {
        path.to_owned()
    } else {
        std::env::current_dir()
            .expect("the build script's directory")
            .join(path)
    }
}

/// Runs `git args` and returns its output, trimmed, if it succeeded.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_owned())
}
