//! Whether some process holds a file open for writing, asked of the system rather than of
//! the file watch's events.
//!
//! The watch knows a writer only by its events: a writer that opened the policy file before
//! the control plane started, or through a path no watch hears (a hard link elsewhere), is
//! unknown to it, and a read while that writer pauses would publish half of its save. On
//! Linux, `/proc/PID/fdinfo/FD` gives, for every file each process has open, its access mode,
//! its mount and its inode number (`ino:`, Linux 5.14 and later), and `/proc/PID/mountinfo`
//! the device of that mount, so [`held_open_for_writing`] looks there for the policy file's
//! own mount device and inode, through whichever mount a writer reached it (what
//! `fuser` and `lsof` do; written here because no maintained crate answers "is this file open
//! for writing" without running one of them). Only `/proc` is read for the other files, never
//! the files themselves: a file on a file system that has stopped answering (a stale NFS
//! mount, a hung FUSE daemon), which a `stat` through `/proc/PID/fd` would wait on for good,
//! costs nothing here. A descriptor's link is read first, and its `fdinfo` only when the link
//! names a file by path (`linux::may_be_a_file`; or is too long to read): the `fdinfo` of an
//! epoll waits for as long as that epoll's `epoll_ctl` waits on a hung FUSE daemon, and some
//! devices' take their driver's locks (a GPU's, a tun device's: those are passed over). The
//! policy file is looked at only if it is a regular file, through an `O_PATH` descriptor
//! (opening a FIFO would wait). What cannot be told is counted as a writer (a file by path on a
//! mount in no table, a POSIX message queue among them; on btrfs, a file of another subvolume
//! with the same inode number, held open for writing): a read is then late, up to the
//! watcher's bound, rather than half. A process whose main thread has ended is looked at
//! through its first thread that lists descriptors. A
//! reused descriptor number can still send the `fdinfo` read to an epoll in the microseconds
//! between the two reads. A thread with a descriptor table of its own (`unshare(CLONE_FILES)`) is
//! not looked at. It sees the processes this one may look at: all of them as root or as their
//! user, in the same PID namespace, whatever their mount namespace (a writer in another
//! container, or on the host of this one, is not seen). It looks at [`MAX_FDS`] open files at
//! most, and says no past them (a host with more than that many open files is not searched,
//! rather than searched for seconds). Elsewhere, and on kernels whose `fdinfo` has no `ino:`,
//! it says no.

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

/// [`held_open_for_writing`] on a blocking thread (it reads `/proc` at length); `false` if that
/// thread fails.
pub(crate) async fn held_open_for_writing_off_thread(path: &Path) -> bool {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || held_open_for_writing(&path))
        .await
        .unwrap_or(false)
}

#[cfg(target_os = "linux")]
mod linux {
    use std::fs;
    use std::os::fd::AsRawFd as _;
    use std::path::Path;

