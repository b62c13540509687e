//! Shared secrets from files, as every binary takes them (`--secret-file`).

use std::io::Read;
use std::path::Path;

/// Longest secret: it travels in every connect, whose message must stay
/// far within the control protocol's limit (64 KiB).
pub const MAX_SECRET: usize = 4096;

/// The file's bytes without a trailing newline (as `echo` writes one).
pub fn read_secret_file(path: &Path) -> Result<Vec<u8>, String> {
    let cannot = |e: std::io::Error| format!("cannot read secret file {}: {e}", path.display());
    let mut secret = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_SECRET as u64 + 3).read_to_end(&mut secret))
        .map_err(cannot)?;
    let too_long = || {
        format!(
            "secret file {}: longer than {MAX_SECRET} bytes",
            path.display()
        )
    };
    // Room for the secret and a line end (\r\n), and one byte to tell more.
    if secret.len() > MAX_SECRET + 2 {
        return Err(too_long());
    }
    while secret.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        secret.pop();
    }
    if secret.is_empty() {
        return Err(format!("secret file {} is empty", path.display()));
    }
    if secret.len() > MAX_SECRET {
        return Err(too_long());
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_at_most_its_limit_whatever_the_file_holds() {
        let dir = tempfile::tempdir().unwrap();
        let at = |bytes: &[u8]| {
            let path = dir.path().join("secret");
            std::fs::write(&path, bytes).unwrap();
            read_secret_file(&path)
        };
        let most = vec![b's'; MAX_SECRET];
        assert_eq!(at(&[most.as_slice(), b"\r\n"].concat()), Ok(most.clone()));
        assert!(at(&[most.as_slice(), b"x"].concat()).is_err());
        assert!(at(&[most.as_slice(), b"\n\n\nx"].concat()).is_err());
        let endless = read_secret_file(Path::new("/dev/zero")).expect_err("/dev/zero");
        assert!(endless.contains("longer than"), "{endless}");
    }
}
