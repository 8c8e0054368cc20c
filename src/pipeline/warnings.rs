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

impl Warnings {
    pub(crate) fn push(&mut self, warning: String) {
        if self.kept.len() == MAX_KEPT {
            self.kept.pop_front();
            self.dropped += 1;
        }
        self.kept.push_back(warning);
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
}
