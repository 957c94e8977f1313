//! Splitting a kernel's work across threads: the engine supplies the threads
//! (libtorch's intra-op pool on torch), the kernel says what to split.

use std::ops::Range;
use std::sync::Mutex;

/// Runs a loop body over disjoint ranges that cover `0..len`, maybe at once on
/// several threads. Engines implement it over their own thread pool.
///
/// An implementation must not let a panic of `body` unwind through foreign
/// (C or C++) frames: it catches it on the worker and raises it again on the
/// calling thread once the loop is over.
pub trait Parallel: Sync {
    /// Calls `body(start, end)` for ranges of at least `grain` items (the last
    /// may be shorter) that together cover `0..len` once each.
    fn parallel_for(&self, len: usize, grain: usize, body: &(dyn Fn(usize, usize) + Sync));
}

/// One thread: the whole range at once.
#[derive(Debug, Clone, Copy, Default)]
pub struct Serial;

impl Parallel for Serial {
    fn parallel_for(&self, len: usize, _grain: usize, body: &(dyn Fn(usize, usize) + Sync)) {
        if len > 0 {
            body(0, len);
        }
    }
}

/// Scoped standard-library threads, `threads` at most (engines without a pool
/// of their own that Kiln can reach use it).
#[derive(Debug, Clone, Copy)]
pub struct ThreadPool {
    threads: usize,
}

impl ThreadPool {
    /// At most `threads` threads (at least 1).
    pub fn new(threads: usize) -> Self {
        ThreadPool {
            threads: threads.max(1),
        }
    }

    /// As many threads as [`std::thread::available_parallelism`] reports.
    pub fn available() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl Parallel for ThreadPool {
    fn parallel_for(&self, len: usize, grain: usize, body: &(dyn Fn(usize, usize) + Sync)) {
        let grain = grain.max(1);
        let chunks = len.div_ceil(grain).min(self.threads);
        if chunks <= 1 {
            Serial.parallel_for(len, grain, body);
            return;
        }
        let per = len.div_ceil(chunks);
        std::thread::scope(|scope| {
            for start in (per..len).step_by(per) {
                scope.spawn(move || body(start, (start + per).min(len)));
            }
            // The first chunk on this thread; a panic in any is raised here
            // when the scope ends.
            body(0, per.min(len));
        });
    }
}

/// What a kernel gets from the engine besides its tensors: the threads.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    parallel: &'a dyn Parallel,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

impl<'a> Context<'a> {
    /// A context running loops on `parallel`.
    pub fn new(parallel: &'a dyn Parallel) -> Self {
        Context { parallel }
    }

    /// A context running every loop on the calling thread.
    pub fn serial() -> Context<'static> {
        Context { parallel: &Serial }
    }

    /// Calls `body` on disjoint ranges covering `0..len`, each of at least
    /// `grain` items but the last, maybe concurrently.
    pub fn parallel_for(&self, len: usize, grain: usize, body: impl Fn(Range<usize>) + Sync) {
        self.parallel
            .parallel_for(len, grain, &|start, end| body(start..end));
    }

    /// Splits `out` into rows of `row` elements and hands blocks of at least
    /// `grain_rows` rows to `body` (the index of the block's first element and
    /// the block), maybe concurrently. With `row = 1` it splits elements.
    ///
    /// ```
    /// let mut y = vec![0_u32; 10];
    /// kiln_custom_op::Context::serial().map_chunks(&mut y, 2, 1, |start, block| {
    ///     for (i, v) in block.iter_mut().enumerate() {
    ///         *v = (start + i) as u32 / 2; // the row index
    ///     }
    /// });
    /// assert_eq!(y, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]);
    /// ```
    pub fn map_chunks<T: Send>(
        &self,
        out: &mut [T],
        row: usize,
        grain_rows: usize,
        body: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let block = row.max(1) * grain_rows.max(1);
        let blocks: Vec<Mutex<&mut [T]>> = out.chunks_mut(block).map(Mutex::new).collect();
        self.parallel.parallel_for(blocks.len(), 1, &|first, last| {
            for (i, cell) in blocks.iter().enumerate().take(last).skip(first) {
                // Each block is visited by exactly one range: the lock is never contended.
                let mut guard = cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                body(i * block, &mut guard);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn thread_pool_covers_every_index_once() {
        for (len, grain, threads) in [(0, 1, 4), (1, 1, 4), (10, 3, 4), (1000, 7, 3), (9, 100, 8)] {
            let seen: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
            ThreadPool::new(threads).parallel_for(len, grain, &|s, e| {
                for v in &seen[s..e] {
                    v.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                seen.iter().all(|v| v.load(Ordering::Relaxed) == 1),
                "{len} {grain}"
            );
        }
    }

    #[test]
    fn map_chunks_hands_out_whole_rows() {
        let pool = ThreadPool::new(4);
        let mut out = vec![0usize; 3 * 41];
        Context::new(&pool).map_chunks(&mut out, 3, 5, |start, block| {
            assert_eq!(start % 3, 0);
            assert_eq!(block.len() % 3, 0);
            for (i, v) in block.iter_mut().enumerate() {
                *v = start + i;
            }
        });
        assert_eq!(out, (0..3 * 41).collect::<Vec<_>>());
    }
}
