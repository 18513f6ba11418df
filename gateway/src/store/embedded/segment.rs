//! The segment files of the embedded log: the record codec (length, CRC, sequence number,
//! stored form), a shard directory's recovery at start (verifying every segment, cutting
//! off a torn last record) and the file helpers the writer and readers share.

use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, ErrorKind, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use crate::store::embedded::files::create_private_dirs;
use crate::store::{Seq, StoreError};

pub(crate) const HEADER: usize = 16;
/// Larger lengths can only come from a torn or corrupt header.
pub(crate) const MAX_RECORD: u32 = 64 * 1024 * 1024;

pub(super) fn segment_path(dir: &Path, base: Seq) -> PathBuf {
    dir.join(format!("{base:020}.log"))
}

pub(super) struct Recovered {
    pub(super) file: File,
    pub(super) file_len: u64,
    pub(super) next_seq: Seq,
    pub(super) bases: Vec<Seq>,
}

pub(super) fn recover(dir: &Path) -> Result<Recovered, StoreError> {
    create_private_dirs(dir)
        .map_err(|e| StoreError::io(&format!("cannot create {}", dir.display()), &e))?;
    let mut bases = Vec::new();
    let entries = fs::read_dir(dir)
        .map_err(|e| StoreError::io(&format!("cannot list {}", dir.display()), &e))?;
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::io("cannot list a shard", &e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(base) = name
            .strip_suffix(".log")
            .and_then(|b| b.parse::<Seq>().ok())
        {
            bases.push(base);
        }
    }
    bases.sort_unstable();
    // Every segment a reader may still need is verified, not only the newest: (records,
    // bytes they span) of each.
    let mut scans = Vec::with_capacity(bases.len());
    for base in &bases {
        let path = segment_path(dir, *base);
        let scanned = File::open(&path).and_then(|mut file| scan(&mut file, *base));
        scans.push(
            scanned.map_err(|e| StoreError::io(&format!("cannot read {}", path.display()), &e))?,
        );
    }
    // An empty newest segment whose predecessor goes on past its base is the leftover of
    // a roll that failed half-way (older versions created the new file first): it is not
    // a segment, and keeping it would let `release` delete the records it claims to start.
    while bases.len() >= 2 {
        let last = bases.len() - 1;
        if scans[last].0 != 0 || bases[last - 1] + scans[last - 1].0 <= bases[last] {
            break;
        }
        let path = segment_path(dir, bases[last]);
        tracing::warn!(path = %path.display(), "removing an empty segment left by a failed roll");
        fs::remove_file(&path)
            .map_err(|e| StoreError::io(&format!("cannot remove {}", path.display()), &e))?;
        bases.pop();
        scans.pop();
    }
    for i in 1..bases.len() {
        let (base, next) = (bases[i - 1], bases[i]);
        let end = base + scans[i - 1].0;
        if end < next {
            // Records that were durable before their successor existed do not vanish on
            // their own: the disk lost or damaged them. Say which; readers skip them.
            tracing::error!(
                path = %segment_path(dir, base).display(),
                lost_from = end,
                lost_to = next,
                "a log segment is damaged: records from `lost_from` up to `lost_to` cannot be read and will be skipped"
            );
        } else if end > next {
            tracing::error!(
                path = %segment_path(dir, base).display(),
                next_segment = next,
                "a log segment goes on past the start of the next one; readers follow the next segment"
            );
        }
    }
    if bases.is_empty() {
        bases.push(0);
        scans.push((0, 0));
    }
    let last = bases.len() - 1;
    let (base, (count, valid_len)) = (bases[last], scans[last]);
    let path = segment_path(dir, base);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| StoreError::io(&format!("cannot open {}", path.display()), &e))?;
    let len = file
        .metadata()
        .map_err(|e| StoreError::io("cannot stat a segment", &e))?
        .len();
    if valid_len < len {
        let zeros = only_zeros(&file, valid_len)
            .map_err(|e| StoreError::io(&format!("cannot read {}", path.display()), &e))?;
        if !zeros {
            tracing::warn!(
                path = %path.display(),
                dropped_bytes = len - valid_len,
                "cutting off a record torn by a crash (it was never acknowledged)"
            );
        }
        file.set_len(valid_len)
            .and_then(|_| file.sync_all())
            .map_err(|e| StoreError::io("cannot truncate a torn segment", &e))?;
    }
    sync_dir(dir).map_err(|e| StoreError::io("cannot sync a shard directory", &e))?;
    Ok(Recovered {
        file,
        file_len: valid_len,
        next_seq: base + count,
        bases,
    })
}

