//! Whether some process holds a file open for writing, asked of the system rather than of
//! the file watch's events.
//!
//! The watch knows a writer only by its events: a writer that opened the policy file before
//! the control plane started, or through a path no watch hears (a hard link elsewhere), is
//! unknown to it, and a read while that writer pauses would publish half of its save. On
//! Linux, `/proc/PID/fdinfo/FD` gives, for every file each process has open, its access mode,
//! its mount and its inode number (`ino:`, Linux 5.14 and later), and `/proc/PID/mountinfo`
//! the device of that mount, so [`held_open_for_writing`] looks there for the policy file's
//! own device and inode, through whichever mount a writer reached it (what
//! `fuser` and `lsof` do; written here because no maintained crate answers "is this file open
//! for writing" without running one of them). Only `/proc` is read, never another process's
//! file itself: a file on a file system that has stopped answering (a stale NFS mount, a hung
//! FUSE daemon), which a `stat` through `/proc/PID/fd` would wait on for good, costs nothing
//! here, and the policy file is looked at only if it is a regular file (opening a FIFO would
//! wait). It sees the processes this one may look at: all of them as root or as their user, in
//! the same PID namespace, whatever their mount namespace (a writer in another container, or
//! on the host of this one, is not seen). It looks at [`MAX_FDS`] open files at most, and says no past them (a host with more
//! than that many open files is not searched, rather than searched for seconds). Elsewhere,
//! and on kernels whose `fdinfo` has no `ino:`, it says no.

use std::path::Path;

/// The most open files one look goes through (a few microseconds each).
pub(crate) const MAX_FDS: usize = 200_000;

