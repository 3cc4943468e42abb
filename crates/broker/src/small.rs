//! A small inline stack, so hot paths (routing) allocate nothing in the common case.

/// A stack that lives inline up to `N` items and spills to the heap past that.
pub struct Small<T: Copy + Default, const N: usize> {
    inline: [T; N],
    len: usize,
    spill: Vec<T>,
}

impl<T: Copy + Default, const N: usize> Small<T, N> {
    pub fn new() -> Self {
        Small {
            inline: [T::default(); N],
            len: 0,
            spill: Vec::new(),
        }
    }

    pub fn push(&mut self, v: T) {
        match self.inline.get_mut(self.len) {
            Some(slot) => {
                *slot = v;
                self.len += 1;
            }
            None => self.spill.push(v),
        }
    }

    pub fn pop(&mut self) -> Option<T> {
        if let Some(v) = self.spill.pop() {
            return Some(v);
        }
        self.len = self.len.checked_sub(1)?;
        self.inline.get(self.len).copied()
    }

    pub fn find_mut(&mut self, mut f: impl FnMut(&T) -> bool) -> Option<&mut T> {
        let len = self.len;
        self.inline
            .iter_mut()
            .take(len)
            .chain(self.spill.iter_mut())
            .find(|v| f(v))
    }

    /// Whether any item satisfies `f`.
    pub fn any(&self, f: impl FnMut(&T) -> bool) -> bool {
        self.inline
            .iter()
            .take(self.len)
            .chain(self.spill.iter())
            .any(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spills_and_pops_everything() {
        let mut s: Small<u32, 2> = Small::new();
        for i in 0..5 {
            s.push(i);
        }
        assert!(s.any(|v| *v == 4));
        assert!(!s.any(|v| *v == 9));
        if let Some(v) = s.find_mut(|v| *v == 1) {
            *v = 10;
        }
        let mut got = Vec::new();
        while let Some(v) = s.pop() {
            got.push(v);
        }
        got.sort_unstable();
        assert_eq!(got, vec![0, 2, 3, 4, 10]);
        assert_eq!(s.pop(), None);
    }
}
