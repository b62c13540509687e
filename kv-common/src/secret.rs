//! Shared secrets from files, as every binary takes them (`--secret-file`).

use std::path::Path;

/// The file's bytes without a trailing newline (as `echo` writes one).
pub fn read_secret_file(path: &Path) -> Result<Vec<u8>, String> {
    let mut secret = std::fs::read(path)
        .map_err(|e| format!("cannot read secret file {}: {e}", path.display()))?;
    while secret.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        secret.pop();
    }
    if secret.is_empty() {
        return Err(format!("secret file {} is empty", path.display()));
    }
    Ok(secret)
}
