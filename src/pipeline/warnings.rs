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
}

/// Where the list stood at [`Warnings::mark`]: what [`Warnings::forget_since`] goes back to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    kept: usize,
    dropped: usize,
}

impl Warnings {
    pub(crate) fn push(&mut self, warning: String) {
        if self.kept.len() == MAX_KEPT {
            self.kept.pop_front();
            self.dropped += 1;
        }
        self.kept.push_back(warning);
    }

    /// Where the list stands now, for [`Warnings::forget_since`].
    pub(crate) fn mark(&self) -> Mark {
        Mark {
            kept: self.kept.len(),
            dropped: self.dropped,
        }
    }

    /// Forgets the warnings pushed since `mark` (those of a generation that failed: the next
    /// take would give them as the next generation's), with no take in between. Drops since the
    /// mark stay counted only where they dropped a warning kept at the mark (those went first);
    /// the forgotten warnings' own drops are not counted.
    pub(crate) fn forget_since(&mut self, mark: Mark) {
        let since = self.dropped.saturating_sub(mark.dropped);
        let earlier_dropped = since.min(mark.kept);
        self.kept.truncate(mark.kept - earlier_dropped);
        self.dropped = mark.dropped + earlier_dropped;
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

    #[test]
    fn counts_only_the_earlier_warnings_that_forgotten_ones_dropped() {
        let mut warnings = Warnings::default();
        // More than are kept, all forgotten: nothing of the app's was dropped.
        let mark = warnings.mark();
        warnings.extend((0..MAX_KEPT + 36).map(|i| format!("failed {i}")));
        warnings.forget_since(mark);
        assert!(warnings.take().is_empty(), "no note of drops");
        // 60 kept, then 10 forgotten ones drop 6 of them: those 6 stay counted.
        warnings.extend((0..60).map(|i| format!("w{i}")));
        let mark = warnings.mark();
        warnings.extend((0..10).map(|i| format!("failed {i}")));
        warnings.forget_since(mark);
        let taken = warnings.take();
        assert_eq!(taken.len(), 55, "{taken:?}");
        assert!(
            taken[0].starts_with("6 earlier warning(s) dropped"),
            "{}",
            taken[0]
        );
        assert_eq!(taken[1], "w6");
        assert_eq!(taken[54], "w59");
        // Drops counted before the mark stay counted.
        warnings.extend((0..MAX_KEPT + 2).map(|i| format!("w{i}")));
        let mark = warnings.mark();
        warnings.extend((0..3).map(|i| format!("failed {i}")));
        warnings.forget_since(mark);
        let taken = warnings.take();
        assert!(
            taken[0].starts_with("5 earlier warning(s) dropped"),
            "{}",
            taken[0]
        );
        assert_eq!(taken.len(), MAX_KEPT - 3 + 1);
        assert_eq!(taken[1], "w5");
    }
}