/// Whether a process this one can see has `path`'s file open for writing (read-write
/// included). `false` when it cannot tell (no `/proc`, the file gone, past [`MAX_FDS`]).
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

    use super::MAX_FDS;

    /// `O_ACCMODE`: the access mode bits of a file's flags; 0 is read-only.
    const ACCESS_MODE: u32 = 0o3;

    /// What `/proc/PID/fdinfo/FD` says of one open file.
    #[derive(Debug, PartialEq, Eq)]
    pub(super) struct FdInfo {
        pub(super) writes: bool,
        pub(super) mount: u64,
        pub(super) inode: u64,
    }

    pub(super) fn held_open_for_writing(path: &Path) -> bool {
        // The policy file's own device and inode. Only a regular file is looked for: opening
        // nothing, a FIFO among them, which would wait for a writer of its own.
        let Ok(file) = fs::metadata(path) else {
            return false;
        };
        if !file.is_file() {
            return false;
        }
        let device = (major(file.dev()), minor(file.dev()));
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
            let Ok(fds) = fs::read_dir(process.path().join("fdinfo")) else {
                continue;
            };
            for fd in fds.flatten() {
                looked += 1;
                if looked > MAX_FDS {
                    return false;
                }
                let Some(info) = fs::read_to_string(fd.path()).ok().and_then(|t| parse(&t)) else {
                    continue;
                };
                // The inode first (cheap); then the device of the holder's mount, from its own
                // mount table: the same file reached through another mount (a bind mount,
                // another mount namespace) has another mount id but the same device.
                if info.writes
                    && info.inode == file.ino()
                    && mount_device(&process.path(), info.mount) == Some(device)
                {
                    return true;
                }
            }
        }
        false
    }

    /// The `major:minor` device of mount `id` in `/proc/PID/mountinfo` of the process at
    /// `process` (`/proc/PID`).
    fn mount_device(process: &Path, id: u64) -> Option<(u64, u64)> {
        let table = fs::read_to_string(process.join("mountinfo")).ok()?;
        table.lines().find_map(|line| {
            let mut fields = line.split_ascii_whitespace();
            (fields.next()?.parse::<u64>().ok()? == id).then_some(())?;
            let (major, minor) = fields.nth(1)?.split_once(':')?;
            Some((major.parse().ok()?, minor.parse().ok()?))
        })
    }

    /// Linux's `dev_t` layout (glibc's `gnu_dev_major` and `gnu_dev_minor`).
    fn major(dev: u64) -> u64 {
        ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff)
    }

    fn minor(dev: u64) -> u64 {
        (dev & 0xff) | ((dev >> 12) & !0xff)
    }

    /// The access mode, mount and inode of an fdinfo text (`flags:` in octal, `mnt_id:`,
    /// `ino:`); `None` without all three.
    pub(super) fn parse(fdinfo: &str) -> Option<FdInfo> {
        let (mut flags, mut mount, mut inode) = (None, None, None);
        for line in fdinfo.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match key {
                "flags" => flags = u32::from_str_radix(value, 8).ok(),
                "mnt_id" => mount = value.parse().ok(),
                "ino" => inode = value.parse().ok(),
                _ => {}
            }
        }
        Some(FdInfo {
            writes: flags? & ACCESS_MODE != 0,
            mount: mount?,
            inode: inode?,
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_access_mode_mount_and_inode_are_read_from_fdinfo() {
            let info = |writes, mount, inode| {
                Some(FdInfo {
                    writes,
                    mount,
                    inode,
                })
            };
            assert_eq!(
                parse("pos:\t0\nflags:\t0100000\nmnt_id:\t24\nino:\t3\n"),
                info(false, 24, 3)
            );
            assert_eq!(
                parse("pos:\t0\nflags:\t02100001\nmnt_id:\t1\nino:\t77\n"),
                info(true, 1, 77)
            );
            assert_eq!(
                parse("flags:\t0100002\nmnt_id:\t1\nino:\t9\n"),
                info(true, 1, 9)
            );
            // An older kernel (no `ino:`), or a text that says something else: no answer.
            assert_eq!(parse("pos:\t0\nflags:\t0100002\nmnt_id:\t1\n"), None);
            assert_eq!(parse("flags:\tnot octal\nmnt_id:\t1\nino:\t9\n"), None);
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

    /// A FIFO at the path is not opened (that waits for a writer for good): start-up goes on
    /// to the read, which refuses it.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_fifo_at_the_path_is_not_waited_on() {
        use std::os::unix::fs::OpenOptionsExt as _;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("policies.yaml");
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let (tx, rx) = std::sync::mpsc::channel();
        let asked = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send(held_open_for_writing(&asked));
        });
        let answered = rx.recv_timeout(std::time::Duration::from_secs(10));
        // Should it be waiting: a writer opening the FIFO ends its open.
        let _unblock = fs::OpenOptions::new()
            .write(true)
            .custom_flags(0o4000) // O_NONBLOCK
            .open(&path);
        assert_eq!(answered, Ok(false), "waited on the FIFO");
    }

    /// The same file reached through another mount (a bind mount here; another mount
    /// namespace is the same case) has another mount id but the same device: its writer is
    /// seen. Needs root (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_writer_through_another_mount_of_the_file_is_seen() {
        use std::process::Command;
        let dir = tempfile::tempdir().expect("temp dir");
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        fs::create_dir(&src).expect("src");
        fs::create_dir(&dst).expect("dst");
        fs::write(src.join("policies.yaml"), "version: 1\n").expect("write");
        let mounted = Command::new("mount")
            .arg("--bind")
            .arg(&src)
            .arg(&dst)
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("skipped: cannot bind-mount here (needs root)");
            return;
        }
        let writer = fs::OpenOptions::new()
            .append(true)
            .open(src.join("policies.yaml"))
            .expect("open for writing");
        let seen = held_open_for_writing(&dst.join("policies.yaml"));
        drop(writer);
        let unseen = held_open_for_writing(&dst.join("policies.yaml"));
        let _ = Command::new("umount").arg(&dst).status();
        assert!(seen, "held open for writing through the other mount");
        assert!(!unseen, "closed");
    }
}
