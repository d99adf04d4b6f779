//! Reading and writing files of a workspace on an agent's behalf (the mock's `/write`,
//! ACP's `fs/read_text_file` and `fs/write_text_file`), confined to the workspace.
//!
//! - No path component may name git's metadata: `.git` in any case, with the trailing
//!   dots or spaces, ignorable characters or alternate stream suffix some file systems
//!   drop, or its 8.3 short name `git~1`. Git config, hooks and a `.git` file are the
//!   server's to trust, never an agent's to write.
//! - The path is walked from a descriptor of the canonical workspace root, one
//!   component at a time (`openat` with `O_NOFOLLOW`), creating missing directories
//!   for writes with `mkdirat`, so nothing between a check and its use can swap a
//!   directory for a symlink. A directory symlink on the way is followed only when its
//!   canonical target is inside the workspace and outside `.git`, and the directory
//!   then held is checked again by its real path.
//! - The file itself is opened with `O_NOFOLLOW` (a symlink in the last component is
//!   refused, wherever it points) and must be a regular file with a single link (a
//!   hard link could be another name of a file outside), checked on the open
//!   descriptor before anything is written.
//!
//! A refused path changes nothing on disk outside the workspace.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// Why a file request failed.
#[derive(Debug)]
pub enum FileError {
    /// The path is not one an agent may use; the text says why.
    Refused(&'static str),
    Io(std::io::Error),
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::Refused(why) => f.write_str(why),
            FileError::Io(e) => e.fmt(f),
        }
    }
}

impl From<std::io::Error> for FileError {
    fn from(e: std::io::Error) -> Self {
        FileError::Io(e)
    }
}

const OUTSIDE: FileError = FileError::Refused("the path leads outside the workspace");
const GIT: FileError = FileError::Refused("paths inside .git are not for agents");

/// Whether a file system could take `name` for `.git`.
pub fn is_git_name(name: &OsStr) -> bool {
    let Ok(name) = std::str::from_utf8(name.as_bytes()) else {
        return false;
    };
    // Characters HFS+ ignores in names.
    let kept: String = name
        .chars()
        .filter(
            |c| !matches!(*c as u32, 0x200C..=0x200F | 0x202A..=0x202E | 0x206A..=0x206F | 0xFEFF),
        )
        .collect::<String>()
        .to_lowercase();
    // NTFS: an alternate data stream suffix, then trailing dots and spaces.
    let base = kept.split(':').next().unwrap_or_default();
    let base = base.trim_end_matches(['.', ' ']);
    base == ".git" || base == "git~1"
}

/// The components of `relative`, refusing anything that leaves the workspace or
/// names `.git`.
fn components(relative: &Path) -> Result<Vec<CString>, FileError> {
    let mut names = Vec::new();
    for component in relative.components() {
        match component {
            Component::Normal(name) if is_git_name(name) => return Err(GIT),
            Component::Normal(name) => {
                names.push(CString::new(name.as_bytes()).map_err(|_| OUTSIDE)?)
            }
            Component::CurDir => {}
            _ => return Err(OUTSIDE),
        }
    }
    if names.is_empty() {
        return Err(OUTSIDE);
    }
    Ok(names)
}

/// `path` relative to `root`, for a path given absolute (or relative to `root`).
pub fn relative_to(root: &Path, path: &Path) -> Result<PathBuf, FileError> {
    if path.is_relative() {
        return Ok(path.to_path_buf());
    }
    if let Ok(relative) = path.strip_prefix(root) {
        return Ok(relative.to_path_buf());
    }
    // The workspace by another spelling (the session's cwd as given, under a symlinked
    // directory): its directories canonicalized, the file's own name kept as is. The
    // walk from the root still applies every rule to the result.
    let name = path.file_name().ok_or(OUTSIDE)?;
    let mut existing = path.parent().ok_or(OUTSIDE)?;
    let mut missing = Vec::new();
    let canonical = loop {
        match std::fs::canonicalize(existing) {
            Ok(canonical) => break canonical,
            Err(_) => {
                missing.push(existing.file_name().ok_or(OUTSIDE)?);
                existing = existing.parent().ok_or(OUTSIDE)?;
            }
        }
    };
    let mut full = canonical;
    full.extend(missing.into_iter().rev());
    full.push(name);
    full.strip_prefix(root)
        .map(Path::to_path_buf)
        .map_err(|_| OUTSIDE)
}

fn open_flags(flags: libc::c_int) -> libc::c_int {
    flags | libc::O_CLOEXEC | libc::O_NOFOLLOW
}

