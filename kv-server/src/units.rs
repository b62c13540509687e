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
        if first >= last {
            return;
        }
        // A word at a time: a block spans tens of units.
        let (first_word, last_word) = (first / 64, (last - 1) / 64);
        for w in first_word..=last_word {
            let low = if w == first_word { first % 64 } else { 0 };
            let high = if w == last_word { (last - 1) % 64 } else { 63 };
            self.words[w as usize] |= (u64::MAX >> (63 - high)) & (u64::MAX << low);
        }
    }

    /// The runs of unmarked units, as byte extents in ascending order.
    pub fn unmarked_runs(&self) -> Vec<Extent> {
        let mut runs = Vec::new();
        let mut from = 0;
        while let Some(start) = self.next_unit(from, false) {
            let end = self.next_unit(start, true).unwrap_or(self.units);
            runs.push(self.extent(start, end));
            from = end;
        }
        runs
    }

    /// The first unit at or after `from` that is marked (or unmarked, as
    /// `marked` says). Word by word, and within a word by counting zeros:
    /// the cost is the words and runs, not the units.
    fn next_unit(&self, from: u64, marked: bool) -> Option<u64> {
        // Flipped so that the units looked for are the set bits.
        let flip = if marked { 0 } else { u64::MAX };
        let mut w = (from / 64) as usize;
        let mut bits = (self.words.get(w)? ^ flip) & (u64::MAX << (from % 64));
        while bits == 0 {
            w += 1;
            bits = self.words.get(w)? ^ flip;
        }
        // Looking for an unmarked unit may land on the last word's bits
        // past the map, which are no units.
        let unit = w as u64 * 64 + u64::from(bits.trailing_zeros());
        (unit < self.units).then_some(unit)
    }

    fn extent(&self, from: u64, to: u64) -> Extent {
        Extent {
            offset: self.start + from * UNIT,
            len: (to - from) * UNIT,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
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

    /// Unit by unit, as the map was first written: what the word-wise
    /// `mark` and `unmarked_runs` must agree with.
    fn runs_unit_by_unit(map_start: u64, units: u64, marks: &[(u64, u64)]) -> Vec<Extent> {
        let marked = |u: u64| {
            let (from, to) = (map_start + u * UNIT, map_start + (u + 1) * UNIT);
            marks
                .iter()
                .any(|&(o, l)| l > 0 && o < to && o.saturating_add(l) > from)
        };
        let mut runs: Vec<Extent> = Vec::new();
        for u in (0..units).filter(|&u| !marked(u)) {
            match runs.last_mut() {
                Some(r) if r.offset + r.len == map_start + u * UNIT => r.len += UNIT,
                _ => runs.push(ext(map_start + u * UNIT, UNIT)),
            }
        }
        runs
    }

    /// Numbers below the argument, from a xorshift seeded with `seed` (not
    /// zero): the same sequence every run, so a failing round is replayed.
    pub(crate) fn numbers_from(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below
        }
    }

    #[test]
    fn word_wise_runs_match_unit_by_unit_ones_on_random_marks() {
        let mut next = numbers_from(0x9e37_79b9_7f4a_7c15);
        for round in 0..300 {
            let (start, units) = (4096 + next(4) * UNIT, 1 + next(700));
            let mut m = UnitMap::new(start, start + units * UNIT);
            let marks: Vec<(u64, u64)> = (0..next(12))
                .map(|_| {
                    let offset = start.saturating_sub(UNIT * 3) + next((units + 6) * UNIT);
                    // Mostly short, some past a word, some zero-length.
                    (
                        offset,
                        next(if round % 3 == 0 { 150 * UNIT } else { 5 * UNIT }),
                    )
                })
                .collect();
            for &(o, l) in &marks {
                m.mark(o, l);
            }
            assert_eq!(
                m.unmarked_runs(),
                runs_unit_by_unit(start, units, &marks),
                "round {round}: marks {marks:?} on {units} units"
            );
        }
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
        m.mark(u * 100, u64::MAX); // its end would overflow: clipped
        assert_eq!(m.unmarked_runs(), vec![ext(0, u * 64), ext(u * 65, u * 35)]);
        let mut empty = UnitMap::new(u * 8, u * 8);
        empty.mark(0, u * 100);
        assert!(empty.unmarked_runs().is_empty());
    }
}
