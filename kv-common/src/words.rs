//! Word-level access to memory that other processes change at the same
//! time: the copies and atomics of the shm verbs. Each 8-byte word is read
//! or written whole (no concurrent store can tear it) and ordered as the
//! verbs need: a READ is its loads and then an Acquire fence, a WRITE a
//! Release fence and then its stores, so a block written before the CAS that
//! publishes its slot is seen whole by any reader that saw the slot.

use std::sync::atomic::{fence, AtomicU64, Ordering};

/// A READ's copy of `min(src.len(), dst.len())` words, then an Acquire
/// fence.
///
/// The compiler does not combine relaxed atomic loads into vector ones, and
/// the copy is most of a READ's work; so where 16-byte loads are documented
/// to be atomic (x86-64 with AVX: Intel SDM vol. 3A §9.1.1, AMD APM vol. 2
/// §7.3.2, for MOVDQA on 16-byte-aligned addresses) the copy is made of
/// those, which halves its loads. Elsewhere, relaxed word loads.
#[inline]
pub(crate) fn load_words(src: &[AtomicU64], dst: &mut [u64]) {
    let words = src.len().min(dst.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: both slices hold at least `words` words, 8-byte aligned
        // as every `[AtomicU64]` and `[u64]` is; `dst` is not shared; the
        // CPU has AVX.
        unsafe { load_words_aligned(src.as_ptr(), dst.as_mut_ptr(), words) };
        fence(Ordering::Acquire);
        return;
    }
    load_words_relaxed(src, dst);
}

/// `load_words` where 16-byte loads are not known to be atomic.
fn load_words_relaxed(src: &[AtomicU64], dst: &mut [u64]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.load(Ordering::Relaxed);
    }
    fence(Ordering::Acquire);
}

/// Copies `words` words with aligned 16-byte loads (a leading word first
/// when `src` is not on a 16-byte boundary, a tail of word loads).
///
/// # Safety
///
/// `src` and `dst` must be valid for `words` 8-byte-aligned words, `dst`
/// not shared, and the CPU must have AVX: then every load is an aligned
/// 8-byte MOV or an aligned 16-byte MOVDQA, each atomic, as the atomic
/// loads other processes pair with their atomic stores.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn load_words_aligned(src: *const AtomicU64, dst: *mut u64, words: usize) {
    // SAFETY: as the caller promises.
    unsafe {
        std::arch::asm!(
            // A start between 16-byte boundaries: one word to reach one.
            "test {src}, 8",
            "jz 2f",
            "test {n}, {n}",
            "jz 6f",
            "mov {t}, [{src}]",
            "mov [{dst}], {t}",
            "add {src}, 8",
            "add {dst}, 8",
            "dec {n}",
            "2:",
            "cmp {n}, 8",
            "jb 4f",
            "3:",
            "movdqa {a}, [{src}]",
            "movdqa {b}, [{src} + 16]",
            "movdqa {c}, [{src} + 32]",
            "movdqa {d}, [{src} + 48]",
            "movdqu [{dst}], {a}",
            "movdqu [{dst} + 16], {b}",
            "movdqu [{dst} + 32], {c}",
            "movdqu [{dst} + 48], {d}",
            "add {src}, 64",
            "add {dst}, 64",
            "sub {n}, 8",
            "cmp {n}, 8",
            "jae 3b",
            "4:",
            "test {n}, {n}",
            "jz 6f",
            "5:",
            "mov {t}, [{src}]",
            "mov [{dst}], {t}",
            "add {src}, 8",
            "add {dst}, 8",
            "dec {n}",
            "jnz 5b",
            "6:",
            src = inout(reg) src => _,
            dst = inout(reg) dst => _,
            n = inout(reg) words => _,
            t = out(reg) _,
            a = out(xmm_reg) _,
            b = out(xmm_reg) _,
            c = out(xmm_reg) _,
            d = out(xmm_reg) _,
            options(nostack),
        );
    }
}

