//! CPU cores shared by the simulated servers' engines (`kvbench sim --cores`). Real llama.cpp
//! servers of one thread each, more of them than the machine has cores, slow each other
//! down: three on two cores compute at two thirds of their speed while all three are busy.
//! The GPU profiles never share (each server is its own GPU), so this is off by default.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

#[derive(Debug)]
pub struct SharedCores {
    cores: usize,
    busy: AtomicUsize,
}

/// One engine computing a step; it leaves the cores when dropped.
pub struct Busy(Arc<SharedCores>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Relaxed);
    }
}

impl SharedCores {
    pub fn new(cores: usize) -> Arc<Self> {
        Arc::new(Self {
            cores: cores.max(1),
            busy: AtomicUsize::new(0),
        })
    }

    /// Enters a step: how much longer than alone it takes (the engines computing now,
    /// this one included, over the cores; at least 1), and the guard that leaves.
    /// Engines that start later in the step are not counted for it, which splits the
    /// difference between a step's start and its end.
    pub fn enter(self: &Arc<Self>) -> (f64, Busy) {
        let busy = self.busy.fetch_add(1, Relaxed) + 1;
        let slowdown = (busy as f64 / self.cores as f64).max(1.0);
        (slowdown, Busy(self.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_past_the_cores_slow_each_other() {
        let cores = SharedCores::new(2);
        let (a, ga) = cores.enter();
        let (b, gb) = cores.enter();
        assert_eq!((a, b), (1.0, 1.0));
        let (c, gc) = cores.enter();
        assert_eq!(c, 1.5);
        drop((ga, gb));
        let (d, _gd) = cores.enter();
        assert_eq!(d, 1.0, "two busy again");
        drop(gc);
        assert_eq!(cores.busy.load(Relaxed), 1);
    }
}
