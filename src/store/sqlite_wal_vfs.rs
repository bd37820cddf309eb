//! A VFS shim for the embedded store's writer connection: the WAL frames of one commit reach
//! the kernel in one `pwrite`, not two per frame.
//!
//! Why: SQLite writes each WAL frame in two calls, its 24-byte header and then its page. A
//! request answered whole commits ~30 frames at concurrency 1, so ~60 `pwrite`s, and those
//! calls were most of the commit's cost (15% of the server's CPU at concurrency 1, measured
//! with `perf`; see `docs/profiling.md`). Written as one call, the same bytes cost a fraction.
//!
//! How it stays exact. The shim wraps the default VFS and only changes the WAL file of the
//! connections opened with it (the writer's; readers and the checkpointer use the default):
//! - Its writes are gathered in a buffer while they follow one another; a write elsewhere,
//!   or a buffer past [`MAX_BUFFER`], writes the buffer first.
//! - Before any other call on the WAL (read, size, truncate, file control, close), the buffer
//!   is written: the file always reads back as SQLite wrote it.
//! - SQLite makes a commit visible to readers (the wal-index header, in shared memory) right
//!   after writing its frames and, under `synchronous = FULL`, syncing them; no other VFS call
//!   comes between. So the writer's connection runs with `synchronous = FULL`, and this shim's
//!   sync of the WAL writes the buffer, and then skips the `fsync` when the sync is a
//!   commit's (the buffer held frames after the WAL's header), as `synchronous = NORMAL`
//!   does. Every other sync (the WAL header's when the WAL restarts, a checkpoint's) goes to
//!   the disk. Durability is NORMAL's, exactly as before: a commit is in the operating
//!   system before COMMIT returns (it survives a crash of the process); on power loss the
//!   last commits since a checkpoint may roll back, never corrupt.
//!
//! `unsafe` code, as the crate allows only here and in `crate::allocator`: SQLite's VFS
//! interface is C function pointers.

#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use rusqlite::ffi;

/// Largest buffer of WAL writes held before it is written (a large transaction's frames).
const MAX_BUFFER: usize = 1024 * 1024;
/// Largest write the default VFS takes in one call: it keeps the low 17 bits of a length.
const MAX_WRITE: usize = 0x1_ffff;

const NAME: &CStr = c"stable-harness-wal";

/// The default VFS the shim wraps, and where a file's [`Extension`] starts.
struct Wrapped {
    real: *mut ffi::sqlite3_vfs,
    extension_offset: usize,
}

// SAFETY: `real` points to SQLite's own default VFS, registered for the life of the process
// and safe to use from any thread (SQLite is built thread-safe).
unsafe impl Send for Wrapped {}
// SAFETY: as above; the pointer is never written through.
unsafe impl Sync for Wrapped {}

static WRAPPED: OnceLock<Option<Wrapped>> = OnceLock::new();

/// Registers the shim (once per process) and returns its name, for
/// `Connection::open_with_flags_and_vfs`; `None` if SQLite has no default VFS to wrap.
pub fn register() -> Option<&'static str> {
    WRAPPED
        .get_or_init(|| {
            // SAFETY: `sqlite3_vfs_find` initialises SQLite and returns the default VFS, or null.
            let real = unsafe { ffi::sqlite3_vfs_find(std::ptr::null()) };
            if real.is_null() {
                return None;
            }
            // SAFETY: `real` is a valid, registered VFS; it is copied, not changed.
            let mut vfs = unsafe { std::ptr::read(real) };
            let align = std::mem::align_of::<Extension>();
            let extension_offset = usize::try_from(vfs.szOsFile).ok()?.div_ceil(align) * align;
            vfs.szOsFile =
                c_int::try_from(extension_offset + std::mem::size_of::<Extension>()).ok()?;
            vfs.pNext = std::ptr::null_mut();
            vfs.zName = NAME.as_ptr();
            vfs.xOpen = Some(open);
            // The VFS lives as long as the process: SQLite keeps a pointer to it.
            let vfs: &'static mut ffi::sqlite3_vfs = Box::leak(Box::new(vfs));
            // SAFETY: `vfs` is a complete VFS that lives forever; registering is thread-safe.
            let registered = unsafe { ffi::sqlite3_vfs_register(vfs, 0) };
            (registered == ffi::SQLITE_OK).then_some(Wrapped {
                real,
                extension_offset,
            })
        })
        .as_ref()
        .and_then(|_| NAME.to_str().ok())
}

