//! Warnings kept for an app until it takes them ([`super::Pipeline::take_warnings`]), at most
//! [`MAX_KEPT`]: an app that never takes them (a loop that gives guidance to a distilled model on
//! every call) must not grow the pipeline's memory without end.
use std::collections::VecDeque;

/// Warnings kept between two takes; older ones are dropped first, and counted.
pub(crate) const MAX_KEPT: usize = 64;

#[derive(Debug, Default)]
pub(crate) struct Warnings {
    /// The newest warnings, oldest first.
    kept: VecDeque<String>,
    /// How many older ones were dropped since the last take.
    dropped: usize,
    /// How many were pushed, ever: [`Warnings::mark`].
    pushed: usize,
}

impl Warnings {
    pub(crate) fn push(&mut self, warning: String) {
        if self.kept.len() == MAX_KEPT {
            self.kept.pop_front();
            self.dropped += 1;
        }
        self.kept.push_back(warning);
        self.pushed += 1;
    }

    /// Where the list stands now, for [`Warnings::forget_since`].
    pub(crate) fn mark(&self) -> usize {
        self.pushed
    }

    /// Forgets the warnings pushed since `mark` (those of a generation that failed: the next
    /// take would give them as the next generation's).
    pub(crate) fn forget_since(&mut self, mark: usize) {
        let newer = self.pushed.saturating_sub(mark).min(self.kept.len());
        self.kept.truncate(self.kept.len() - newer);
        self.pushed = mark;
    }

    pub(crate) fn extend(&mut self, warnings: impl IntoIterator<Item = String>) {
        for warning in warnings {
            self.push(warning);
        }
    }

    /// The warnings kept, oldest first, led by a note of how many were dropped if any; empties
    /// the list.
    pub(crate) fn take(&mut self) -> Vec<String> {
        let dropped = std::mem::take(&mut self.dropped);
        let note = (dropped > 0).then(|| {
            format!(
                "{dropped} earlier warning(s) dropped: at most {MAX_KEPT} are kept until they are taken"
            )
        });
        note.into_iter()
            .chain(std::mem::take(&mut self.kept))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_and_counts_the_dropped_until_taken() {
        let mut warnings = Warnings::default();
        warnings.extend((0..MAX_KEPT).map(|i| format!("w{i}")));
        assert_eq!(warnings.take().len(), MAX_KEPT, "none dropped at the limit");
        warnings.extend((0..MAX_KEPT + 36).map(|i| format!("w{i}")));
        let taken = warnings.take();
        assert_eq!(taken.len(), MAX_KEPT + 1);
        assert!(
            taken[0].starts_with("36 earlier warning(s) dropped"),
            "{}",
            taken[0]
        );
        assert_eq!(taken[1], "w36");
        assert_eq!(taken[MAX_KEPT], format!("w{}", MAX_KEPT + 35));
        assert!(
            warnings.take().is_empty(),
            "taking empties the list and the count"
        );
    }

    #[test]
    fn forgets_what_was_pushed_since_a_mark() {
        let mut warnings = Warnings::default();
        warnings.push("before".into());
        let mark = warnings.mark();
        warnings.extend(["during 1".to_string(), "during 2".to_string()]);
        warnings.forget_since(mark);
        warnings.push("after".into());
        assert_eq!(warnings.take(), ["before", "after"]);
        // A mark taken before a take still forgets only what came after it.
        let mark = warnings.mark();
        warnings.push("failed".into());
        warnings.forget_since(mark);
        assert!(warnings.take().is_empty());
    }
}