/// A WRITE's copy of `min(src.len(), dst.len())` words: a Release fence,
/// then the stores, so that a CAS publishing the words is seen after them.
///
/// On x86-64 the stores are non-temporal, between two SFENCEs (the Release
/// fence is no instruction there, and non-temporal stores may pass earlier
/// stores; the second orders them before every later store, the
/// publishing CAS included):
/// a block is read by other clients, later, or by nobody (a backup's), so
/// fetching each of its lines for ownership first and keeping it in this
/// core's cache only costs. Aligned 8-byte stores are atomic whatever
/// their kind (Intel SDM vol. 3A §9.1.1). Measured (shm, YCSB-A, 100 k
/// records of 1 KB, 2 threads, steady runs): +2–4% at one copy, +4% at
/// three, whose writers store three blocks per update.
#[inline]
pub(crate) fn store_words(src: &[u64], dst: &[AtomicU64]) {
    fence(Ordering::Release);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: both slices hold at least that many words, 8-byte aligned
    // as every `[u64]` and `[AtomicU64]` is; `src` is not shared.
    unsafe {
        store_words_streaming(src.as_ptr(), dst.as_ptr(), src.len().min(dst.len()));
    }
    #[cfg(not(target_arch = "x86_64"))]
    for (d, s) in dst.iter().zip(src) {
        d.store(*s, Ordering::Relaxed);
    }
}

/// Stores `words` words with MOVNTI, between two SFENCEs.
///
/// # Safety
///
/// `src` and `dst` must be valid for `words` 8-byte-aligned words, and
/// `src` not shared: every store is then an aligned 8-byte MOVNTI, atomic
/// as the atomic loads of other processes need.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn store_words_streaming(src: *const u64, dst: *const AtomicU64, words: usize) {
    // SAFETY: as the caller promises.
    unsafe {
        std::arch::asm!(
            "sfence",
            "test {n}, {n}",
            "jz 3f",
            "2:",
            "mov {t}, [{src}]",
            "movnti [{dst}], {t}",
            "add {src}, 8",
            "add {dst}, 8",
            "dec {n}",
            "jnz 2b",
            "3:",
            "sfence",
            src = inout(reg) src => _,
            dst = inout(reg) dst => _,
            n = inout(reg) words => _,
            t = out(reg) _,
            options(nostack),
        );
    }
}

/// A FETCH-AND-ADD as the verb returns it: the old value.
#[inline]
pub(crate) fn fetch_and_add(word: &AtomicU64, add: u64) -> u64 {
    word.fetch_add(add, Ordering::SeqCst)
}

/// A CAS as the verb returns it: the old value, whether or not it swapped.
#[inline]
pub(crate) fn compare_and_swap(word: &AtomicU64, expect: u64, swap: u64) -> u64 {
    match word.compare_exchange(expect, swap, Ordering::SeqCst, Ordering::SeqCst) {
        Ok(old) | Err(old) => old,
    }
}

/// Asks for every cache line of `words` at once, so that a copy out of
/// memory waits for one round of misses rather than for the few lines its
/// loads have in flight at a time (a block is up to tens of lines).
#[inline]
pub(crate) fn prefetch_lines(words: &[AtomicU64]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = words.as_ptr() as usize;
        let end = start + std::mem::size_of_val(words);
        let mut line = start & !63;
        while line < end {
            // SAFETY: a prefetch is a hint, never an access: it neither
            // faults nor takes part in the memory model.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = words;
}

/// A word buffer's bytes (the local buffers of both backends are words,
/// so that the atomics' results land aligned).
#[inline]
pub(crate) fn as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: any u64 slice is a valid, aligned u8 slice of 8× the length.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 8) }
}