/// What the shim keeps for a WAL file, after the default VFS's own file structure (which
/// stays at the start, so the default VFS's functions take the same pointer).
struct Extension {
    /// The default VFS's methods for this file.
    real: *const ffi::sqlite3_io_methods,
    /// Writes not yet passed on: `bytes` go at `start`.
    bytes: Vec<u8>,
    start: i64,
}

impl Extension {
    fn end(&self) -> i64 {
        self.start.saturating_add(self.bytes.len() as i64)
    }

    /// The default VFS's methods.
    fn real(&self) -> &ffi::sqlite3_io_methods {
        // SAFETY: set at open from the default VFS's static methods, valid for the process.
        unsafe { &*self.real }
    }
}

/// The shim's part of `file`.
///
/// # Safety
/// `file` is a WAL file opened by [`open`] and not yet closed, used by one thread at a time
/// (SQLite serialises a connection's calls); its extension follows the default VFS's part.
unsafe fn extension<'a>(file: *mut ffi::sqlite3_file) -> &'a mut Extension {
    let offset = WRAPPED
        .get()
        .and_then(Option::as_ref)
        .map_or(0, |wrapped| wrapped.extension_offset);
    // SAFETY: `open` initialised the extension; the default VFS's functions never touch
    // past their own part.
    unsafe { &mut *extension_at(file, offset) }
}

/// Where the extension of `file` starts.
///
/// # Safety
/// SQLite allocated `szOsFile` bytes for `file`, the extension at `offset` included.
unsafe fn extension_at(file: *mut ffi::sqlite3_file, offset: usize) -> *mut Extension {
    // SAFETY: within the file's allocation, as the caller promises.
    unsafe { file.cast::<u8>().add(offset).cast::<Extension>() }
}

/// Passes the buffered writes on, in one call.
///
/// # Safety
/// As [`extension`].
unsafe fn flush(file: *mut ffi::sqlite3_file, extension: &mut Extension) -> c_int {
    if extension.bytes.is_empty() {
        return ffi::SQLITE_OK;
    }
    let Some(write) = extension.real().xWrite else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    let mut rc = ffi::SQLITE_OK;
    let mut at = extension.start;
    for chunk in extension.bytes.chunks(MAX_WRITE) {
        // Both fit: a chunk is at most MAX_WRITE bytes.
        let length = chunk.len() as c_int;
        // SAFETY: the default VFS writes `length` bytes of the chunk to its own file part.
        rc = unsafe { write(file, chunk.as_ptr().cast(), length, at) };
        if rc != ffi::SQLITE_OK {
            break;
        }
        at = at.saturating_add(chunk.len() as i64);
    }
    // Kept or not, the bytes are SQLite's to write again: a failed commit writes its frames anew.
    extension.bytes.clear();
    rc
}

unsafe extern "C" fn open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let Some(wrapped) = WRAPPED.get().and_then(Option::as_ref) else {
        return ffi::SQLITE_CANTOPEN;
    };
    // SAFETY: the default VFS opens into the start of `file`, which SQLite sized for it.
    let rc = unsafe {
        match (*wrapped.real).xOpen {
            Some(real_open) => real_open(wrapped.real, name, file, flags, out_flags),
            None => ffi::SQLITE_CANTOPEN,
        }
    };
    // SAFETY: `file` was just opened; only a WAL file gets the shim's methods and extension.
    unsafe {
        if rc == ffi::SQLITE_OK && flags & ffi::SQLITE_OPEN_WAL != 0 && !(*file).pMethods.is_null()
        {
            extension_at(file, wrapped.extension_offset).write(Extension {
                real: (*file).pMethods,
                bytes: Vec::new(),
                start: 0,
            });
            (*file).pMethods = &WAL_METHODS;
        }
    }
    rc
}

