//! Size limits of the on-disk caches: the least recently used entries removed until the rest fit.
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// One cache entry: when it was last used, where it is, and its size in bytes.
pub type CacheItem = (SystemTime, PathBuf, u64);

/// Removes the least recently used of `items` with `remove` while the cache's `total` bytes are
/// over `limit`. An item already gone (removed by another process) counts as removed; one that
/// cannot be removed (another user's) is passed over and the next ones removed. Returns the
/// last-use times of the items removed and the first error, with the item's path.
pub fn remove_least_recent(
    mut items: Vec<CacheItem>,
    mut total: u64,
    limit: u64,
    remove: impl Fn(&Path) -> std::io::Result<()>,
) -> (Vec<SystemTime>, Option<(PathBuf, std::io::Error)>) {
    items.sort();
    let mut removed = Vec::new();
    let mut first_error = None;
    for (used, path, bytes) in items {
        if total <= limit {
            break;
        }
        match remove(&path) {
            Ok(()) => {
                total -= bytes;
                removed.push(used);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => total -= bytes,
            Err(e) => {
                first_error.get_or_insert((path, e));
            }
        }
    }
    (removed, first_error)
}
