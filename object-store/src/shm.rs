//! Same-host hand-over of objects through shared memory, with no socket copy.
//!
//! A holder copies an object once into a sealed `memfd` (a [`Segment`]): sealed against
//! writes, growing and shrinking, so its bytes can never change and a mapping of it can
//! never fault. A peer process on the same host (same kernel boot, same PID namespace)
//! opens that file through `/proc/<holder pid>/fd/<fd>`, checks it is the announced file
//! (device and inode) and sealed, and maps it read-only. Every later peer maps the same
//! pages: one copy on the host however many processes read the object. The holder keeps
//! the segment while the object is in its store; a mapping outlives it (the kernel frees
//! the pages when the last mapping and descriptor go).
//!
//! Opening another process's descriptor needs the same user (or `CAP_SYS_PTRACE`) and the
//! same PID namespace; where either is missing the open fails and the caller falls back to
//! the network path. Nothing here is trusted across the network: the handle comes over the
//! token-authenticated QUIC stream, and a forged one can only name a file the caller could
//! open anyway, which the device, inode, size and seal checks then refuse.

#![allow(unsafe_code)]

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use bytes::Bytes;

/// Which kernel and PID namespace a process runs in: two processes with the same key can
/// hand objects over through [`Segment`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostKey {
    boot: [u8; 16],
    pid_namespace: u64,
}

impl HostKey {
    /// Encoded length.
    pub const LEN: usize = 24;

    /// This process's key; `None` where `/proc` does not tell (then no shared memory).
    pub fn this_process() -> Option<Self> {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let hex: String = boot.trim().chars().filter(|c| *c != '-').collect();
        if hex.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        let pid_namespace = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
        Some(Self {
            boot: bytes,
            pid_namespace,
        })
    }

    /// The 24-byte wire form.
    pub fn to_bytes(self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..16].copy_from_slice(&self.boot);
        out[16..].copy_from_slice(&self.pid_namespace.to_le_bytes());
        out
    }

    /// Reads the wire form back.
    pub fn from_bytes(raw: &[u8; Self::LEN]) -> Self {
        let mut boot = [0u8; 16];
        boot.copy_from_slice(&raw[..16]);
        let mut ns = [0u8; 8];
        ns.copy_from_slice(&raw[16..]);
        Self {
            boot,
            pid_namespace: u64::from_le_bytes(ns),
        }
    }
}

/// Where a peer finds a segment: the holder's pid and descriptor, and the file's identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    /// Holder's process id.
    pub pid: u32,
    /// Descriptor number in the holder.
    pub fd: i32,
    /// Device of the file (checked by the opener).
    pub dev: u64,
    /// Inode of the file (checked by the opener).
    pub inode: u64,
    /// Object length.
    pub len: u64,
}

impl Handle {
    /// Encoded length.
    pub const LEN: usize = 32;

    /// The 32-byte wire form.
    pub fn to_bytes(self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.fd.to_le_bytes());
        out[8..16].copy_from_slice(&self.dev.to_le_bytes());
        out[16..24].copy_from_slice(&self.inode.to_le_bytes());
        out[24..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Reads the wire form back.
    pub fn from_bytes(raw: &[u8; Self::LEN]) -> Self {
        let u32_at = |at: usize| u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Self {
            pid: u32_at(0),
            fd: u32_at(4) as i32,
            dev: u64_at(8),
            inode: u64_at(16),
            len: u64_at(24),
        }
    }
}

/// Transparent huge page size on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed buffer of `len` bytes for an object received over the network, its large
/// pages advised `MADV_HUGEPAGE` before anything touches them: a fresh gigabyte otherwise
/// takes 262,144 page faults as the stream fills it, which on a VM costs a large share of
/// the transfer (a C probe: 0.84 s to fill 1 GiB of fresh small pages, 0.27-0.5 s of huge
/// ones; docs/NOTES.md). Only an advice: where transparent huge pages are off, or memory
/// is too fragmented, the kernel falls back to small pages and nothing else changes.
pub fn receive_buffer(len: usize) -> Vec<u8> {
    // Zeroed allocations of at least 32 MiB (glibc's largest mmap threshold) come straight
    // from mmap, untouched until written; smaller ones may already be touched, and the
    // advice then changes nothing.
    let buffer = vec![0u8; len];
    let start = buffer.as_ptr() as usize;
    let first = start.next_multiple_of(HUGE_PAGE);
    let end = (start + len) / HUGE_PAGE * HUGE_PAGE;
    if end > first {
        // SAFETY: an advice on whole pages inside this live allocation; MADV_HUGEPAGE
        // changes how pages are backed, never their contents.
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
        }
    }
    buffer
}