static WAL_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 1,
    xClose: Some(wal_close),
    xRead: Some(wal_read),
    xWrite: Some(wal_write),
    xTruncate: Some(wal_truncate),
    xSync: Some(wal_sync),
    xFileSize: Some(wal_file_size),
    xLock: Some(wal_lock),
    xUnlock: Some(wal_unlock),
    xCheckReservedLock: Some(wal_check_reserved_lock),
    xFileControl: Some(wal_file_control),
    xSectorSize: Some(wal_sector_size),
    xDeviceCharacteristics: Some(wal_device_characteristics),
    xShmMap: None,
    xShmLock: None,
    xShmBarrier: None,
    xShmUnmap: None,
    xFetch: None,
    xUnfetch: None,
};

unsafe extern "C" fn wal_write(
    file: *mut ffi::sqlite3_file,
    data: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: SQLite calls a WAL file's methods one at a time, on a file `open` set up.
    let extension = unsafe { extension(file) };
    let Ok(length) = usize::try_from(amount) else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    if !extension.bytes.is_empty() && offset != extension.end() {
        // SAFETY: as above.
        let rc = unsafe { flush(file, extension) };
        if rc != ffi::SQLITE_OK {
            return rc;
        }
    }
    if extension.bytes.is_empty() {
        extension.start = offset;
    }
    // SAFETY: SQLite passes `amount` readable bytes at `data`.
    let data = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) };
    extension.bytes.extend_from_slice(data);
    if extension.bytes.len() >= MAX_BUFFER {
        // SAFETY: as above.
        return unsafe { flush(file, extension) };
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn wal_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: as in `wal_write`.
    let extension = unsafe { extension(file) };
    // A commit's sync: frames were written since the last sync, and not the WAL's header
    // (written at offset 0 when the WAL restarts, and synced on its own, as NORMAL does).
    let commit = !extension.bytes.is_empty() && extension.start > 0;
    // SAFETY: as above.
    let rc = unsafe { flush(file, extension) };
    if rc != ffi::SQLITE_OK || commit {
        return rc;
    }
    match extension.real().xSync {
        // SAFETY: the default VFS syncs its own file part.
        Some(sync) => unsafe { sync(file, flags) },
        None => ffi::SQLITE_IOERR_FSYNC,
    }
}

unsafe extern "C" fn wal_close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: as in `wal_write`; the extension is dropped here, after its last use.
    unsafe {
        let extension = extension(file);
        let flushed = flush(file, extension);
        let real_close = extension.real().xClose;
        (*file).pMethods = extension.real;
        std::ptr::drop_in_place(extension as *mut Extension);
        let closed = match real_close {
            Some(close) => close(file),
            None => ffi::SQLITE_OK,
        };
        if flushed != ffi::SQLITE_OK {
            flushed
        } else {
            closed
        }
    }
}

/// Defines a method that writes the buffer, then calls the default VFS's method.
macro_rules! after_flush {
    ($name:ident, $method:ident, $error:expr, ($($arg:ident: $ty:ty),*)) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file, $($arg: $ty),*) -> c_int {
            // SAFETY: as in `wal_write`; the default VFS works on its own file part.
            unsafe {
                let extension = extension(file);
                let rc = flush(file, extension);
                if rc != ffi::SQLITE_OK {
                    return rc;
                }
                match extension.real().$method {
                    Some(method) => method(file, $($arg),*),
                    None => $error,
                }
            }
        }
    };
}

