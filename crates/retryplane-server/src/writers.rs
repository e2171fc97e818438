//! Whether some process holds a file open for writing, asked of the system rather than of
//! the file watch's events.
//!
//! The watch knows a writer only by its events: a writer that opened the policy file before
//! the control plane started, or through a path no watch hears (a hard link elsewhere), is
//! unknown to it, and a read while that writer pauses would publish half of its save. On
//! Linux, `/proc/PID/fd` names every file each process has open and `/proc/PID/fdinfo/FD` its
//! access mode, so [`held_open_for_writing`] looks there (what `fuser` and `lsof` do: written
//! here because no maintained crate answers "is this file open for writing" without running
//! one of them). It sees the processes this one may look at: all of them as root or as their
//! user, in the same PID namespace (a writer in another container, or on the host of this
//! one, is not seen). Elsewhere it says no.

use std::path::Path;

/// Whether a process this one can see has `path`'s file open for writing (read-write
/// included). `false` when it cannot tell (no `/proc`, the file gone).
pub(crate) fn held_open_for_writing(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        linux::held_open_for_writing(path)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::fs;
    use std::os::unix::fs::MetadataExt as _;
    use std::path::Path;

    /// The most open files looked at in one call: a bound on its cost on a host with a very
    /// large number of them (past it, the answer is no, as without `/proc`).
    const MAX_FDS: usize = 500_000;

    /// `O_ACCMODE`: the access mode bits of a file's flags; 0 is read-only.
    const ACCESS_MODE: u32 = 0o3;

    pub(super) fn held_open_for_writing(path: &Path) -> bool {
        let Ok(file) = fs::metadata(path) else {
            return false;
        };
        let Ok(processes) = fs::read_dir("/proc") else {
            return false;
        };
        let mut looked = 0usize;
        for process in processes.flatten() {
            let name = process.file_name();
            if !name.as_encoded_bytes().iter().all(u8::is_ascii_digit) {
                continue;
            }
            // A process that ended meanwhile, or one this one may not look at, is passed over.
            let Ok(fds) = fs::read_dir(process.path().join("fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                looked += 1;
                if looked > MAX_FDS {
                    return false;
                }
                // `metadata` follows the link to the open file itself, whatever its name now.
                let Ok(open) = fs::metadata(fd.path()) else {
                    continue;
                };
                if open.dev() != file.dev() || open.ino() != file.ino() {
                    continue;
                }
                let info = process.path().join("fdinfo").join(fd.file_name());
                if fs::read_to_string(info).is_ok_and(|info| writes(&info)) {
                    return true;
                }
            }
        }
        false
    }

    /// Whether an fdinfo text's `flags:` (octal) open the file for writing.
    fn writes(fdinfo: &str) -> bool {
        fdinfo
            .lines()
            .find_map(|line| line.strip_prefix("flags:"))
            .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok())
            .is_some_and(|flags| flags & ACCESS_MODE != 0)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_access_mode_is_read_from_the_flags() {
            assert!(!writes("pos:\t0\nflags:\t0100000\nmnt_id:\t1\n"));
            assert!(writes("pos:\t0\nflags:\t02100001\nmnt_id:\t1\n"));
            assert!(writes("pos:\t0\nflags:\t0100002\n"));
            assert!(!writes("pos:\t0\n"));
            assert!(!writes("flags:\tnot octal\n"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn a_file_open_for_writing_is_told_from_one_open_for_reading_or_closed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("policies.yaml");
        fs::write(&path, "version: 1\n").expect("write");
        assert!(!held_open_for_writing(&path), "closed");
        let reader = fs::File::open(&path).expect("open");
        assert!(!held_open_for_writing(&path), "open for reading only");
        let writer = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open for writing");
        assert!(held_open_for_writing(&path), "open for writing");
        // Through another name of the same file: the file is what counts.
        let link = dir.path().join("link.yaml");
        fs::hard_link(&path, &link).expect("link");
        assert!(
            held_open_for_writing(&link),
            "open for writing, under another name"
        );
        drop(writer);
        assert!(!held_open_for_writing(&path), "closed again");
        drop(reader);
        assert!(!held_open_for_writing(&dir.path().join("missing.yaml")));
    }
}
