//! Body bytes in flight: a worker admits an exchange's body only while it fits the worker's budget.
//!
//! The worst case of a gateway's memory is (concurrent large exchanges) x (memory per exchange); the budget bounds
//! the first factor. A declared length reserves nothing (the route's limit refuses what may not come at all); a
//! body reserves its real size when it arrives, one body at a time per exchange (the response's replaces the
//! request's: that one has left), and the reservation is released when the stream ends, however it ends (the
//! ticket is dropped with the stream). What does not fit is refused at once, never queued: a 503 fault, `busy`.

use std::sync::atomic::{AtomicU64, Ordering};

pub struct Budget {
    limit: AtomicU64,
    in_flight: AtomicU64,
}

impl Budget {
    pub const fn new(limit: u64) -> Self {
        Budget { limit: AtomicU64::new(limit), in_flight: AtomicU64::new(0) }
    }

    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Grow or shrink a reservation from `held` to `wanted` bytes; growing past the limit is refused (the
    /// reservation stays `held`) with the precise reason for the log.
    fn resize(&self, held: u64, wanted: u64) -> Result<(), String> {
        let limit = self.limit();
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                let after = now - held + wanted;
                (wanted <= held || after <= limit).then_some(after)
            })
            .map(|_| ())
            .map_err(|now| {
                let free = limit.saturating_sub(now - held);
                format!("busy: {wanted} body bytes wanted, {free} of {limit} free")
            })
    }
}

/// One exchange's reservation.
pub struct Ticket {
    budget: &'static Budget,
    held: u64,
}

impl Ticket {
    pub fn new(budget: &'static Budget) -> Self {
        Ticket { budget, held: 0 }
    }

    /// Hold `size` bytes for the body that just arrived, in place of what the exchange held before.
    pub fn take(&mut self, size: u64) -> Result<(), String> {
        self.budget.resize(self.held, size)?;
        self.held = size;
        Ok(())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let _ = self.budget.resize(self.held, 0); // shrinking never fails
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: u64) -> &'static Budget {
        Box::leak(Box::new(Budget::new(limit)))
    }

    #[test]
    fn an_exchange_holds_one_body_at_a_time_and_releases_it_when_dropped() {
        let b = budget(5000);
        let mut t = Ticket::new(b);
        t.take(800).unwrap();
        assert_eq!(b.in_flight(), 800);
        t.take(2500).unwrap(); // the response body replaces the request's
        assert_eq!(b.in_flight(), 2500);
        drop(t);
        assert_eq!(b.in_flight(), 0);
    }

    #[test]
    fn what_does_not_fit_is_refused_and_the_refused_exchange_keeps_what_it_held() {
        let b = budget(1500);
        let mut first = Ticket::new(b);
        first.take(1000).unwrap();
        let mut second = Ticket::new(b);
        second.take(200).unwrap();
        let refused = second.take(600).unwrap_err();
        assert_eq!(refused, "busy: 600 body bytes wanted, 500 of 1500 free");
        assert_eq!(b.in_flight(), 1200);
        drop(first);
        second.take(1500).unwrap(); // fits exactly
        drop(second);
        assert_eq!(b.in_flight(), 0);
    }

    #[test]
    fn a_body_larger_than_the_whole_budget_is_refused() {
        let b = budget(10);
        assert!(Ticket::new(b).take(11).is_err());
        assert_eq!(b.in_flight(), 0);
    }
}