fn openat(
    dir: &OwnedFd,
    name: &CString,
    flags: libc::c_int,
    mode: libc::c_uint,
) -> std::io::Result<OwnedFd> {
    // SAFETY: a live descriptor and a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), open_flags(flags), mode) };
    if fd < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        // SAFETY: a descriptor just opened and owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// The real path of the directory `fd` holds.
fn real_path(fd: &OwnedFd) -> Result<PathBuf, FileError> {
    Ok(std::fs::read_link(format!(
        "/proc/self/fd/{}",
        fd.as_raw_fd()
    ))?)
}

/// Checks that `path` is `root` or inside it, and not inside `.git`.
fn check_inside(root: &Path, path: &Path) -> Result<(), FileError> {
    let relative = path.strip_prefix(root).map_err(|_| OUTSIDE)?;
    if relative.components().any(|c| is_git_name(c.as_os_str())) {
        return Err(GIT);
    }
    Ok(())
}

fn open_root(root: &Path) -> Result<(PathBuf, OwnedFd), FileError> {
    let root = std::fs::canonicalize(root)?;
    let c = CString::new(root.as_os_str().as_bytes()).map_err(|_| OUTSIDE)?;
    // SAFETY: a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: a descriptor just opened and owned by nobody else.
    Ok((root, unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The directory `name` in `dir` (made when missing and `create`), following a
/// symlink only to a directory inside the workspace.
fn enter(root: &Path, dir: &OwnedFd, name: &CString, create: bool) -> Result<OwnedFd, FileError> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY;
    match openat(dir, name, flags, 0) {
        Ok(fd) => return Ok(fd),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) && create => {
            // SAFETY: a live descriptor and a NUL-terminated name.
            let made = unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o777) };
            if made < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EEXIST) {
                    return Err(e.into());
                }
            }
            return openat(dir, name, flags, 0).map_err(|_| OUTSIDE);
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {}
        Err(e) => return Err(e.into()),
    }
    // A symlink (or a file) in the way: follow it only to a directory inside.
    let link = real_path(dir)?.join(OsStr::from_bytes(name.as_bytes()));
    let target = std::fs::canonicalize(&link).map_err(|_| OUTSIDE)?;
    check_inside(root, &target)?;
    let c = CString::new(target.as_os_str().as_bytes()).map_err(|_| OUTSIDE)?;
    // SAFETY: a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(OUTSIDE);
    }
    // SAFETY: a descriptor just opened and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    check_inside(root, &real_path(&fd)?)?;
    Ok(fd)
}

/// Opens `relative` under `root` with `flags` (see the module documentation).
fn open_inside(root: &Path, relative: &Path, flags: libc::c_int) -> Result<File, FileError> {
    let names = components(relative)?;
    let (root, mut dir) = open_root(root)?;
    let create = flags & libc::O_CREAT != 0;
    let (last, parents) = names.split_last().ok_or(OUTSIDE)?;
    for name in parents {
        dir = enter(&root, &dir, name, create)?;
    }
    check_inside(&root, &real_path(&dir)?)?;
    let fd = openat(&dir, last, flags | libc::O_NONBLOCK, 0o666).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            FileError::Refused("the path is a symlink")
        } else {
            FileError::Io(e)
        }
    })?;
    let file = File::from(fd);
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(FileError::Refused("the path is not a regular file"));
    }
    if meta.nlink() > 1 {
        return Err(FileError::Refused("the file has other names (hard links)"));
    }
    Ok(file)
}

/// Writes `content` to `relative` (relative to the workspace `root`), creating
/// missing directories.
pub async fn write(root: &Path, relative: &Path, content: Vec<u8>) -> Result<(), FileError> {
    let (root, relative) = (root.to_path_buf(), relative.to_path_buf());
    tokio::task::spawn_blocking(move || {
        let mut file = open_inside(&root, &relative, libc::O_WRONLY | libc::O_CREAT)?;
        file.set_len(0)?;
        file.write_all(&content)?;
        Ok(())
    })
    .await
    .map_err(|e| FileError::Io(std::io::Error::other(e)))?
}

/// Reads `relative` (relative to the workspace `root`) as text.
pub async fn read(root: &Path, relative: &Path) -> Result<String, FileError> {
    let (root, relative) = (root.to_path_buf(), relative.to_path_buf());
    tokio::task::spawn_blocking(move || {
        let mut file = open_inside(&root, &relative, libc::O_RDONLY)?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        Ok(text)
    })
    .await
    .map_err(|e| FileError::Io(std::io::Error::other(e)))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_names_in_every_spelling() {
        for name in [
            ".git",
            ".GIT",
            ".Git",
            ".git.",
            ".git ",
            ".git::$INDEX_ALLOCATION",
            "GIT~1",
            ".g\u{200c}it",
        ] {
            assert!(is_git_name(OsStr::new(name)), "{name}");
        }
        for name in [".gitignore", ".github", "git", ".gitattributes", "x.git"] {
            assert!(!is_git_name(OsStr::new(name)), "{name}");
        }
    }

    #[tokio::test]
    async fn writes_stay_inside_and_out_of_git() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("ws");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("file"), "precious").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.join("file"), root.join("filelink")).unwrap();
        std::os::unix::fs::symlink(root.join(".git"), root.join("gitlink")).unwrap();
        std::fs::hard_link(outside.join("file"), root.join("hard")).unwrap();

        for bad in [
            ".git/config",
            "sub/.git/x",
            ".GIT/config",
            "link/x",
            "link/new/x",
            "filelink",
            "gitlink/config",
            "hard",
            "../outside/file",
            "/etc/x",
        ] {
            let err = write(&root, Path::new(bad), b"evil".to_vec()).await;
            assert!(matches!(err, Err(FileError::Refused(_))), "{bad}: {err:?}");
        }
        assert_eq!(
            std::fs::read_to_string(outside.join("file")).unwrap(),
            "precious"
        );
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
        assert!(!root.join("sub").exists());
        assert_eq!(std::fs::read_dir(root.join(".git")).unwrap().count(), 0);

        write(&root, Path::new("a/b/c.txt"), b"ok".to_vec())
            .await
            .unwrap();
        assert_eq!(read(&root, Path::new("a/b/c.txt")).await.unwrap(), "ok");
        write(&root, Path::new("a/b/c.txt"), b"k".to_vec())
            .await
            .unwrap();
        assert_eq!(read(&root, Path::new("./a/b/c.txt")).await.unwrap(), "k");
        assert!(matches!(
            read(&root, Path::new("filelink")).await,
            Err(FileError::Refused(_))
        ));
        assert!(matches!(
            read(&root, Path::new("link/file")).await,
            Err(FileError::Refused(_))
        ));
        // A directory symlink that stays inside is fine.
        std::os::unix::fs::symlink(root.join("a"), root.join("alias")).unwrap();
        assert_eq!(read(&root, Path::new("alias/b/c.txt")).await.unwrap(), "k");
    }
}
