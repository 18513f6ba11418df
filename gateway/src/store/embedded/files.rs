//! Files and directories of the data directory, created for their owner only (0600, 0700):
//! what every file of the embedded store (and the catalog) is created with.

use std::fs::{self, File};
use std::path::Path;

/// Creates (or truncates) a file of the data directory, readable by its owner only; a file
/// left by an older version with a looser mode is tightened.
pub(crate) fn create_private(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let file = File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    if file.metadata()?.permissions().mode() & 0o077 != 0 {
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
    }
    Ok(file)
}

/// Creates a directory and its missing parents with mode 0700.
pub(crate) fn create_private_dirs(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
}