/// Counts the valid records of a segment from its start; returns (records, bytes they span).
pub(super) fn scan(file: &mut File, base: Seq) -> std::io::Result<(u64, u64)> {
    file.seek(SeekFrom::Start(0))?;
    let mut reader = BufReader::with_capacity(1 << 20, &*file);
    let mut count = 0u64;
    let mut offset = 0u64;
    let mut payload = Vec::new();
    loop {
        match read_record(&mut reader, &mut payload) {
            Ok(Some(seq)) if seq == base + count => {
                count += 1;
                offset += (HEADER + payload.len()) as u64;
            }
            Ok(_) => break,
            Err(e)
                if e.kind() == ErrorKind::InvalidData || e.kind() == ErrorKind::UnexpectedEof =>
            {
                break
            }
            Err(e) => return Err(e),
        }
    }
    Ok((count, offset))
}

/// Reads one record into `payload`. `Ok(None)` at a clean end of file; `InvalidData` for a
/// bad checksum or length; `UnexpectedEof` for a record cut short.
pub(crate) fn read_record(
    reader: &mut impl Read,
    payload: &mut Vec<u8>,
) -> std::io::Result<Option<Seq>> {
    let mut header = [0u8; HEADER];
    let mut filled = 0;
    while filled < HEADER {
        match reader.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    let seq_bytes: [u8; 8] = [
        header[8], header[9], header[10], header[11], header[12], header[13], header[14],
        header[15],
    ];
    if len > MAX_RECORD {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "record length out of range",
        ));
    }
    payload.resize(len as usize, 0);
    reader.read_exact(payload)?;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq_bytes);
    hasher.update(payload);
    if hasher.finalize() != crc {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "record checksum mismatch",
        ));
    }
    Ok(Some(u64::from_le_bytes(seq_bytes)))
}

/// A record on disk: length, CRC (of seq and stored form), seq, then the stored form (the
/// acceptance time and the event, see `store::write_stamped`).
pub(crate) fn encode_record(buf: &mut Vec<u8>, seq: Seq, accepted_ms: u64, payload: &[u8]) {
    let seq_bytes = seq.to_le_bytes();
    let start = buf.len();
    buf.extend_from_slice(&[0u8; HEADER]);
    crate::store::write_stamped(buf, accepted_ms, payload);
    let stored = &buf[start + HEADER..];
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq_bytes);
    hasher.update(stored);
    let len = (stored.len() as u32).to_le_bytes();
    let crc = hasher.finalize().to_le_bytes();
    buf[start..start + 4].copy_from_slice(&len);
    buf[start + 4..start + 8].copy_from_slice(&crc);
    buf[start + 8..start + HEADER].copy_from_slice(&seq_bytes);
}

/// Writes zeros over `[from, to)` of the file.
pub(super) fn zero_fill(file: &File, from: u64, to: u64) -> std::io::Result<()> {
    static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
    let mut at = from;
    while at < to {
        let n = (to - at).min(ZEROS.len() as u64) as usize;
        file.write_all_at(&ZEROS[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Whether everything from `from` to the end of the file is zero (preallocated space).
pub(super) fn only_zeros(file: &File, from: u64) -> std::io::Result<bool> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut at = from;
    loop {
        let n = file.read_at(&mut buf, at)?;
        if n == 0 {
            return Ok(true);
        }
        if buf[..n].iter().any(|b| *b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
}

pub(super) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

pub(super) fn open_segment(dir: &Path, base: Seq) -> Result<BufReader<File>, StoreError> {
    let path = segment_path(dir, base);
    File::open(&path)
        .map(|f| BufReader::with_capacity(256 * 1024, f))
        .map_err(|e| StoreError::io(&format!("cannot open {}", path.display()), &e))
}
