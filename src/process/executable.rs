//! Finding the file a program name would run, the way `execvp` does but stricter: only
//! absolute PATH entries count (an empty or relative entry would depend on the current
//! directory), and a candidate must be a regular file with an execute bit.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Where `name` would be run from with this process's PATH: see [`find_executable_in`]
/// (a name containing `/` is taken relative to the current directory).
pub fn find_executable(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH");
    find_executable_in(name, path.as_deref(), &[], Path::new(""))
}

/// Where `name` would be run from. A name containing `/` is a path, relative to `base`
/// unless absolute, and is the answer if it is executable. Any other name is looked up
/// in the absolute directories of `path` (a PATH-style list), then in `extra_dirs`; the
/// first executable file of that name wins. An empty name finds nothing.
pub fn find_executable_in(
    name: &str,
    path: Option<&OsStr>,
    extra_dirs: &[PathBuf],
    base: &Path,
) -> Option<PathBuf> {
    if name.is_empty() {
        return None;
    }
    if name.contains('/') {
        let candidate = base.join(name);
        return is_executable(&candidate).then_some(candidate);
    }
    let path_dirs = path
        .into_iter()
        .flat_map(std::env::split_paths)
        .filter(|dir| dir.is_absolute());
    path_dirs
        .chain(extra_dirs.iter().cloned())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// A regular file (after following symlinks) with at least one execute bit set.
pub fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::fs;
    use std::os::unix::fs::symlink;

    use super::*;

    /// A directory holding `tool` (executable), `data` (not executable) and `sub/`.
    fn fixture() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let tool = dir.path().join("tool");
        fs::write(&tool, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&tool, fs::Permissions::from_mode(0o755)).unwrap();
        let data = dir.path().join("data");
        fs::write(&data, "x").unwrap();
        fs::set_permissions(&data, fs::Permissions::from_mode(0o644)).unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        fs::set_permissions(dir.path().join("sub"), fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    fn path_of(dirs: &[&Path]) -> OsString {
        std::env::join_paths(dirs).unwrap()
    }

    #[test]
    fn searches_path_in_order() {
        let first = fixture();
        let second = fixture();
        let path = path_of(&[Path::new("/nonexistent"), first.path(), second.path()]);
        let base = Path::new("/");
        assert_eq!(
            find_executable_in("tool", Some(&path), &[], base),
            Some(first.path().join("tool"))
        );
        assert_eq!(find_executable_in("tool", None, &[], base), None);
        assert_eq!(find_executable_in("missing", Some(&path), &[], base), None);
        assert_eq!(find_executable_in("", Some(&path), &[], base), None);
    }

    #[test]
    fn needs_an_executable_regular_file() {
        let dir = fixture();
        let path = path_of(&[dir.path()]);
        let base = Path::new("/");
        assert_eq!(find_executable_in("data", Some(&path), &[], base), None);
        assert_eq!(find_executable_in("sub", Some(&path), &[], base), None);
        assert!(is_executable(&dir.path().join("tool")));
        assert!(!is_executable(&dir.path().join("data")));
        assert!(!is_executable(&dir.path().join("sub")));

        symlink(dir.path().join("tool"), dir.path().join("link")).unwrap();
        assert_eq!(
            find_executable_in("link", Some(&path), &[], base),
            Some(dir.path().join("link"))
        );
        symlink(dir.path().join("gone"), dir.path().join("dangling")).unwrap();
        assert_eq!(find_executable_in("dangling", Some(&path), &[], base), None);
    }

    #[test]
    fn skips_relative_path_entries() {
        let dir = fixture();
        // The fixture as a path relative to the current directory, and an empty entry (the
        // current directory): neither is searched, since both move with the directory.
        let cwd = std::env::current_dir().expect("cwd");
        let up = "../".repeat(cwd.components().count() - 1);
        let relative = PathBuf::from(up).join(dir.path().strip_prefix("/").unwrap());
        assert!(
            relative.join("tool").is_file(),
            "the relative entry reaches the fixture"
        );
        let path = std::env::join_paths([relative, PathBuf::new()]).unwrap();
        assert_eq!(
            find_executable_in("tool", Some(&path), &[], dir.path()),
            None
        );
    }

    #[test]
    fn extra_dirs_come_after_path() {
        let on_path = fixture();
        let extra = fixture();
        let path = path_of(&[on_path.path()]);
        let extra_dirs = [PathBuf::from("/nonexistent"), extra.path().to_path_buf()];
        let base = Path::new("/");
        assert_eq!(
            find_executable_in("tool", Some(&path), &extra_dirs, base),
            Some(on_path.path().join("tool"))
        );
        assert_eq!(
            find_executable_in("tool", None, &extra_dirs, base),
            Some(extra.path().join("tool"))
        );
        let empty = OsString::new();
        assert_eq!(
            find_executable_in("tool", Some(&empty), &extra_dirs, base),
            Some(extra.path().join("tool"))
        );
    }

    #[test]
    fn names_with_a_slash_are_paths() {
        let dir = fixture();
        let elsewhere = fixture();
        let path = path_of(&[elsewhere.path()]);
        let extra_dirs = [elsewhere.path().to_path_buf()];
        // Relative to the base, never searched on PATH or in the extra dirs.
        assert_eq!(
            find_executable_in("./tool", Some(&path), &extra_dirs, dir.path()),
            Some(dir.path().join("./tool"))
        );
        assert_eq!(
            find_executable_in("sub/tool", Some(&path), &extra_dirs, dir.path()),
            None
        );
        assert_eq!(
            find_executable_in("./data", Some(&path), &extra_dirs, dir.path()),
            None
        );
        // Absolute paths ignore the base.
        let absolute = dir.path().join("tool");
        assert_eq!(
            find_executable_in(
                absolute.to_str().unwrap(),
                None,
                &[],
                Path::new("/elsewhere")
            ),
            Some(absolute.clone())
        );
        assert_eq!(find_executable(absolute.to_str().unwrap()), Some(absolute));
    }

    #[test]
    fn finds_programs_on_this_process_path() {
        let sh = find_executable("sh").expect("sh is on PATH");
        assert!(sh.is_absolute() && sh.ends_with("sh"));
        assert_eq!(find_executable("agentry-no-such-program"), None);
    }
}
