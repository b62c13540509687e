//! The values a multi-key GET found, in buffers a caller keeps from one
//! call to the next: [`Client::get_many_into`](crate::Client::get_many_into)
//! clears and refills them, so a loop of batches allocates nothing once
//! the buffers have grown to the values' sizes.

/// One buffer per key of the last [`get_many_into`], and whether the key
/// was found.
///
/// [`get_many_into`]: crate::Client::get_many_into
#[derive(Debug, Default, Clone)]
pub struct Values {
    buffers: Vec<Vec<u8>>,
    found: Vec<bool>,
}

impl Values {
    /// No buffers yet: the first call makes them.
    pub fn new() -> Values {
        Values::default()
    }

    /// Key `i`'s value, if it was found (None also past the last key).
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        match self.found.get(i) {
            Some(true) => Some(&self.buffers[i]),
            _ => None,
        }
    }

    /// Keys of the last call.
    pub fn len(&self) -> usize {
        self.found.len()
    }

    /// Whether the last call had no keys.
    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// Each key's value in turn, None where it was not found.
    pub fn iter(&self) -> impl Iterator<Item = Option<&[u8]>> {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Room for `n` keys, none found yet; buffers beyond `n` are kept for
    /// a later, larger call.
    pub(crate) fn reset(&mut self, n: usize) {
        if self.buffers.len() < n {
            self.buffers.resize_with(n, Vec::new);
        }
        self.found.clear();
        self.found.resize(n, false);
    }

    /// The buffers and flags of keys `range`, for one batch to fill.
    pub(crate) fn slice_mut(
        &mut self,
        range: std::ops::Range<usize>,
    ) -> (&mut [Vec<u8>], &mut [bool]) {
        (&mut self.buffers[range.clone()], &mut self.found[range])
    }
}
