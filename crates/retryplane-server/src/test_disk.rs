//! A tmpfs of a test's own: a small one to fill up (the tests of a full disk), or one whose
//! inode numbers start afresh (`writers::tests::TmpfsFile`); and an ext4 file system on a loop
//! device that an error turns read-only under the files open on it ([`Ext4Disk`]). Mounting
//! needs root; without it [`SmallDisk::mount`] and [`Ext4Disk::mount`] say so on stderr and
//! the test skips itself.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted at a directory, unmounted on drop.
pub(crate) struct SmallDisk {
    at: PathBuf,
}

/// The file [`SmallDisk::fill`] fills the disk with.
const FILLER: &str = "filler";

impl SmallDisk {
    /// A tmpfs of `size` (as `mount -o size=` takes it: `1m`) at `at`, created if missing;
    /// `None` (and why, on stderr) when it cannot be mounted.
    pub(crate) fn mount(at: &Path, size: &str) -> Option<Self> {
        fs::create_dir_all(at).ok()?;
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("skipped: cannot mount a tmpfs (needs root)");
            return None;
        }
        Some(Self { at: at.to_owned() })
    }

    /// Writes a file until the disk has no room left, not even for one more page.
    pub(crate) fn fill(&self) {
        let Ok(mut filler) = fs::File::create(self.at.join(FILLER)) else {
            return;
        };
        let page = [0x5a_u8; 4096];
        // Bounded: a 1 GiB disk at most.
        for _ in 0..262_144 {
            if filler.write_all(&page).is_err() {
                break;
            }
        }
        let _ = filler.sync_all();
        // The last part-pages: a page each.
        for i in 0..1_000 {
            if fs::write(self.at.join(format!("{FILLER}-{i}")), b"x").is_err() {
                break;
            }
        }
    }

    /// Gives the disk its room back.
    pub(crate) fn unfill(&self) {
        let _ = fs::remove_file(self.at.join(FILLER));
        for i in 0..1_000 {
            let _ = fs::remove_file(self.at.join(format!("{FILLER}-{i}")));
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// An ext4 file system in a file, mounted through a loop device with `errors=remount-ro`, so
/// that [`Ext4Disk::fail`] turns it read-only with files open for writing on it (as a disk
/// error does; `mount -o remount,ro` refuses while a file is open for writing).
pub(crate) struct Ext4Disk {
    at: PathBuf,
    /// The loop device's name (`loop3`), under `/sys/fs/ext4/`.
    device: String,
    _image: tempfile::TempDir,
}

impl Ext4Disk {
    /// A 16 MiB ext4 at `at`, created if missing; `None` (and why, on stderr) when it cannot
    /// be made or mounted.
    pub(crate) fn mount(at: &Path) -> Option<Self> {
        let skip = |why: &str| {
            eprintln!(
                "skipped: cannot mount an ext4 image ({why}; needs root, mkfs.ext4, loop devices)"
            );
            None
        };
        fs::create_dir_all(at).ok()?;
        let image_dir = tempfile::tempdir().ok()?;
        let image = image_dir.path().join("ext4.img");
        let made = fs::File::create(&image)
            .and_then(|f| f.set_len(16 << 20))
            .is_ok()
            && Command::new("mkfs.ext4")
                .args(["-q", "-F"])
                .arg(&image)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
        if !made {
            return skip("mkfs.ext4 failed");
        }
        let mounted = Command::new("mount")
            .args(["-o", "loop,errors=remount-ro"])
            .arg(&image)
            .arg(at)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            return skip("mount failed");
        }
        let source = Command::new("findmnt")
            .args(["-n", "-o", "SOURCE", "--mountpoint"])
            .arg(at)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        let disk = Self {
            at: at.to_owned(),
            device: source.trim_start_matches("/dev/").to_owned(),
            _image: image_dir,
        };
        if disk.device.is_empty() || !disk.trigger().exists() {
            return skip("no /sys/fs/ext4/<device>/trigger_fs_error");
        }
        Some(disk)
    }

    fn trigger(&self) -> PathBuf {
        Path::new("/sys/fs/ext4")
            .join(&self.device)
            .join("trigger_fs_error")
    }

    /// Makes the file system fail as a disk error would: ext4 remounts it read-only, files
    /// open for writing stay open, and every write fails.
    pub(crate) fn fail(&self) {
        let _ = fs::write(self.trigger(), b"retryplane test");
    }
}

impl Drop for Ext4Disk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}
