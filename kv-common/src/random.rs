//! Numbers nobody can predict, from the kernel's randomness (getrandom(2)):
//! for what must not be guessed from outside — queue pairs' starting
//! packet numbers, access keys, secrets.

/// Fills `out` from the kernel's randomness.
pub fn fill(out: &mut [u8]) {
    let mut at = 0;
    while at < out.len() {
        let rest = &mut out[at..];
        // SAFETY: `rest` is a live, writable buffer of `rest.len()` bytes.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match got {
            n if n > 0 => at += n as usize,
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            // No getrandom (a kernel older than 3.17): std's hasher keys,
            // which it seeds from the OS's randomness, stand in.
            _ => return fill_from_std(&mut out[at..]),
        }
    }
}

fn fill_from_std(out: &mut [u8]) {
    use std::hash::BuildHasher;
    for (i, part) in out.chunks_mut(8).enumerate() {
        let word = std::collections::hash_map::RandomState::new().hash_one(i);
        part.copy_from_slice(&word.to_le_bytes()[..part.len()]);
    }
}

/// A random word.
pub fn u64() -> u64 {
    let mut word = [0u8; 8];
    fill(&mut word);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    #[test]
    fn words_differ_and_use_every_bit() {
        let words: Vec<u64> = (0..64).map(|_| super::u64()).collect();
        let mut sorted = words.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), words.len());
        assert_eq!(words.iter().fold(0, |a, w| a | w), u64::MAX);
    }

    #[test]
    fn fills_odd_lengths() {
        let mut bytes = [0u8; 37];
        super::fill(&mut bytes);
        assert!(bytes.iter().any(|&b| b != 0));
        let mut fallback = [0u8; 13];
        super::fill_from_std(&mut fallback);
        assert!(fallback.iter().any(|&b| b != 0));
    }
}
