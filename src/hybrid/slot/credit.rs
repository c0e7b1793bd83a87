//! Optimistic credit: permits admitted before the store granted them,
//! counted until a lease call reports them.

use super::atomics::Ordering;
use super::Slot;

/// Permits admitted on credit and not yet reported.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Credit {
    /// At most `max_debt`, which configuration keeps within `u32`.
    pub(crate) debt: u32,
    /// The window the debt was admitted in (buckets: 0); read only while
    /// there is debt.
    pub(crate) window: i64,
    /// Debt sent in a lease call whose reply has not arrived: it still
    /// counts against `max_debt`, or credit could be taken twice in one
    /// window before the store says it is exhausted.
    pub(crate) in_flight: u32,
    /// Of `in_flight`, permits a denial of another quota gave back after
    /// they were sent: the store counts them, so they go back to it (and
    /// are not overshoot) once the call is answered.
    pub(crate) recalled: u32,
}

impl Slot {
    /// Optimistic mode: admits `cost` on credit in `window` if the slot's
    /// unreported and in-flight debt stays within `room`, all in one
    /// window, and the window is not closed to credit. Checked under the
    /// books lock, which [`retire`](Slot::retire) takes after marking the
    /// slot evicted: credit is either collected by `retire` or not taken.
    pub(crate) fn take_credit(&self, window: i64, cost: u64, room: u64) -> bool {
        let mut books = self.books();
        if self.evicted.load(Ordering::Acquire) {
            return false;
        }
        if books
            .credit_closed
            .get()
            .is_some_and(|closed| window <= closed)
        {
            return false;
        }
        let credit = &mut books.credit;
        if credit.debt > 0 && credit.window != window {
            return false;
        }
        if u64::from(credit.debt) + u64::from(credit.in_flight) + cost > room {
            return false;
        }
        // cost <= room <= max_debt <= u32::MAX here.
        credit.debt += cost as u32;
        credit.window = window;
        true
    }

    /// Gives back `cost` permits admitted on credit in `window` (another
    /// quota denied the request): out of the unreported debt, or, if a
    /// lease call is carrying it to the store, recalled from its answer
    /// (see [`Credit::recalled`]). `false` if neither (the store has it).
    pub(crate) fn untake_credit(&self, window: i64, cost: u64) -> bool {
        let mut books = self.books();
        let credit = &mut books.credit;
        if credit.window != window {
            return false;
        }
        if !self.evicted.load(Ordering::Acquire) && u64::from(credit.debt) >= cost {
            // cost <= debt <= u32::MAX here.
            credit.debt -= cost as u32;
            return true;
        }
        if u64::from(credit.in_flight - credit.recalled.min(credit.in_flight)) >= cost {
            credit.recalled += cost as u32;
            return true;
        }
        false
    }

    /// A lease call carrying `debt` of this slot's credit was answered
    /// (or will never be): returns what of it was recalled meanwhile.
    pub(crate) fn credit_settled(&self, debt: u64) -> u32 {
        let mut books = self.books();
        let credit = &mut books.credit;
        let debt = debt.min(u64::from(u32::MAX)) as u32;
        credit.in_flight = credit.in_flight.saturating_sub(debt);
        let recalled = credit.recalled.min(debt);
        credit.recalled -= recalled;
        recalled
    }
}