/// A word buffer's bytes, to write.
#[inline]
pub(crate) fn as_bytes_mut(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid u64.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 8) }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// Words on a 64-byte boundary, so that tests choose how far off a
    /// 16-byte one they start.
    #[repr(align(64))]
    struct Line([AtomicU64; 48]);

    fn line() -> Line {
        Line(std::array::from_fn(|i| {
            AtomicU64::new(i as u64 * 0x0101_0101_0101_0101 + 7)
        }))
    }

    type WordCopy = fn(&[AtomicU64], &mut [u64]);

    /// Each way `load_words` copies on this machine: the relaxed loads,
    /// and the aligned vector loads where the CPU has them.
    fn copies() -> Vec<(&'static str, WordCopy)> {
        let mut ways: Vec<(&str, WordCopy)> = vec![("relaxed", load_words_relaxed)];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx") {
            ways.push(("aligned", |src, dst| {
                let words = src.len().min(dst.len());
                // SAFETY: as in `load_words`, on a CPU with AVX.
                unsafe { load_words_aligned(src.as_ptr(), dst.as_mut_ptr(), words) }
            }));
        }
        ways
    }

    #[test]
    fn a_copy_takes_every_word_of_any_length_and_start() {
        let src = line();
        for (way, copy) in copies() {
            // Starts on and off a 16-byte boundary, lengths across the
            // 8-word steps of the vector copy and its word tail.
            for start in 0..3usize {
                for len in 0..=40usize {
                    let mut dst = vec![u64::MAX; len + 1];
                    copy(&src.0[start..start + len], &mut dst[..len]);
                    let want: Vec<u64> = src.0[start..start + len]
                        .iter()
                        .map(|w| w.load(Ordering::Relaxed))
                        .collect();
                    assert_eq!(dst[..len], want, "{way}: start {start} len {len}");
                    assert_eq!(
                        dst[len],
                        u64::MAX,
                        "{way}: start {start} len {len}: past the end"
                    );
                }
            }
        }
    }

    #[test]
    fn a_write_stores_every_word_of_any_length_and_start_and_nothing_past() {
        for start in 0..3usize {
            for len in 0..=40usize {
                let dst = line();
                let src: Vec<u64> = (0..len as u64).map(|i| !i).collect();
                store_words(&src, &dst.0[start..start + len]);
                for (i, w) in dst.0.iter().enumerate() {
                    let want = match i.checked_sub(start) {
                        Some(at) if at < len => src[at],
                        _ => i as u64 * 0x0101_0101_0101_0101 + 7,
                    };
                    let got = w.load(Ordering::Relaxed);
                    assert_eq!(got, want, "start {start} len {len}: word {i}");
                }
            }
        }
    }

    #[test]
    fn a_write_stores_no_more_words_than_either_side_holds() {
        let dst = line();
        store_words(&[1, 2, 3, 4], &dst.0[5..7]);
        store_words(&[9], &dst.0[10..13]);
        let got: Vec<u64> = dst.0[4..14]
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect();
        let old = |i: u64| i * 0x0101_0101_0101_0101 + 7;
        let want = [
            old(4),
            1,
            2,
            old(7),
            old(8),
            old(9),
            9,
            old(11),
            old(12),
            old(13),
        ];
        assert_eq!(got, want);
    }

    /// A block WRITE, then the CAS of the word that publishes it, as a
    /// PUT does: a reader that sees the word sees the whole block.
    #[test]
    fn a_reader_that_sees_the_publishing_cas_sees_the_whole_block() {
        let (block, flag) = (line(), AtomicU64::new(0));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut words = [0u64; 48];
                for generation in 1u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    words.fill(generation);
                    store_words(&words, &block.0);
                    compare_and_swap(&flag, generation - 1, generation);
                }
            });
            let _stop = StopOnDrop(&stop);
            let mut dst = [0u64; 48];
            let (mut seen, mut last) = (0, 0);
            for _ in 0..2_000_000 {
                let published = flag.load(Ordering::Acquire);
                load_words(&block.0, &mut dst);
                // Later WRITEs may have landed since; never an older one.
                assert!(dst.iter().all(|&w| w >= published), "{published}: {dst:?}");
                seen += usize::from(published != last);
                last = published;
                if seen >= 2_000 {
                    break;
                }
            }
            assert!(seen > 0, "the writer never published");
        });
    }

    /// Sets `stop` when dropped, so that a failed assertion ends the
    /// writer too instead of leaving the scope waiting for it.
    struct StopOnDrop<'a>(&'a AtomicBool);

    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_copy_never_tears_a_word_being_stored() {
        let src = Line(std::array::from_fn(|_| AtomicU64::new(0)));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                // Whole words, each all zeros or all ones, stored as a
                // WRITE stores them while the other thread copies them.
                let (mut flip, mut words) = (0u64, [0u64; 48]);
                while !stop.load(Ordering::Relaxed) {
                    flip = !flip;
                    for (i, w) in words.iter_mut().enumerate() {
                        *w = flip ^ (i as u64 & 1).wrapping_neg();
                    }
                    store_words(&words, &src.0);
                }
            });
            let _stop = StopOnDrop(&stop);
            // Until the copies have seen the words change many times, or
            // for a bounded number of copies on a machine too busy to run
            // both threads at once (an unaligned start, so both the word
            // and the vector loads run).
            let mut dst = [0u64; 45];
            let (mut changes, mut last) = (0, 0);
            for _ in 0..20_000_000 {
                load_words(&src.0[1..46], &mut dst);
                for &w in &dst {
                    assert!(w == 0 || w == u64::MAX, "torn word {w:#x}");
                }
                changes += usize::from(dst[0] != last);
                last = dst[0];
                if changes >= 2_000 {
                    break;
                }
            }
            assert!(changes > 0, "the copies never overlapped a store");
        });
    }
}