/// How much a [`Prefault`] populates per call: small enough that stopping it (which waits
/// for the call under way) takes a few milliseconds at most.
const PREFAULT_STEP: usize = 8 << 20;

/// Faults a receive buffer's pages in on a thread of its own, front to back, while the
/// transfer fills the buffer from the front: the kernel's zeroing of fresh pages (on a VM,
/// the host backing them too) then runs beside the socket reads and decryption instead of
/// inside them. Measured on the 2-core CI kind: a fresh buffer's page faults were a quarter
/// of a two-node get's busy time (docs/NOTES.md). `MADV_POPULATE_WRITE` (Linux 5.14) makes
/// pages present as a write would, without writing: the buffer's contents never change,
/// and pages the transfer reached first are left as they are. Dropping the guard stops the
/// thread and waits for it, so it never touches the range once the buffer is handed on;
/// drop it before the buffer is freed. On an older kernel the first call fails and the
/// thread ends.
#[derive(Debug)]
pub struct Prefault {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prefault {
    /// Starts populating `buffer`'s whole pages; None when there are none or no thread
    /// could be started (the transfer then faults them in itself, as it always could).
    pub fn start(buffer: &mut [u8]) -> Option<Self> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let page = page_size();
        let start = (buffer.as_mut_ptr() as usize).next_multiple_of(page);
        let end = (buffer.as_mut_ptr() as usize + buffer.len()) / page * page;
        if end <= start {
            return None;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("regatta-prefault".into())
            .spawn(move || {
                let mut at = start;
                while at < end && !stopped.load(Ordering::Relaxed) {
                    let len = PREFAULT_STEP.min(end - at);
                    // SAFETY: whole pages of a buffer that stays allocated until the guard
                    // is dropped, which waits for this thread; MADV_POPULATE_WRITE only
                    // makes pages present and never changes their contents.
                    if unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) } != 0 {
                        return;
                    }
                    at += len;
                }
            })
            .ok()?;
        Some(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Gives the whole pages of `buffer`'s spare capacity (past its length) back to the
/// kernel: a kept buffer handed out for a smaller object then holds no more memory than
/// the object reads as. Touched again (the vector grown), they read as zeros.
pub fn release_spare_pages(buffer: &Vec<u8>) {
    let page = page_size();
    let start = buffer.as_ptr() as usize;
    let tail = (start + buffer.len()).next_multiple_of(page);
    let end = (start + buffer.capacity()) / page * page;
    if end > tail {
        // SAFETY: whole pages inside this allocation's capacity and past its length, which
        // nothing reads; anonymous private pages advised away read back as zeros.
        unsafe {
            libc::madvise(tail as *mut libc::c_void, end - tail, libc::MADV_DONTNEED);
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|s| *s > 0).unwrap_or(4096)
}

const SEALS: libc::c_int = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;

/// Where the kernel says whether shared memory (memfds) gets transparent huge pages.
const SHMEM_HUGE_SETTING: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
/// Its per-size settings (kernels since 6.11), one folder per page size.
const HUGE_PAGE_SIZES: &str = "/sys/kernel/mm/transparent_hugepage";

/// Whether this host gives shared memory transparent huge pages, which decides how fast a
/// fresh object can be written into it: with 4 KiB pages the kernel allocates each page on
/// its own (about 2 GB/s on the 2-core CI kind, a fifth of a copy into anonymous memory);
/// with 2 MiB pages the same write runs at copy speed. It is the host's setting
/// (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`, not namespaced: a container sees
/// its host's); Regatta reads it and never changes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedHugePages {
    /// `never` or `deny`: 4 KiB pages only.
    Never,
    /// `advise`: huge pages for a mapping advised with `MADV_HUGEPAGE`, so a large object is
    /// copied in through such a mapping rather than written.
    Advise,
    /// `always`, `within_size` or `force`: any write gets them.
    Always,
}

impl SharedHugePages {
    /// This host's setting, read once per process (absent files read as `Never`).
    pub fn of_this_host() -> Self {
        static SETTING: std::sync::OnceLock<SharedHugePages> = std::sync::OnceLock::new();
        *SETTING.get_or_init(|| {
            let top = std::fs::read_to_string(SHMEM_HUGE_SETTING).unwrap_or_default();
            let mut sizes = Vec::new();
            if let Ok(folders) = std::fs::read_dir(HUGE_PAGE_SIZES) {
                for folder in folders.flatten() {
                    if folder.file_name().to_string_lossy().starts_with("hugepages-") {
                        if let Ok(text) = std::fs::read_to_string(folder.path().join("shmem_enabled")) {
                            sizes.push(text);
                        }
                    }
                }
            }
            Self::from_settings(&top, &sizes)
        })
    }

    /// The setting from the text of `shmem_enabled` and of each page size's own
    /// `hugepages-*/shmem_enabled` (the chosen word is the one in brackets). A size set to
    /// `inherit` follows the top one; the top one's `deny` and `force` override every size.
    /// Where sizes differ, `advise` wins (a copy through an advised mapping gets every size
    /// that is allowed), then `always`.
    pub fn from_settings(top: &str, sizes: &[String]) -> Self {
        let top = chosen(top);
        match top {
            Some("deny") => return Self::Never,
            Some("force") => return Self::Always,
            _ => {}
        }
        let word = |setting: Option<&str>| match setting {
            Some("always" | "within_size") => Self::Always,
            Some("advise") => Self::Advise,
            _ => Self::Never,
        };
        // Kernels before per-size settings have only the top one.
        let each: Vec<Self> = if sizes.is_empty() {
            vec![word(top)]
        } else {
            sizes
                .iter()
                .map(|size| match chosen(size) {
                    Some("inherit") => word(top),
                    other => word(other),
                })
                .collect()
        };
        if each.contains(&Self::Advise) {
            Self::Advise
        } else if each.contains(&Self::Always) {
            Self::Always
        } else {
            Self::Never
        }
    }

    /// The setting's name as the kernel's file spells its kind.
    pub fn name(self) -> &'static str {
        match self {
            Self::Never => "never",
            Self::Advise => "advise",
            Self::Always => "always",
        }
    }
}

/// The word in brackets of a sysfs choice line (`always [madvise] never`).
fn chosen(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(&text[start..end])
}

/// Objects at least this large are copied into shared memory through a mapping advised
/// for huge pages, where the host gives them only on advice: one 2 MiB page.
const HUGE_COPY_MIN: usize = 2 << 20;

/// Copies `bytes` into the empty memfd `file` through a shared mapping advised with
/// `MADV_HUGEPAGE`, so a host whose shared memory takes huge pages on advice gives them.
fn copy_through_huge_mapping(file: &File, bytes: &[u8]) -> io::Result<()> {
    file.set_len(bytes.len() as u64)?;
    // SAFETY: a fresh writable shared mapping of exactly the file's length, which nothing
    // else maps; it is unmapped below before the file is sealed.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes.len(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: advice on the mapping just made (a refusal only means small pages), then a
    // copy of `bytes.len()` bytes into that many mapped writable bytes that `bytes` cannot
    // overlap, then the unmapping of exactly that region.
    unsafe {
        libc::madvise(address, bytes.len(), libc::MADV_HUGEPAGE);
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), address.cast::<u8>(), bytes.len());
        if libc::munmap(address, bytes.len()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// An object's bytes in a sealed memfd.
#[derive(Debug)]
pub struct Segment {
    file: File,
    dev: u64,
    inode: u64,
    len: u64,
}

impl Segment {
    /// Copies `bytes` into a new sealed memfd (the one copy of the same-host path).
    pub fn create(bytes: &[u8]) -> io::Result<Self> {
        let name = c"regatta-object";
        // SAFETY: `name` is a valid NUL-terminated string; the flags are plain constants.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a fresh descriptor nothing else owns.
        let mut file = unsafe { File::from_raw_fd(fd) };
        if bytes.len() >= HUGE_COPY_MIN && SharedHugePages::of_this_host() == SharedHugePages::Advise {
            copy_through_huge_mapping(&file, bytes)?;
        } else {
            file.write_all(bytes)?;
        }
        // SAFETY: fcntl on a descriptor this function owns, with integer arguments.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Self::from_file(file, Some(bytes.len() as u64))
    }

    /// Seals a memfd another part of this process wrote (a Python driver writes an object's
    /// parts straight into one: the one copy of its put) and takes it as a segment. The file
    /// must be open for writing, made with `MFD_ALLOW_SEALING`, and have no writable mapping
    /// left; anything else is refused by the kernel's seal call, with its error.
    pub fn seal(file: File) -> io::Result<Self> {
        // SAFETY: fcntl on a descriptor `file` owns, with integer arguments.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            let error = io::Error::last_os_error();
            return Err(io::Error::new(
                error.kind(),
                format!("cannot seal the object's file (a memfd made with MFD_ALLOW_SEALING, open for writing, unmapped): {error}"),
            ));
        }
        Self::from_file(file, None)
    }

    /// Takes any file as a segment without sealing it: only for tests that a reader refuses
    /// a segment a peer could still change (`Segment::open` checks the seals).
    #[doc(hidden)]
    pub fn unsealed(file: File) -> io::Result<Self> {
        Self::from_file(file, None)
    }

    fn from_file(file: File, expect_len: Option<u64>) -> io::Result<Self> {
        let meta = file.metadata()?;
        if let Some(len) = expect_len {
            if meta.len() != len {
                return Err(io::Error::other(format!(
                    "segment holds {} bytes, not {len}",
                    meta.len()
                )));
            }
        }
        Ok(Self {
            dev: meta.dev(),
            inode: meta.ino(),
            len: meta.len(),
            file,
        })
    }

    /// Opens a peer's segment named by `handle` and checks it is that file, of that length,
    /// and sealed against any change.
    pub fn open(handle: &Handle) -> io::Result<Self> {
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        // Non-blocking: a descriptor a peer names could be a FIFO (or a device), whose plain
        // open waits for a writer for ever. Only a regular file (a memfd is one) is taken.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(format!("/proc/{}/fd/{}", handle.pid, handle.fd))?;
        let kind = file.metadata()?.file_type();
        if !kind.is_file() {
            let what = if kind.is_fifo() { "a pipe" } else { "not a regular file" };
            return Err(io::Error::other(format!("the descriptor names {what}, not a segment")));
        }
        let segment = Self::from_file(file, Some(handle.len))?;
        if (segment.dev, segment.inode) != (handle.dev, handle.inode) {
            return Err(io::Error::other("the descriptor names another file now"));
        }
        // SAFETY: fcntl on a descriptor `segment` owns.
        let seals = unsafe { libc::fcntl(segment.file.as_raw_fd(), libc::F_GET_SEALS) };
        let needed = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK;
        if seals < 0 || seals & needed != needed {
            return Err(io::Error::other(
                "the segment is not sealed against writes and shrinking",
            ));
        }
        Ok(segment)
    }

    /// How a peer on this host opens the segment.
    pub fn handle(&self) -> Handle {
        Handle {
            pid: std::process::id(),
            fd: self.file.as_raw_fd(),
            dev: self.dev,
            inode: self.inode,
            len: self.len,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, mapped read-only with every page populated up front (so a read never
    /// waits on a fault later). The mapping keeps the segment's pages alive on its own.
    pub fn map(self: &Arc<Self>) -> io::Result<Bytes> {
        self.map_with(libc::MAP_POPULATE)
    }

    /// The bytes mapped read-only, pages mapped on first touch: for the holder, whose
    /// copy the mapping replaces and which may never read it again.
    pub fn map_lazily(self: &Arc<Self>) -> io::Result<Bytes> {
        self.map_with(0)
    }

    fn map_with(self: &Arc<Self>, flags: libc::c_int) -> io::Result<Bytes> {
        if self.len == 0 {
            return Ok(Bytes::new());
        }
        let len = usize::try_from(self.len).map_err(|_| io::Error::other("segment larger than the address space"))?;
        // SAFETY: a fresh read-only shared mapping of a file this segment owns, of exactly
        // its length; the file is sealed against shrinking and writing, so the mapped bytes
        // stay valid and unchanged for the mapping's whole life.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | flags,
                self.file.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Bytes::from_owner(Mapping {
            address: address.cast(),
            len,
        }))
    }
}

/// A read-only mapping, unmapped on drop.
struct Mapping {
    address: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and immutable (sealed file), so sharing and sending the
// pointer between threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl AsRef<[u8]> for Mapping {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `address` is a live mapping of `len` readable bytes until drop.
        unsafe { std::slice::from_raw_parts(self.address, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region mmap returned; nothing borrows it any more.
        unsafe {
            libc::munmap(self.address as *mut libc::c_void, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many of `buffer`'s whole pages are resident, from `mincore`.
    fn resident_pages(buffer: &[u8]) -> usize {
        let page = page_size();
        let start = (buffer.as_ptr() as usize).next_multiple_of(page);
        let end = (buffer.as_ptr() as usize + buffer.len()) / page * page;
        let mut flags = vec![0u8; (end - start) / page];
        // SAFETY: whole pages inside a live allocation; `flags` has one byte per page.
        let ok = unsafe { libc::mincore(start as *mut libc::c_void, end - start, flags.as_mut_ptr()) };
        assert_eq!(ok, 0, "mincore: {}", io::Error::last_os_error());
        flags.iter().filter(|f| **f & 1 == 1).count()
    }

    #[test]
    fn a_prefault_makes_a_fresh_buffer_resident_without_changing_a_byte() {
        const LEN: usize = 48 << 20;
        // Past glibc's mmap threshold and never written: untouched pages.
        let mut buffer = vec![0u8; LEN];
        let written = 3 << 20;
        for (i, byte) in buffer[..written].iter_mut().enumerate() {
            *byte = (i % 251) as u8 + 1;
        }
        let pages = LEN / page_size();
        assert!(
            resident_pages(&buffer) < pages / 2,
            "the buffer starts mostly untouched"
        );
        let prefault = Prefault::start(&mut buffer).expect("a prefault thread");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while resident_pages(&buffer) + 1 < pages && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        drop(prefault);
        assert!(
            resident_pages(&buffer) + 1 >= pages,
            "the prefault made every whole page present"
        );
        assert!(
            buffer[..written]
                .iter()
                .enumerate()
                .all(|(i, b)| *b == (i % 251) as u8 + 1),
            "what was written stays"
        );
        assert!(
            buffer[written..].iter().all(|b| *b == 0),
            "the rest still reads as zeros"
        );
        // Stopping one early returns at once and leaves the buffer alone too.
        let mut other = vec![0u8; LEN];
        let started = std::time::Instant::now();
        drop(Prefault::start(&mut other));
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert!(other.iter().all(|b| *b == 0));
    }

    #[test]
    fn a_descriptor_naming_a_pipe_is_refused_at_once_not_waited_on() {
        use std::ffi::CString;
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::env::temp_dir().join(format!("regatta-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pipe");
        let c_path = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo on a NUL-terminated path this test owns.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        // The "holder" has it open for reading with no writer: a plain open of it through
        // /proc would wait for a writer for ever.
        let fifo = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        let meta = fifo.metadata().unwrap();
        let handle = Handle {
            pid: std::process::id(),
            fd: fifo.as_raw_fd(),
            dev: meta.dev(),
            inode: meta.ino(),
            len: 0,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(Segment::open(&handle).map(|_| ()).map_err(|e| e.to_string()));
        });
        let outcome = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("the open returned instead of waiting on the pipe");
        let why = outcome.expect_err("a pipe is not a segment");
        assert!(why.contains("pipe"), "{why}");
        drop(fifo);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_large_receive_buffer_is_advised_huge_pages_and_a_small_one_is_left_alone() {
        // The kernel lists the advice as `hg` in the VmFlags of the buffer's mapping.
        let advised = |buffer: &[u8]| {
            let at = buffer.as_ptr() as usize + buffer.len() / 2;
            let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
            let mut inside = false;
            for line in smaps.lines() {
                if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-')) {
                    let (low, high) = range.split_once('-').expect("a range");
                    let (low, high) = (usize::from_str_radix(low, 16), usize::from_str_radix(high, 16));
                    inside = matches!((low, high), (Ok(l), Ok(h)) if l <= at && at < h);
                } else if inside {
                    if let Some(flags) = line.strip_prefix("VmFlags:") {
                        return flags.split_whitespace().any(|f| f == "hg");
                    }
                }
            }
            panic!("no mapping holds the buffer");
        };
        let large = receive_buffer(64 << 20);
        assert_eq!(large.len(), 64 << 20);
        assert!(advised(&large), "a 64 MiB buffer is advised huge pages");
        for len in [0, 1, HUGE_PAGE - 1, 3 * HUGE_PAGE + 17] {
            let buffer = receive_buffer(len);
            assert_eq!(buffer.len(), len);
            assert!(buffer.iter().all(|b| *b == 0), "{len}");
        }
    }

    #[test]
    fn the_spare_pages_past_a_buffers_length_are_given_back() {
        let page = page_size();
        // Resident pages among the whole pages of `start..end` (mincore: bit 0 of one byte
        // a page).
        let resident = |start: usize, end: usize| {
            let (first, last) = (start.next_multiple_of(page), end / page * page);
            let pages = (last - first) / page;
            let mut flags = vec![0u8; pages];
            // SAFETY: a page-aligned range inside a live allocation, one byte a page.
            let rc = unsafe { libc::mincore(first as *mut libc::c_void, last - first, flags.as_mut_ptr()) };
            assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
            (flags.iter().filter(|f| **f & 1 == 1).count(), pages)
        };
        let mut buffer = vec![1u8; 4 << 20];
        let start = buffer.as_ptr() as usize;
        let (touched, pages) = resident(start, start + (4 << 20));
        assert_eq!(touched, pages, "every page written");
        buffer.truncate(1 << 20);
        release_spare_pages(&buffer);
        assert_eq!(
            resident(start + (1 << 20), start + (4 << 20)).0,
            0,
            "the tail given back"
        );
        let (kept, pages) = resident(start, start + (1 << 20));
        assert_eq!(kept, pages, "the object's pages kept");
        assert!(buffer.iter().all(|b| *b == 1));
    }

    #[test]
    fn a_segment_is_sealed_mapped_and_opened_by_handle() {
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let segment = Arc::new(Segment::create(&payload).unwrap());
        assert_eq!(segment.len(), payload.len() as u64);
        assert_eq!(&segment.map().unwrap()[..], &payload[..]);

        // Opened again through /proc, as a peer process would.
        let peer = Arc::new(Segment::open(&segment.handle()).unwrap());
        let mapped = peer.map().unwrap();
        drop(segment);
        drop(peer);
        assert_eq!(&mapped[..], &payload[..], "a mapping outlives its segment");

        // The seals hold: no write through a writable descriptor of the same file.
        let again = Segment::create(b"fixed").unwrap();
        let mut writable = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", again.file.as_raw_fd()))
            .unwrap();
        assert!(writable.write_all(b"changed").is_err());
    }

    #[test]
    fn a_handle_naming_another_file_or_length_is_refused() {
        let segment = Segment::create(b"hello").unwrap();
        let mut wrong = segment.handle();
        wrong.inode += 1;
        assert!(Segment::open(&wrong).is_err());
        let mut longer = segment.handle();
        longer.len = 6;
        assert!(Segment::open(&longer).is_err());
        let mut gone = segment.handle();
        gone.fd = 1_000_000;
        assert!(Segment::open(&gone).is_err());

        // An ordinary (unsealed) file is refused even when named exactly.
        let path = std::env::temp_dir().join(format!("regatta-shm-test-{}", std::process::id()));
        std::fs::write(&path, b"hello").unwrap();
        let file = File::open(&path).unwrap();
        let plain = Segment::from_file(file, None).unwrap();
        assert!(Segment::open(&plain.handle()).is_err());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_huge_page_setting_is_the_bracketed_word_with_sizes_inheriting_the_top_one() {
        let sizes = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        let top = |word: &str| {
            ["always", "within_size", "advise", "never", "deny", "force"]
                .iter()
                .map(|w| if *w == word { format!("[{w}]") } else { w.to_string() })
                .collect::<Vec<_>>()
                .join(" ")
                + "\n"
        };
        let size = |word: &str| "always inherit within_size advise never".replace(word, &format!("[{word}]"));
        use SharedHugePages::{Advise, Always, Never};
        // These machines: the top one never, 2 MiB inheriting it, every other size never.
        let here = sizes(&[&size("inherit"), &size("never"), &size("never")]);
        let one_always = sizes(&[&size("never"), &size("always")]);
        let mixed = sizes(&[&size("always"), &size("advise")]);
        let cases: [(String, &[String], SharedHugePages); 12] = [
            // A kernel with only the top setting.
            (top("never"), &[], Never),
            (top("advise"), &[], Advise),
            (top("within_size"), &[], Always),
            (top("always"), &[], Always),
            // Sizes inheriting the top one.
            (top("never"), &here, Never),
            (top("advise"), &here, Advise),
            // A size set on its own counts though the top one says never; advise wins over always.
            (top("never"), &one_always, Always),
            (top("never"), &mixed, Advise),
            // deny and force override every size.
            (top("deny"), &one_always, Never),
            (top("force"), &here, Always),
            // Unreadable or unbracketed text reads as never.
            (String::new(), &[], Never),
            ("always advise".into(), &sizes(&["inherit"]), Never),
        ];
        for (top, sizes, expected) in cases {
            assert_eq!(
                SharedHugePages::from_settings(&top, sizes),
                expected,
                "{top:?} {sizes:?}"
            );
        }
    }

    #[test]
    fn a_copy_through_an_advised_mapping_seals_and_reads_back_byte_exact() {
        let bytes: Vec<u8> = (0..(5 << 20) + 123)
            .map(|i: usize| (i.wrapping_mul(31) >> 3) as u8)
            .collect();
        // SAFETY: a plain memfd_create; the descriptor goes straight into a File.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: memfd_create returned a fresh descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        copy_through_huge_mapping(&file, &bytes).unwrap();
        // The mapping is gone: the write seal takes (it refuses a file still mapped writable).
        let segment = Arc::new(Segment::seal(file).unwrap());
        assert_eq!(segment.len(), bytes.len() as u64);
        assert!(segment.map().unwrap().as_ref() == bytes.as_slice());
    }

    #[test]
    fn a_memfd_written_elsewhere_is_sealed_as_it_is_and_other_files_are_refused() {
        // What the Python driver does: its own memfd, written, then handed over.
        // SAFETY: a plain memfd_create; the descriptor goes straight into a File.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: memfd_create returned a fresh descriptor nothing else owns.
        let mut written = unsafe { File::from_raw_fd(fd) };
        written.write_all(b"written by the driver").unwrap();
        let handed = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))
            .unwrap();
        let segment = Arc::new(Segment::seal(handed).unwrap());
        assert_eq!(&segment.map().unwrap()[..], b"written by the driver");
        assert!(
            written.write_all(b"more").is_err(),
            "sealed: the writer's own descriptor writes no more"
        );
        assert!(
            Segment::open(&segment.handle()).is_ok(),
            "a peer opens it as any segment"
        );

        // A memfd made without MFD_ALLOW_SEALING, and a plain file, are refused with the reason.
        // SAFETY: as above.
        let unsealable = unsafe { File::from_raw_fd(libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC)) };
        let error = Segment::seal(unsealable).unwrap_err();
        assert!(error.to_string().contains("cannot seal"), "{error}");
        let path = std::env::temp_dir().join(format!("regatta-seal-test-{}", std::process::id()));
        std::fs::write(&path, b"plain").unwrap();
        let plain = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        assert!(Segment::seal(plain).is_err());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn empty_objects_map_to_empty_bytes() {
        let segment = Arc::new(Segment::create(b"").unwrap());
        assert!(segment.is_empty());
        assert!(segment.map().unwrap().is_empty());
    }

    #[test]
    fn keys_and_handles_round_trip() {
        let key = HostKey::this_process().expect("linux /proc");
        assert_eq!(HostKey::from_bytes(&key.to_bytes()), key);
        let handle = Handle {
            pid: 7,
            fd: -1,
            dev: 3,
            inode: u64::MAX,
            len: 42,
        };
        assert_eq!(Handle::from_bytes(&handle.to_bytes()), handle);
    }
}
