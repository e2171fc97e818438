//! A tmpfs of a test's own: a small one to fill up (the tests of a full disk), or one whose
//! inode numbers start afresh (`writers::tests::TmpfsFile`). Mounting needs root; without it
//! [`SmallDisk::mount`] says so on stderr and the test skips itself.

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