after_flush!(wal_read, xRead, ffi::SQLITE_IOERR_READ, (data: *mut c_void, amount: c_int, offset: i64));
after_flush!(wal_truncate, xTruncate, ffi::SQLITE_IOERR_TRUNCATE, (size: i64));
after_flush!(wal_file_size, xFileSize, ffi::SQLITE_IOERR_FSTAT, (size: *mut i64));
after_flush!(wal_file_control, xFileControl, ffi::SQLITE_NOTFOUND, (op: c_int, argument: *mut c_void));

/// Defines a method passed to the default VFS as it is (locks and the device's properties
/// do not depend on the file's bytes).
macro_rules! passed_on {
    ($name:ident, $method:ident, $default:expr, ($($arg:ident: $ty:ty),*)) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file, $($arg: $ty),*) -> c_int {
            // SAFETY: as in `wal_write`; the default VFS works on its own file part.
            unsafe {
                match extension(file).real().$method {
                    Some(method) => method(file, $($arg),*),
                    None => $default,
                }
            }
        }
    };
}

passed_on!(wal_lock, xLock, ffi::SQLITE_OK, (level: c_int));
passed_on!(wal_unlock, xUnlock, ffi::SQLITE_OK, (level: c_int));
passed_on!(wal_check_reserved_lock, xCheckReservedLock, ffi::SQLITE_OK, (reserved: *mut c_int));
passed_on!(wal_sector_size, xSectorSize, 4096, ());
passed_on!(wal_device_characteristics, xDeviceCharacteristics, 0, ());

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use rusqlite::{Connection, OpenFlags, params};

    /// A writer through the shim and a reader on the default VFS, as the store runs them:
    /// the reader sees every commit the moment COMMIT returns, through transactions of one
    /// row, of many (past the buffer's bound), rolled back ones, and WAL restarts; the file
    /// holds it all afterwards.
    #[test]
    fn readers_see_each_commit_at_once_and_the_file_stays_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shim.db");
        let vfs = super::register().unwrap();
        let mut writer =
            Connection::open_with_flags_and_vfs(&path, OpenFlags::default(), vfs).unwrap();
        writer
            .execute_batch(
                "PRAGMA page_size = 2048; PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;
                 PRAGMA wal_autocheckpoint = 0;
                 CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL);
                 CREATE INDEX t_by_body ON t (body);",
            )
            .unwrap();
        let reader = Connection::open(&path).unwrap();
        let count = |reader: &Connection| -> i64 {
            reader
                .query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
                .unwrap()
        };
        let mut expected = 0_i64;
        for round in 0..300_i64 {
            // Every 50th transaction is ~2.5 MiB: it spills and passes the buffer's bound.
            let rows = if round % 50 == 49 {
                1_200
            } else {
                1 + round % 7
            };
            let tx = writer.transaction().unwrap();
            for row in 0..rows {
                tx.execute(
                    "INSERT INTO t (body) VALUES (?1)",
                    params![format!("{round}-{row}-{}", "x".repeat(2_000))],
                )
                .unwrap();
            }
            if round % 11 == 10 {
                tx.rollback().unwrap();
            } else {
                tx.commit().unwrap();
                expected += rows;
            }
            assert_eq!(count(&reader), expected, "after round {round}");
            if round % 40 == 39 {
                // Copy everything and let the next write restart the WAL from its start.
                writer
                    .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
                    .unwrap();
            }
        }
        let last: String = reader
            .query_row("SELECT body FROM t ORDER BY id DESC LIMIT 1", [], |row| {
                row.get(0)
            })
            .unwrap();
        assert!(last.starts_with("299-"), "{}", &last[..10]);
        drop(writer);
        drop(reader);
        let reopened = Connection::open(&path).unwrap();
        assert_eq!(count(&reopened), expected);
        let check: String = reopened
            .query_row("PRAGMA integrity_check", [], |row| row.get(0))
            .unwrap();
        assert_eq!(check, "ok");
    }
}
