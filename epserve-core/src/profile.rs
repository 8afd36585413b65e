//! Where a forward pass spends its time, per phase, for `epserve bench step`.
//!
//! Off by default: a phase timer then costs one relaxed atomic load. When
//! [`set_enabled`] turns it on, every [`timer`] adds its wall time, and the
//! bytes and multiply-adds its caller declares, to process-wide totals that
//! [`take`] reads and resets. Timers may nest ([`Phase::Attention`] encloses
//! [`Phase::AttnProj`] and [`Phase::AttnOut`]); [`Profile`] keeps the raw
//! totals and the reader subtracts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A part of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Token embedding lookup.
    Embed,
    /// The whole attention block of a layer (projections, RoPE, cache
    /// writes, attention itself, output projection; local or remote).
    Attention,
    /// The q/k/v (or MLA input) projections, inside [`Phase::Attention`].
    AttnProj,
    /// The output projection, inside [`Phase::Attention`].
    AttnOut,
    /// The router's logits and top-k.
    Router,
    /// Dispatching routed tokens to the experts and waiting for them.
    Experts,
    /// Summing the weighted expert outputs.
    Combine,
    /// Shared experts.
    Shared,
    /// Dense MLP layers.
    DenseMlp,
    /// Final norm and LM head.
    LmHead,
}

impl Phase {
    /// Every phase, in the order a layer runs them.
    pub const ALL: [Phase; 10] = [
        Phase::Embed,
        Phase::Attention,
        Phase::AttnProj,
        Phase::AttnOut,
        Phase::Router,
        Phase::Experts,
        Phase::Combine,
        Phase::Shared,
        Phase::DenseMlp,
        Phase::LmHead,
    ];

    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::Attention => "attention (all)",
            Phase::AttnProj => "attn q/k/v proj",
            Phase::AttnOut => "attn o proj",
            Phase::Router => "router",
            Phase::Experts => "experts",
            Phase::Combine => "combine",
            Phase::Shared => "shared expert",
            Phase::DenseMlp => "dense mlp",
            Phase::LmHead => "lm head",
        }
    }
}

const N: usize = Phase::ALL.len();

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static BYTES: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static MACS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Turns collection on or off for the whole process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether collection is on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Totals of one phase.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTotals {
    pub seconds: f64,
    /// Weight (and cache) bytes the timed calls declared they read.
    pub bytes: u64,
    /// Multiply-adds the timed calls declared.
    pub macs: u64,
    pub calls: u64,
}

/// Totals of every phase since the last [`take`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    totals: [PhaseTotals; N],
}

impl Profile {
    /// One phase's totals.
    pub fn get(&self, p: Phase) -> PhaseTotals {
        self.totals[p as usize]
    }
}

/// Reads and resets the totals.
pub fn take() -> Profile {
    let mut out = Profile::default();
    for (i, t) in out.totals.iter_mut().enumerate() {
        t.seconds = NANOS[i].swap(0, Ordering::Relaxed) as f64 * 1e-9;
        t.bytes = BYTES[i].swap(0, Ordering::Relaxed);
        t.macs = MACS[i].swap(0, Ordering::Relaxed);
        t.calls = CALLS[i].swap(0, Ordering::Relaxed);
    }
    out
}

/// Times a phase until dropped (when collection is on).
#[must_use = "the phase is timed until the timer is dropped"]
pub struct Timer {
    on: Option<(Phase, Instant)>,
}

/// Starts timing `phase`.
#[inline]
pub fn timer(phase: Phase) -> Timer {
    Timer {
        on: enabled().then(|| (phase, Instant::now())),
    }
}

impl Timer {
    /// Declares the bytes read and multiply-adds done by the timed work (for
    /// its roofline); free when collection is off.
    #[inline]
    pub fn work(self, bytes: impl FnOnce() -> (usize, usize)) -> Self {
        if let Some((p, _)) = self.on {
            let (b, m) = bytes();
            BYTES[p as usize].fetch_add(b as u64, Ordering::Relaxed);
            MACS[p as usize].fetch_add(m as u64, Ordering::Relaxed);
        }
        self
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some((p, t0)) = self.on {
            let ns = t0.elapsed().as_nanos().min(u64::MAX as u128) as u64;
            NANOS[p as usize].fetch_add(ns, Ordering::Relaxed);
            CALLS[p as usize].fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_count_only_when_enabled() {
        // Only this test switches the process-wide state, but another
        // test's forward pass on another thread may run a router timer
        // while it is on and add its own totals: a window of microseconds,
        // so the exact totals are asked of one of a few tries, not of the
        // first.
        set_enabled(false);
        let _ = take();
        drop(timer(Phase::Router).work(|| (10, 20)));
        assert_eq!(take().get(Phase::Router), PhaseTotals::default());
        let mut seen = Vec::new();
        for _ in 0..20 {
            let _ = take();
            set_enabled(true);
            drop(timer(Phase::Router).work(|| (10, 20)));
            drop(timer(Phase::Router).work(|| (1, 2)));
            set_enabled(false);
            let p = take().get(Phase::Router);
            assert!(p.seconds >= 0.0);
            seen.push((p.bytes, p.macs, p.calls));
            if seen.last() == Some(&(11, 22, 2)) {
                break;
            }
        }
        assert_eq!(seen.last(), Some(&(11, 22, 2)), "every try: {seen:?}");
        // take resets, and a timer made while off counts nothing (a foreign
        // timer begun while on may still land once: again, a few tries).
        let resets = (0..20).any(|_| {
            drop(timer(Phase::Router).work(|| (10, 20)));
            take().get(Phase::Router).calls == 0
        });
        assert!(resets, "take resets; off counts nothing");
    }
}