    use rustix::fs::{Mode, OFlags};

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
        // The policy file itself, through an `O_PATH` descriptor (which never waits, not even
        // on a FIFO): a regular file only; its own mount id and inode from this process's
        // `fdinfo`, and that mount's device from this process's mount table. A mount table
        // gives the device every holder's mount of the file gives too (a `stat` may say
        // another: btrfs gives each subvolume a device of its own, an overlay one of its own).
        let Ok(own_fd) = rustix::fs::open(
            path,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) else {
            return false;
        };
        let regular = rustix::fs::fstat(&own_fd).is_ok_and(|st| {
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
        });
        if !regular {
            return false;
        }
        let own_info = format!("/proc/self/fdinfo/{}", own_fd.as_raw_fd());
        let Some(own) = fs::read_to_string(own_info).ok().and_then(|t| parse(&t)) else {
            return false;
        };
        let Some(device) = mount_device(Path::new("/proc/self"), own.mount) else {
            return false;
        };
        let Ok(processes) = fs::read_dir("/proc") else {
            return false;
        };
        let mut look = Look {
            own: &own,
            device,
            looked: 0,
            link: Vec::new(),
            text: String::new(),
        };
        for process in processes.flatten() {
            let name = process.file_name();
            if !name.as_encoded_bytes().iter().all(u8::is_ascii_digit) {
                continue;
            }
            let process = process.path();
            match look.table(&process, &process) {
                Table::Held => return true,
                Table::TooMany => return false,
                Table::Looked(0) => {
                    // A process whose main thread has ended (`pthread_exit`) lists no
                    // descriptor of its own while its other threads hold theirs: look through
                    // the first of them that lists any (what `lsof` does).
                    let Ok(tasks) = fs::read_dir(process.join("task")) else {
                        continue;
                    };
                    for task in tasks.flatten() {
                        if task.file_name() == name {
                            continue;
                        }
                        match look.table(&task.path(), &process) {
                            Table::Held => return true,
                            Table::TooMany => return false,
                            Table::Looked(0) => {}
                            Table::Looked(_) => break,
                        }
                    }
                }
                Table::Looked(_) => {}
            }
        }
        false
    }

    /// What one look has found so far, and its buffers.
    struct Look<'a> {
        own: &'a FdInfo,
        device: (u64, u64),
        looked: usize,
        link: Vec<u8>,
        text: String,
    }

    /// What one descriptor table told.
    enum Table {
        /// A descriptor of the policy file, open for writing.
        Held,
        /// Past [`MAX_FDS`] descriptors in all.
        TooMany,
        /// None of these many is.
        Looked(usize),
    }

    impl Look<'_> {
        /// Looks through the descriptor table of `table` (`/proc/PID`, or a thread's
        /// `/proc/PID/task/TID`) of the process at `process`. A process that ended meanwhile,
        /// or one this one may not look at, has none.
        fn table(&mut self, table: &Path, process: &Path) -> Table {
            let dir = |sub: &str| {
                rustix::fs::open(
                    table.join(sub),
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
            };
            // Two directories opened once, each descriptor looked up in them (rather than by
            // a path from `/proc` for every read); the first read through as well.
            let (Ok(fd_dir), Ok(info_dir)) = (dir("fd"), dir("fdinfo")) else {
                return Table::Looked(0);
            };
            let Ok(mut fds) = rustix::fs::Dir::new(fd_dir) else {
                return Table::Looked(0);
            };
            let mut here = 0;
            while let Some(Ok(fd)) = fds.read() {
                let name = fd.file_name();
                if !name.to_bytes().first().is_some_and(u8::is_ascii_digit) {
                    continue;
                }
                here += 1;
                self.looked += 1;
                if self.looked > MAX_FDS {
                    return Table::TooMany;
                }
                let Ok(fd_dir) = fds.fd() else {
                    break;
                };
                // The link first: reading it calls into no file system and takes no lock a
                // process can hold for long, while reading an `fdinfo` runs the code of the
                // descriptor's kind, and some of it waits for good (an epoll's takes the
                // epoll's mutex, held by its `epoll_ctl` for as long as a hung FUSE daemon
                // keeps that waiting; some devices' take their driver's locks). So `fdinfo`
                // is read only for what may be the policy file: a file by path, or one whose
                // path is too long for a link (no kernel-made file's name is).
                let link =
                    match rustix::fs::readlinkat(fd_dir, name, std::mem::take(&mut self.link)) {
                        Ok(target) => {
                            if !may_be_a_file(target.as_bytes()) {
                                self.link = target.into_bytes();
                                continue;
                            }
                            Some(target)
                        }
                        Err(rustix::io::Errno::NAMETOOLONG) => None,
                        Err(_) => continue,
                    };
                let info = read_at(&info_dir, name, &mut self.text).and_then(parse);
                let by_path = link.as_ref().is_none_or(|l| on_a_real_mount(l.as_bytes()));
                if let Some(l) = link {
                    self.link = l.into_bytes();
                }
                let Some(info) = info else {
                    continue;
                };
                if !info.writes || info.inode != self.own.inode {
                    continue;
                }
                // The same mount, or one of the same device: in the holder's own table (a
                // bind mount, another mount namespace), else in this one's (a holder that left
                // the namespace it opened the file in). Files of one btrfs that share an inode
                // number (each subvolume numbers its own, and every mount of every subvolume
                // shows the file system's device) are not told apart: that would take a `stat`
                // of the holder's descriptor, which can follow a descriptor reused meanwhile to
                // any file system, a hung one included.
                if info.mount == self.own.mount {
                    return Table::Held;
                }
                match mount_device(process, info.mount)
                    .or_else(|| mount_device(Path::new("/proc/self"), info.mount))
                {
                    Some(holder) if holder == self.device => return Table::Held,
                    Some(_) => {}
                    // A file by path on a mount in no table (unmounted lazily, or left in a
                    // namespace gone since): counted as the file's (reading a save late beats
                    // publishing half of it).
                    None if by_path => return Table::Held,
                    None => {}
                }
            }
            Table::Looked(here)
        }
    }

    /// Whether a link to a file on a mount in no table may be to one on a real file system
    /// (unmounted lazily, or in a namespace gone since; its path is then relative to that
    /// mount's root, one component for a file at the root) rather than to one of the kernel's
    /// internal mounts: not a dma-buf's (`/dmabuf:NAME`, a name that may hold a `/`). A POSIX
    /// message queue's (`/NAME`) cannot be told from a file at the root of a mount unmounted
    /// lazily, and counts: a late read (at most the watcher's bound) rather than half a save.
    pub(super) fn on_a_real_mount(link: &[u8]) -> bool {
        !link.starts_with(b"/dmabuf:")
    }

    /// Whether a descriptor's link may name the policy file: a path, and not one of the names
    /// the kernel gives its own files, which live on internal mounts in no table and share
    /// inode numbers with files: `pipe:[…]`, `socket:[…]`, `anon_inode:[eventpoll]` and the
    /// like, and, starting with `/`, a memfd (`/memfd:NAME (deleted)`), a `memfd_secret`
    /// (`/secretmem (deleted)`), System V shared memory (`/SYSV` and eight hex digits,
    /// `(deleted)`) and a dma-buf (`/dmabuf:NAME`, no `/` after it). A real file's path may
    /// start the same way (a directory `/dev/cfg`, or `/memfd:cfg`, in a container of its own);
    /// only the kernel's exact forms are left out. Nor is a GPU's, an accelerator's or a tun
    /// device's node (`/dev/dri/`, `/dev/accel/`, `/dev/nvidia…`, `/dev/net/tun`), whose
    /// `fdinfo` takes its driver's locks.
    pub(super) fn may_be_a_file(link: &[u8]) -> bool {
        let deleted = |rest: &[u8]| rest.ends_with(b" (deleted)");
        let kernel_made = !link.starts_with(b"/")
            || link.strip_prefix(b"/memfd:").is_some_and(deleted)
            || link == b"/secretmem (deleted)"
            || link.strip_prefix(b"/SYSV").is_some_and(|rest| {
                rest.len() == 8 + b" (deleted)".len()
                    && rest[..8].iter().all(u8::is_ascii_hexdigit)
                    && deleted(rest)
            })
            || link
                .strip_prefix(b"/dmabuf:")
                .is_some_and(|name| !name.contains(&b'/'));
        let driver = [
            &b"/dev/dri/"[..],
            b"/dev/accel/",
            b"/dev/nvidia",
            b"/dev/net/tun",
        ]
        .iter()
        .any(|p| link.starts_with(p));
        !kernel_made && !driver
    }

    /// The text of `name` in the directory `dir` (an `fdinfo`), read into `text`.
    fn read_at<'t>(
        dir: &rustix::fd::OwnedFd,
        name: &std::ffi::CStr,
        text: &'t mut String,
    ) -> Option<&'t str> {
        use std::io::Read as _;
        let fd =
            rustix::fs::openat(dir, name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).ok()?;
        text.clear();
        fs::File::from(fd).read_to_string(text).ok()?;
        Some(text)
    }

    /// The `major:minor` device of mount `id` in `/proc/PID/mountinfo` of the process at
    /// `process` (`/proc/PID`, or `/proc/self`).
    fn mount_device(process: &Path, id: u64) -> Option<(u64, u64)> {
        let table = fs::read_to_string(process.join("mountinfo")).ok()?;
        table.lines().find_map(|line| {
            let mut fields = line.split_ascii_whitespace();
            (fields.next()?.parse::<u64>().ok()? == id).then_some(())?;
            let (major, minor) = fields.nth(1)?.split_once(':')?;
            Some((major.parse().ok()?, minor.parse().ok()?))
        })
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
pub(crate) mod tests {
    use std::fs;
    use std::path::PathBuf;

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

    /// Runs `cmd` through `sh`; whether it succeeded.
    #[cfg(target_os = "linux")]
    fn sh(cmd: &str) -> bool {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .status()
            .is_ok_and(|s| s.success())
    }

    /// An overlay whose upper layer is on another file system than its lower one: `stat`
    /// gives the file a device of the overlay's own, not the one its mount table shows.
    /// Needs root (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_writer_on_an_overlay_over_two_file_systems_is_seen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path().display();
        if !sh(&format!(
            "mkdir {d}/lower {d}/up {d}/t && echo 'version: 1' > {d}/lower/policies.yaml \
             && mount -t tmpfs tmpfs {d}/up && mkdir {d}/up/upper {d}/up/work \
             && mount -t overlay overlay -o lowerdir={d}/lower,upperdir={d}/up/upper,workdir={d}/up/work {d}/t"
        )) {
            sh(&format!("umount {d}/up"));
            eprintln!("skipped: cannot mount an overlay here (needs root)");
            return;
        }
        let path = dir.path().join("t/policies.yaml");
        let writer = fs::OpenOptions::new().append(true).open(&path);
        let seen = held_open_for_writing(&path);
        drop(writer);
        let unseen = held_open_for_writing(&path);
        sh(&format!("umount {d}/t; umount {d}/up"));
        assert!(seen, "a writer of the overlay's file was not seen");
        assert!(!unseen, "closed");
    }

    /// On btrfs `stat` gives every file its subvolume's device, never the one the mount
    /// table shows. Needs root and `mkfs.btrfs` (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_writer_of_a_file_on_btrfs_is_seen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path().display();
        if !sh(&format!(
            "truncate -s 200M {d}/img && mkfs.btrfs -q {d}/img >/dev/null 2>&1 && mkdir {d}/m \
             && mount -o loop {d}/img {d}/m"
        )) {
            eprintln!("skipped: cannot make a btrfs here (needs root and mkfs.btrfs)");
            return;
        }
        let path = dir.path().join("m/policies.yaml");
        let written = fs::write(&path, "version: 1\n");
        let writer = fs::OpenOptions::new().append(true).open(&path);
        let seen = held_open_for_writing(&path);
        drop(writer);
        sh(&format!("umount {d}/m"));
        assert!(written.is_ok());
        assert!(seen, "a writer of a file on btrfs was not seen");
    }

    /// A writer that opened the file and then moved to a mount namespace of its own (as a
    /// sandboxing launcher does): its descriptor's mount is in this process's table only.
    /// Needs root (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_writer_that_left_its_mount_namespace_after_the_open_is_seen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("policies.yaml");
        fs::write(&path, "version: 1\n").expect("write");
        let Ok(mut child) = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "exec 3>>'{}'; exec unshare -m sleep 30",
                path.display()
            ))
            .spawn()
        else {
            eprintln!("skipped: no sh");
            return;
        };
        let ns = |pid: &str| fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
        let pid = child.id().to_string();
        // Until the child has moved (at most 5 s).
        for _ in 0..250 {
            if ns(&pid) != ns("self") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let moved = ns(&pid) != ns("self");
        let seen = held_open_for_writing(&path);
        let _ = child.kill();
        let _ = child.wait();
        if !moved {
            eprintln!("skipped: cannot unshare a mount namespace here (needs root)");
            return;
        }
        assert!(seen, "the writer in its own mount namespace was not seen");
    }

    /// A writer through a bind mount that was then unmounted lazily: its mount is in no table,
    /// so it cannot be told, and counts as the file's. Needs root (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_writer_through_a_lazily_unmounted_bind_mount_is_seen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path().display();
        fs::create_dir(dir.path().join("real")).expect("mkdir");
        let path = dir.path().join("real/policies.yaml");
        fs::write(&path, "version: 1\n").expect("write");
        if !sh(&format!("mkdir {d}/b && mount --bind {d}/real {d}/b")) {
            eprintln!("skipped: cannot bind-mount here (needs root)");
            return;
        }
        let writer = fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join("b/policies.yaml"));
        let before = held_open_for_writing(&path);
        let unmounted = sh(&format!("umount -l {d}/b"));
        let after = held_open_for_writing(&path);
        drop(writer);
        let closed = held_open_for_writing(&path);
        assert!(unmounted, "umount -l");
        assert!(before, "seen while the bind mount is there");
        assert!(after, "seen once it is unmounted lazily");
        assert!(!closed, "closed");
    }

    /// The inode number of the kernel's anonymous inode (every eventfd, epoll, timerfd and
    /// inotify descriptor, opened read-write), from this process's own descriptors (a tokio
    /// runtime holds an epoll and an eventfd).
    #[cfg(target_os = "linux")]
    fn anon_inode_number() -> Option<u64> {
        for fd in fs::read_dir("/proc/self/fd").ok()?.flatten() {
            let target = fs::read_link(fd.path()).ok()?;
            if target.to_string_lossy().starts_with("anon_inode:") {
                let info = fs::read_to_string(format!(
                    "/proc/self/fdinfo/{}",
                    fd.file_name().to_string_lossy()
                ))
                .ok()?;
                return info
                    .lines()
                    .find_map(|l| l.strip_prefix("ino:"))
                    .and_then(|v| v.trim().parse().ok());
            }
        }
        None
    }

    /// A file nobody writes whose inode number is that of the kernel's anonymous inode (on a
    /// fresh tmpfs here; on any file system the number can come up): the anon-inode mount is
    /// in no mount table, and its descriptors are not the file's. Needs root (skipped
    /// otherwise).
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_file_sharing_an_inode_number_with_kernel_made_files_is_not_held() {
        let Some(anon) = anon_inode_number() else {
            eprintln!("skipped: no anonymous inode descriptor");
            return;
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let Some(found) = TmpfsFile::with_inode(dir.path(), anon) else {
            return;
        };
        let held = held_open_for_writing(&found.path);
        drop(found);
        assert!(
            !held,
            "a file nobody has open (inode {anon}) is said to be held"
        );
    }

    /// A file on a tmpfs of its own (unmounted on drop) with a chosen inode number (a fresh
    /// tmpfs numbers its files from a small number up).
    #[cfg(target_os = "linux")]
    pub(crate) struct TmpfsFile {
        pub(crate) path: PathBuf,
        _disk: crate::test_disk::SmallDisk,
    }

    #[cfg(target_os = "linux")]
    impl TmpfsFile {
        /// `None` (and why, on stderr) without root, or when no file gets `inode`.
        pub(crate) fn with_inode(dir: &Path, inode: u64) -> Option<Self> {
            use std::os::unix::fs::MetadataExt as _;
            // As large as a tmpfs is by default.
            let disk = crate::test_disk::SmallDisk::mount(dir, "50%")?;
            for i in 0..200_000u32 {
                let path = dir.join(format!("f{i}"));
                if fs::write(&path, "version: 1\n").is_err() {
                    break;
                }
                let ino = fs::metadata(&path).map_or(u64::MAX, |m| m.ino());
                if ino == inode {
                    return Some(Self { path, _disk: disk });
                }
                if ino > inode {
                    break;
                }
            }
            eprintln!("skipped: no file got inode {inode}");
            None
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn only_links_that_may_name_the_file_have_their_fdinfo_read() {
        use super::linux::may_be_a_file;
        for file in [
            &b"/srv/retryplane/policies.yaml"[..],
            b"/srv/policies.yaml (deleted)",
            b"/dev/shm/policies.yaml",
            // Real paths that start as the kernel's names do, in a container of their own
            // (a `/dev` of its own with a directory bound under it, a root made by
            // `pivot_root`).
            b"/dev/cfg/policies.yaml",
            b"/dev/termination-log",
            b"/SYSVcfg/policies.yaml",
            b"/memfd:cfg/policies.yaml",
            b"/dmabuf:cfg/policies.yaml",
        ] {
            assert!(may_be_a_file(file), "{}", String::from_utf8_lossy(file));
        }
        for kernel_made in [
            &b"anon_inode:[eventpoll]"[..],
            b"anon_inode:[eventfd]",
            b"pipe:[1234]",
            b"socket:[5678]",
            b"/memfd:wayland-shm (deleted)",
            b"/memfd: (deleted)",
            b"/secretmem (deleted)",
            b"/dmabuf:",
            b"/dmabuf:gem",
            b"/SYSV00000000 (deleted)",
            b"/SYSV5eed0a1f (deleted)",
            b"/dev/dri/card0",
            b"/dev/accel/accel0",
            b"/dev/nvidia0",
            b"/dev/net/tun",
        ] {
            assert!(
                !may_be_a_file(kernel_made),
                "{}",
                String::from_utf8_lossy(kernel_made)
            );
        }
    }

    /// A memfd (`memfd_create`; systemd, journald, Wayland clients and browsers keep them, read-
    /// write) lives on an internal mount in no table, and its link starts with `/`
    /// (`/memfd:NAME (deleted)`); its inode numbers are small, as are a tmpfs's (`/run`, a
    /// Kubernetes secret volume). A file nobody has open with a live memfd's inode number is
    /// not held. Needs root (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_file_sharing_a_memfds_inode_number_is_not_held() {
        let memfd = rustix::fs::memfd_create("retryplane-test", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd_create");
        let inode = rustix::fs::fstat(&memfd).expect("fstat").st_ino;
        let dir = tempfile::tempdir().expect("temp dir");
        let Some(found) = TmpfsFile::with_inode(dir.path(), inode) else {
            return;
        };
        assert!(
            !held_open_for_writing(&found.path),
            "a file nobody has open (inode {inode}) is said to be held: a memfd with that \
             inode number counted as its writer"
        );
    }

    /// A process whose `epoll_ctl(ADD)` of a file on a bindfs (FUSE) mount waits on the
    /// stopped daemon: the kernel asks the daemon (`FUSE_POLL`) holding the epoll's mutex,
    /// which reading that epoll's `fdinfo` takes too. Released (the daemon continued,
    /// everything stopped and unmounted) on drop.
    #[cfg(target_os = "linux")]
    pub(crate) struct StuckEpoll {
        daemon: std::process::Child,
        poller: std::process::Child,
        mount: String,
        _dir: tempfile::TempDir,
    }

    #[cfg(target_os = "linux")]
    impl StuckEpoll {
        /// `None` (and why, on stderr) without root, bindfs, /dev/fuse or python3.
        pub(crate) fn new() -> Option<Self> {
            use std::io::Write as _;
            use std::process::{Command, Stdio};
            let dir = tempfile::tempdir().expect("temp dir");
            let d = dir.path();
            for sub in ["src", "mnt"] {
                fs::create_dir(d.join(sub)).expect("mkdir");
            }
            fs::write(d.join("src/f"), "x\n").expect("write");
            let Ok(mut daemon) = Command::new("bindfs")
                .arg("-f")
                .arg(d.join("src"))
                .arg(d.join("mnt"))
                .stderr(Stdio::null())
                .spawn()
            else {
                eprintln!("skipped: no bindfs");
                return None;
            };
            let mount = d.join("mnt").display().to_string();
            let mounted = poll_for(|| {
                fs::read_to_string("/proc/self/mountinfo").is_ok_and(|t| t.contains(&mount))
            });
            if !mounted {
                let _ = daemon.kill();
                let _ = daemon.wait();
                eprintln!("skipped: bindfs did not mount (needs root and /dev/fuse)");
                return None;
            }
            let script = format!(
                "import os, select, sys, time\n\
                 fd = os.open('{mount}/f', os.O_RDONLY)\n\
                 ep = select.epoll()\n\
                 print('ready', flush=True)\n\
                 sys.stdin.readline()\n\
                 ep.register(fd, select.EPOLLIN)\n\
                 time.sleep(600)\n"
            );
            let Some(poller) = spawn_ready("python3", &["-c", &script]) else {
                sh(&format!("umount {mount}"));
                let _ = daemon.kill();
                let _ = daemon.wait();
                eprintln!("skipped: no python3");
                return None;
            };
            let mut stuck = Self {
                daemon,
                poller,
                mount,
                _dir: dir,
            };
            sh(&format!("kill -STOP {}", stuck.daemon.id()));
            if let Some(input) = stuck.poller.stdin.as_mut() {
                let _ = input.write_all(b"go\n");
            }
            // Until the poller waits on the daemon, inside `epoll_ctl`.
            let wchan = format!("/proc/{}/wchan", stuck.poller.id());
            let waiting = poll_for(|| {
                fs::read_to_string(&wchan)
                    .is_ok_and(|w| w.contains("fuse") || w.contains("request"))
            });
            assert!(waiting, "the poller never waited on the FUSE daemon");
            Some(stuck)
        }

        /// Lets the daemon go on: the `epoll_ctl` returns.
        pub(crate) fn release(&self) {
            sh(&format!("kill -CONT {}", self.daemon.id()));
        }
    }

    #[cfg(target_os = "linux")]
    impl Drop for StuckEpoll {
        fn drop(&mut self) {
            self.release();
            let _ = self.poller.kill();
            let _ = self.poller.wait();
            sh(&format!("umount {}", self.mount));
            let _ = self.daemon.kill();
            let _ = self.daemon.wait();
        }
    }

    /// `program` with `args`, stdin and stdout piped, once it has printed its first line:
    /// `None` (killed) when it cannot start or that line is not `ready`.
    #[cfg(target_os = "linux")]
    fn spawn_ready(program: &str, args: &[&str]) -> Option<std::process::Child> {
        use std::io::BufRead as _;
        use std::process::{Command, Stdio};
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        if line.trim() != "ready" {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        Some(child)
    }

    /// Polls `check` every 20 ms for at most 5 s.
    #[cfg(target_os = "linux")]
    fn poll_for(mut check: impl FnMut() -> bool) -> bool {
        let step = std::time::Duration::from_millis(20);
        (0..250).any(|_| {
            if check() {
                return true;
            }
            std::thread::park_timeout(step);
            false
        })
    }

    /// An epoll whose `epoll_ctl` waits on a stopped FUSE daemon elsewhere on the host: its
    /// `fdinfo` would wait as long (in `D` state, which no signal ends), so the look does not
    /// read it. Needs root, bindfs and python3 (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn an_epoll_waiting_on_a_stopped_fuse_daemon_does_not_hold_up_the_look() {
        let dir = tempfile::tempdir().expect("temp dir");
        let policy = dir.path().join("policies.yaml");
        fs::write(&policy, "version: 1\n").expect("write");
        let Some(stuck) = StuckEpoll::new() else {
            return;
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let asked = policy.clone();
        std::thread::spawn(move || {
            let _ = tx.send(held_open_for_writing(&asked));
        });
        let answered = rx.recv_timeout(std::time::Duration::from_secs(10));
        stuck.release();
        let late = rx.recv_timeout(std::time::Duration::from_secs(10));
        drop(stuck);
        assert_eq!(
            answered,
            Ok(false),
            "no answer in 10 s (once the daemon went on: {late:?})"
        );
    }

    /// A writer in a mount namespace of its own whose `/dev` is a tmpfs (as in a container),
    /// with the policy file's directory bound under it at `/dev/cfg`: its descriptor's link
    /// reads `/dev/cfg/policies.yaml`, and it is the file's writer all the same. Needs root
    /// (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_writer_under_a_containers_own_dev_is_seen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let policy = dir.path().join("policies.yaml");
        fs::write(&policy, "version: 1\n").expect("write");
        let script = format!(
            "mount -t tmpfs tmpfs /dev && mkdir /dev/cfg && mount --bind '{}' /dev/cfg \
             && exec 3>>/dev/cfg/policies.yaml && echo ready && read x",
            dir.path().display()
        );
        let Some(mut writer) = spawn_ready(
            "unshare",
            &["-m", "--propagation", "private", "sh", "-c", &script],
        ) else {
            eprintln!("skipped: cannot make a mount namespace (needs root and unshare)");
            return;
        };
        let link = fs::read_link(format!("/proc/{}/fd/3", writer.id())).ok();
        let seen = held_open_for_writing(&policy);
        let _ = writer.kill();
        let _ = writer.wait();
        assert!(seen, "a writer through {link:?} was not seen");
    }

    /// A policy file deeper than `PATH_MAX` (reached by a path relative to a deep directory,
    /// here `/proc/self/fd/N/`): reading its writer's link fails (`ENAMETOOLONG`), and the
    /// writer is seen all the same.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_writer_of_a_file_deeper_than_path_max_is_seen() {
        use std::os::fd::AsRawFd as _;

        use rustix::fs::{Mode, OFlags};
        let dir = tempfile::tempdir().expect("temp dir");
        let mut deep =
            rustix::fs::open(dir.path(), OFlags::DIRECTORY, Mode::empty()).expect("open");
        let name = "d".repeat(250);
        for _ in 0..20 {
            rustix::fs::mkdirat(&deep, name.as_str(), Mode::from_raw_mode(0o755)).expect("mkdirat");
            deep = rustix::fs::openat(&deep, name.as_str(), OFlags::DIRECTORY, Mode::empty())
                .expect("openat");
        }
        let writer = rustix::fs::openat(
            &deep,
            "policies.yaml",
            OFlags::CREATE | OFlags::WRONLY | OFlags::APPEND | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .expect("create");
        rustix::io::write(&writer, b"version: 1\n").expect("write");
        let policy = format!("/proc/self/fd/{}/policies.yaml", deep.as_raw_fd());
        assert!(
            fs::read_link(format!("/proc/self/fd/{}", writer.as_raw_fd())).is_err(),
            "the link of a path past PATH_MAX does not read"
        );
        assert!(
            held_open_for_writing(Path::new(&policy)),
            "a writer of a file deeper than PATH_MAX was not seen"
        );
        drop(writer);
        assert!(!held_open_for_writing(Path::new(&policy)), "closed");
    }

    /// A process whose main thread has ended (`pthread_exit`) while another thread holds the
    /// policy file open for writing: the leader is a zombie and `/proc/PID/fd` lists nothing;
    /// the descriptor shows under `/proc/PID/task/TID/fd`, and the writer is seen. Needs
    /// python3 (skipped otherwise).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_writer_whose_main_thread_has_ended_is_seen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let policy = dir.path().join("policies.yaml");
        fs::write(&policy, "version: 1\n").expect("write");
        let script = format!(
            "import ctypes, os, sys, threading\n\
             fd = os.open('{}', os.O_WRONLY | os.O_APPEND)\n\
             threading.Thread(target=sys.stdin.readline).start()\n\
             print('ready', flush=True)\n\
             ctypes.CDLL(None).pthread_exit(None)\n",
            policy.display()
        );
        let Some(mut writer) = spawn_ready("python3", &["-c", &script]) else {
            eprintln!("skipped: no python3");
            return;
        };
        // Until the main thread has ended (the leader shows as a zombie).
        let status = format!("/proc/{}/status", writer.id());
        let ended = poll_for(|| fs::read_to_string(&status).is_ok_and(|s| s.contains("State:\tZ")));
        let seen = held_open_for_writing(&policy);
        let _ = writer.kill();
        let _ = writer.wait();
        assert!(ended, "the main thread did not end");
        assert!(seen, "a writer whose main thread has ended was not seen");
    }

    /// A link on a mount in no table counts as a writer's unless it is a dma-buf's (whose
    /// name may hold a `/`, which `may_be_a_file` then takes for a path); a file at the root of
    /// a mount unmounted lazily has a one-component link and counts.
    #[cfg(target_os = "linux")]
    #[test]
    fn only_paths_that_may_be_real_files_count_on_a_mount_in_no_table() {
        use super::linux::on_a_real_mount;
        assert!(on_a_real_mount(b"/srv/retryplane/policies.yaml"));
        assert!(on_a_real_mount(b"/policies.yaml (deleted)"));
        assert!(on_a_real_mount(b"/policies.yaml"));
        assert!(!on_a_real_mount(b"/dmabuf:frames/0"));
    }
}
