//! A bitmap over the heap in 16-byte units: which units something (a live
//! block, a lease, free space) occupies. A collection marks everything that
//! must stay, and the units left unmarked are garbage. 16 bytes is the
//! blocks' alignment, so no unit is shared by two blocks (or by a block and
//! space freed on report) and a collection frees exactly the dead blocks; a
//! 1 GiB heap takes an 8 MiB map, for the length of a collection.

use kv_common::protocol::Extent;

pub const UNIT: u64 = kv_common::layout::BLOCK_ALIGN;

pub struct UnitMap {
    start: u64,
    units: u64,
    words: Vec<u64>,
}

impl UnitMap {
    /// A map of `[start, end)` with nothing marked; `start` is unit-aligned.
    pub fn new(start: u64, end: u64) -> UnitMap {
        let units = (end - start) / UNIT;
        UnitMap {
            start,
            units,
            words: vec![0; units.div_ceil(64) as usize],
        }
    }

    /// Marks every unit that `[offset, offset + len)` touches (clipped to
    /// the map): a partly covered unit is never handed out.
    pub fn mark(&mut self, offset: u64, len: u64) {
        let end = offset.saturating_add(len);
        if len == 0 || end <= self.start {
            return;
        }
        let first = offset.saturating_sub(self.start) / UNIT;
        let last = ((end - self.start).div_ceil(UNIT)).min(self.units);
        let mut u = first;
        while u < last {
            let (w, b) = ((u / 64) as usize, u % 64);
            if b == 0 && last - u >= 64 {
                self.words[w] = u64::MAX;
                u += 64;
            } else {
                self.words[w] |= 1 << b;
                u += 1;
            }
        }
    }

    /// The runs of unmarked units, as byte extents in ascending order.
    pub fn unmarked_runs(&self) -> Vec<Extent> {
        let mut runs = Vec::new();
        let mut run_start: Option<u64> = None;
        let mut u = 0;
        while u < self.units {
            let (w, b) = ((u / 64) as usize, u % 64);
            let word = self.words[w];
            // Whole words at once where they are all one way.
            if b == 0 && self.units - u >= 64 && (word == 0 || word == u64::MAX) {
                match (word == 0, run_start) {
                    (true, None) => run_start = Some(u),
                    (false, Some(s)) => {
                        runs.push(self.extent(s, u));
                        run_start = None;
                    }
                    _ => {}
                }
                u += 64;
                continue;
            }
            let marked = word & (1 << b) != 0;
            match (marked, run_start) {
                (false, None) => run_start = Some(u),
                (true, Some(s)) => {
                    runs.push(self.extent(s, u));
                    run_start = None;
                }
                _ => {}
            }
            u += 1;
        }
        if let Some(s) = run_start {
            runs.push(self.extent(s, self.units));
        }
        runs
    }

    fn extent(&self, from: u64, to: u64) -> Extent {
        Extent {
            offset: self.start + from * UNIT,
            len: (to - from) * UNIT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn unmarked_runs_are_the_complement_of_what_was_marked() {
        let u = UNIT;
        let mut m = UnitMap::new(4096, 4096 + u * 200);
        assert_eq!(m.unmarked_runs(), vec![ext(4096, u * 200)]);
        m.mark(4096 + 1, u); // touches units 0 and 1
        m.mark(4096 + u * 70, u * 64); // a whole word's worth, unaligned
        m.mark(4096 + u * 199, 1 << 20); // clipped at the end
        m.mark(0, 10); // before the map: ignored
        assert_eq!(
            m.unmarked_runs(),
            vec![ext(4096 + 2 * u, u * 68), ext(4096 + u * 134, u * 65)]
        );
    }

    #[test]
    fn a_fully_marked_map_has_no_runs() {
        let u = UNIT;
        let mut m = UnitMap::new(0, u * 1000);
        m.mark(0, u * 1000);
        assert!(m.unmarked_runs().is_empty());
        let mut m = UnitMap::new(0, u * 128);
        m.mark(u * 64, u);
        assert_eq!(m.unmarked_runs(), vec![ext(0, u * 64), ext(u * 65, u * 63)]);
    }
}
